"""The documentation against the code: README.md and docs/*.md cannot go stale unseen.

Four checks, each listing every problem it finds as FILE:LINE:
- every `--flag` written after a project script (in a command, or in a backticked span that names
  the script) is one the script's argparse defines;
- every repository path in a backticked span or a link exists (or is a cache .gitignore names);
- every backticked `module.name` of a project module resolves to a definition;
- every relative link resolves, and its #anchor names a heading of the file it points to.

A passage that tells history (a flag since removed, a benchmark that is gone) says `(history)`:
the paragraph, list item, table row or code block holding it is exempt, and a heading holding it
exempts its whole section. No model is loaded; the scripts are imported and their parsers read.
"""
import argparse
import dataclasses
import fnmatch
import importlib
import importlib.util
import itertools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = "(history)"
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name == ".ci"} - {"runs", "out"}
MODULES = {  # the names a reader writes before a dot -> the project module they mean
    **{m: m for m in ("agent", "grpo", "retriever", "train", "evaluate")},
    **{p.stem: f"tools.{p.stem}" for p in (ROOT / "tools").glob("*.py") if p.stem != "__init__"},
    **{p.stem: f"toy.{p.stem}" for p in (ROOT / "toy").glob("*.py") if p.stem != "__init__"},
    **{p.stem: f"data.{p.stem}" for p in (ROOT / "data").glob("*.py") if p.stem != "__init__"},
}
MODULES.update({f"tools.{k}": v for k, v in MODULES.items() if v.startswith("tools.")})
MODULES.update({f"toy.{k}": v for k, v in MODULES.items() if v.startswith("toy.")})
MODULES.update({f"data.{k}": v for k, v in MODULES.items() if v.startswith("data.")})


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


# ---------------------------------------------------------------------------------------------
# Reading the markdown: passages (exempt or not), code spans, commands, links
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Passage:
    file: Path
    line: int  # 1-based, of the passage's first line
    text: str
    code: bool  # a fenced code block


def passages(path: Path) -> list[Passage]:
    """The file's paragraphs, list items, table rows, headings and code blocks, less the exempt ones."""
    out, block, start, fence, exempt_below = [], [], 0, False, None

    def flush(code=False):
        if block and exempt_below is None and not any(HISTORY in x for x in block):
            out.append(Passage(path, start + 1, "\n".join(block), code))
        block.clear()

    for k, line in enumerate(path.read_text(encoding="utf-8").split("\n")):
        if fence:
            block.append(line)
            if line.lstrip().startswith("```"):
                fence = False
                flush(code=True)
            continue
        heading = re.match(r"(#+) ", line)
        if line.lstrip().startswith("```") or heading or not line.strip() or re.match(r"\s*([-*] |\d+\. |\|)", line):
            flush()
            start = k
        if heading:
            level = len(heading.group(1))
            if exempt_below is not None and level <= exempt_below:
                exempt_below = None
            if exempt_below is None and HISTORY in line:
                exempt_below = level
        fence = line.lstrip().startswith("```")
        if line.strip():
            block.append(line)
    flush()
    return out


def spans(passage: Passage) -> list[str]:
    """Its backticked spans (a code block is read as commands instead)."""
    return [] if passage.code else [" ".join(x.split()) for x in re.findall(r"`([^`]+)`", passage.text)]


def commands(passage: Passage) -> list[str]:
    """Shell commands: a code block's lines (joined over trailing backslashes), and backticked spans."""
    if not passage.code:
        return spans(passage)
    return [c for c in re.sub(r"\\\n\s*", " ", passage.text).split("\n")[1:-1] if c.strip()]


def links(passage: Passage) -> list[str]:
    return [] if passage.code else re.findall(r"\]\(([^)\s]+)\)", passage.text)


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen, out, fence = {}, set(), False
    for line in path.read_text(encoding="utf-8").split("\n"):
        fence = fence != line.lstrip().startswith("```")
        m = None if fence else re.match(r"#+ (.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


# ---------------------------------------------------------------------------------------------
# Reading the code: each script's flags, a dotted name's definition
# ---------------------------------------------------------------------------------------------
class Parsed(Exception):
    pass


def script_flags(script: Path) -> set[str]:
    """The option strings of the script's argparse parser: its main() is called with parsing made
    to stop at once and hand the parser over."""
    def capture(self, *args, **kwargs):
        raise Parsed(self)
    if "ArgumentParser" not in script.read_text(encoding="utf-8"):
        return set()  # reads its own argv (or none): no flags
    saved_path, saved_argv = list(sys.path), sys.argv
    sys.path.insert(0, str(script.parent))
    sys.argv = [str(script)]
    try:
        if script.parent == ROOT or script.parent.name in ("tools", "toy", "data"):  # an importable module
            module = importlib.import_module(".".join(script.relative_to(ROOT).with_suffix("").parts))
        else:  # bench/: scripts, not a package
            name = "docs_" + "_".join(script.relative_to(ROOT).with_suffix("").parts)
            spec = importlib.util.spec_from_file_location(name, script)
            module = sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(argparse.ArgumentParser, "parse_args", capture)
            mp.setattr(argparse.ArgumentParser, "parse_known_args", capture)
            try:
                module.main()
            except Parsed as got:
                parser = got.args[0]
            else:
                raise AssertionError(f"{script}: main() parsed no arguments")
    finally:
        sys.path[:], sys.argv = saved_path, saved_argv
    return {o for o in parser._option_string_actions if o.startswith("--")}


def find_script(name: str) -> Path | None:
    """A script named in the docs (a path from the root, or a bare file name found once in the
    tree) that has a main(); None for anything else (a test file, a path outside the project)."""
    found = [p for d in ("tools", "bench", "toy", "data") for p in (ROOT / d).glob(Path(name).name)]
    script = (ROOT / name) if (ROOT / name).is_file() else found[0] if len(found) == 1 and "/" not in name else None
    return script if script and "def main(" in script.read_text(encoding="utf-8") else None


def resolves(dotted: str) -> bool:
    """`module.name[.attr...]`: the module imports and each part is an attribute or a dataclass field."""
    parts = dotted.split(".")
    for k in (2, 1):  # tools.runs.x before runs.x
        head = ".".join(parts[:k])
        if head in MODULES:
            obj, rest = importlib.import_module(MODULES[head]), parts[k:]
            break
    else:
        return True  # not a project module: not ours to check
    for part in rest:
        fields = getattr(obj, "__dataclass_fields__", {})
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif part in fields:
            obj = fields[part].type
        else:
            return False
    return True


def ignored(path: str) -> bool:
    """A path .gitignore names (a cache made on first use, a download): not in a clean clone."""
    patterns = [p.strip().rstrip("/") for p in (ROOT / ".gitignore").read_text().split("\n") if p.strip() and not p.startswith("#")]
    parts = path.rstrip("/").split("/")
    return any(fnmatch.fnmatch(path.rstrip("/"), p) or any(fnmatch.fnmatch("/".join(parts[:k]), p) for k in range(1, len(parts) + 1))
               or fnmatch.fnmatch(parts[-1], p) for p in patterns)


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------
SCRIPT = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
FLAGS: dict[Path, set[str]] = {}


OTHER_TOOLS = {"--no-deps", "--index-url", "--headless", "--dump-dom", "--window-size", "--screenshot"}  # pip's, chromium's


def any_script_flags() -> set[str]:
    """Every flag of every project script, and of the launchers the docs name beside them
    (accelerate launch and torchrun, read from their own parsers; pip's and chromium's few)."""
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.run import get_args_parser

    launchers = {o for parser in (launch_command_parser(), get_args_parser()) for o in parser._option_string_actions}
    FLAGS[Path("launchers")] = launchers | OTHER_TOOLS
    for script in (p for d in ("", "tools", "bench", "toy", "data") for p in sorted((ROOT / d).glob("*.py"))):
        if script.name != "__init__.py" and find_script(str(script.relative_to(ROOT))) and script not in FLAGS:
            FLAGS[script] = script_flags(script)
    return set().union(*FLAGS.values())


def flag_problems(docs=DOCS) -> list[str]:
    """Flags after a script name are that script's; a span of flags alone (`--oracle_per_group 1`)
    must be some project script's."""
    problems, known = [], any_script_flags()
    for path in docs:
        for p in passages(path):
            for span in spans(p):
                if span.startswith("--"):
                    problems += [f"{rel(path)}:{p.line}: {flag} is no project script's flag (in `{span[:120]}`)"
                                 for flag in FLAG.findall(span) if flag not in known]
            for command in commands(p):
                for part in re.split(r"\|\||&&|;|\|(?!\|)| #", command):  # each command of a pipeline or list
                    m = SCRIPT.search(part)
                    script = find_script(m.group(1)) if m else None
                    if script is None:
                        continue
                    if script not in FLAGS:
                        FLAGS[script] = script_flags(script)
                    for flag in FLAG.findall(part[m.end():]):
                        if flag not in FLAGS[script] and flag != "--help":
                            problems.append(f"{rel(path)}:{p.line}: {flag} is not a flag of "
                                            f"{rel(script)} (in `{part.strip()[:120]}`)")
    return problems


def each(docs, pick):
    """(where, item) for every item `pick(passage)` finds in the docs' passages; where = FILE:LINE."""
    return [(f"{rel(path)}:{p.line}", item) for path in docs for p in passages(path) for item in pick(p)]


def path_problems(docs=DOCS) -> list[str]:
    problems = []
    for where, span in each(docs, spans):
        token = re.sub(r":\d+$", "", span.split()[0]) if span.split() else ""
        if "/" not in token or token.split("/")[0] not in TOP or re.search(r"[<>*{}$]|\.\.\.", token) or (ROOT / token).exists():
            continue
        named = re.fullmatch(r"((?:\w+/)+\w+)\.(\w+(?:\.\w+)*)", token)  # `tools/runs.peak_memory`: a name in a file
        if named and (ROOT / f"{named.group(1)}.py").is_file():
            if not resolves(".".join(named.group(1).split("/")[-1:] + [named.group(2)])):
                problems.append(f"{where}: `{token}` names nothing in {named.group(1)}.py")
        elif not ignored(token):
            problems.append(f"{where}: `{token}` is not in the repository")
    return problems


def name_problems(docs=DOCS) -> list[str]:
    problems = []
    for where, span in each(docs, spans):
        m = re.fullmatch(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(\(.*\))?", span.strip())
        if m and not re.search(r"\.(py|md|json|jsonl|txt|png|html|gguf|yaml|sh)$", m.group(1)) and not resolves(m.group(1)):
            problems.append(f"{where}: `{m.group(1)}` names nothing in the code")
    return problems


def link_problems(docs=DOCS) -> list[str]:
    problems = []
    for path in docs:
        for p in passages(path):
            for target in links(p):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto: outside the repository
                file, _, anchor = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                where = f"{rel(path)}:{p.line}"
                if not dest.exists():
                    problems.append(f"{where}: link to {target}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    problems.append(f"{where}: link to {target}: no heading #{anchor} in {rel(dest)}")
    return problems


def makefile() -> tuple[set[str], dict[str, str]]:
    """The Makefile's targets and its variables' defaults (comments cut)."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([a-z][\w-]*):", text, re.M))
    defaults = {k: v.split(" #")[0].strip() for k, v in re.findall(r"^([A-Z_]+) [?:]?= ?(.*)$", text, re.M)}
    return targets, defaults


def make_problems(docs=DOCS) -> list[str]:
    """`make TARGET VAR=...`: the target and variables exist; "`VAR` (default `VALUE`)": the Makefile's value."""
    problems, (targets, defaults) = [], makefile()
    for path in docs:
        for p in passages(path):
            for command in commands(p):
                for m in re.finditer(r"(?<![\w-])make ([a-z][\w-]*)((?: [A-Z_]+=(?:\"[^\"]*\"|\S+))*)", command):
                    if m.group(1) not in targets:
                        problems.append(f"{rel(path)}:{p.line}: `make {m.group(1)}`: no such Makefile target")
                    problems += [f"{rel(path)}:{p.line}: {v}: no such Makefile variable"
                                 for v in re.findall(r"([A-Z_]+)=", m.group(2)) if v not in defaults]
            if not p.code:
                text = " ".join(p.text.split())
                for name, value in re.findall(r"`([A-Z_]+)` \(default `([^`]+)`", text):
                    if name in defaults and value != defaults[name]:
                        problems.append(f"{rel(path)}:{p.line}: `{name}` defaults to `{defaults[name]}`, not `{value}`")
    return problems


def results_problems(readme=ROOT / "README.md", results=ROOT / "docs" / "agents") -> list[str]:
    """The README's results table is the agents' comparison, made again from the evaluations kept
    in docs/agents (toy/compare_agents.py readme_table): a figure copied by hand cannot drift."""
    from toy import compare_agents
    want = compare_agents.readme_table(compare_agents.load_results(str(results), compare_agents.STEPS), compare_agents.STEPS)
    lines = readme.read_text(encoding="utf-8").split("\n")
    if want[0] not in lines:
        return [f"{rel(readme)}: no results table headed {want[0]}"]
    start = lines.index(want[0])
    have = [line for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start:])]
    return [f"{rel(readme)}:{start + k + 1}: the results table reads {h!r}; the kept evaluations give {w!r}"
            for k, (h, w) in enumerate(itertools.zip_longest(have, want)) if h != w]


@pytest.mark.parametrize("check", [flag_problems, path_problems, name_problems, link_problems, make_problems, results_problems],
                         ids=lambda c: c.__name__)
def test_the_docs_say_what_the_code_does(check):
    problems = check()
    assert not problems, f"{len(problems)} stale reference(s):\n" + "\n".join(problems)


def test_readme_is_read_in_one_sitting():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").split("\n")) <= 250


# ---------------------------------------------------------------------------------------------
# The checks themselves, on planted text
# ---------------------------------------------------------------------------------------------
def test_each_check_finds_what_is_planted_and_spares_history(tmp_path):
    doc = tmp_path / "planted.md"
    doc.write_text("\n".join([
        "# Planted", "",
        "```bash", "python train.py --max_steps 2 \\", "    --no_such_flag 3   # a comment --not_checked", "```", "",
        "Run `python evaluate.py --agent react --bogus` then `accelerate launch --num_processes 2 train.py --lr 1e-6`.", "",
        "- `agent.rollout` and `agent.no_such_function`, `grpo.policy_loss(...)`, `torch.nope` (not ours).",
        "- `toy/oracle.py` and `toy/no_such_file.py`; `runs/anything/x.json` is an output.", "",
        "[ok](#planted) [bad anchor](#nowhere) [no file](missing.md) [site](https://example.org)", "",
        "`make run EVAL_LIMIT=4 NO_SUCH=1` and `make nothing`; `EVAL_ARGS` (default `--max_turns 5`).", "",
        "## Old ways (history)", "", "`python train.py --reroll_turn 1` was removed.", "",
        "## Back", "", "| a | `python train.py --old_flag` (history) |", "",
    ]))
    assert [x.split(": ", 1)[1].split(" (in")[0] for x in flag_problems([doc])] == [
        "--no_such_flag is not a flag of train.py", "--bogus is not a flag of evaluate.py"]
    assert [x.split(": ", 1)[1] for x in name_problems([doc])] == ["`agent.no_such_function` names nothing in the code"]
    assert [x.split(": ", 1)[1] for x in path_problems([doc])] == ["`toy/no_such_file.py` is not in the repository"]
    assert [x.split(": ", 1)[1] for x in make_problems([doc])] == [
        "NO_SUCH: no such Makefile variable", "`make nothing`: no such Makefile target",
        "`EVAL_ARGS` defaults to `%s`, not `--max_turns 5`" % makefile()[1]["EVAL_ARGS"]]
    assert [x.split(": ", 1)[1] for x in link_problems([doc])] == [
        "link to #nowhere: no heading #nowhere in planted.md", "link to missing.md: no such file"]


def test_slugs_as_github_makes_them(tmp_path):
    assert slug("What `make run` costs") == "what-make-run-costs"
    assert slug("GRPO past 4 steps: the toy world's learning curve") == "grpo-past-4-steps-the-toy-worlds-learning-curve"
    assert slug("4b. Two machines") == "4b-two-machines"
    assert slug("Paper → code") == "paper--code"
    doc = tmp_path / "a.md"
    doc.write_text("# Tries\n\n```\n# not a heading\n```\n\n## Tries\n")
    assert anchors(doc) == {"tries", "tries-1"}


def test_a_results_figure_copied_by_hand_is_caught(tmp_path):
    from toy import compare_agents
    results = tmp_path / "agents"
    for world in ("toy",):
        for name in ("memsearcher",):
            (results / name / world).mkdir(parents=True)
    rows = [{"dataset": "toy", "id": str(i), "prediction": "x", "em": float(i % 2), "f1": float(i % 2), "acc": 0.0,
             "reward": 0.0, "end_reason": "answer", "num_turns": 2, "num_searches": 1, "context_tokens": [10, 20],
             "type": "single", "chain": ["a"], "queries": [["a"]]} for i in range(6)]
    for step in (0, compare_agents.STEPS):
        compare_agents.write_jsonl(str(results / "memsearcher" / "toy" / f"test-{step}.jsonl"), rows)
    table = compare_agents.readme_table(compare_agents.load_results(str(results), compare_agents.STEPS), compare_agents.STEPS)
    readme = tmp_path / "README.md"
    readme.write_text("# r\n\n" + "\n".join(table) + "\n\nafter\n")
    assert results_problems(readme, results) == []
    readme.write_text("# r\n\n" + "\n".join(table).replace("0.50 / 0.50 |", "0.51 / 0.50 |", 1) + "\n")
    assert [p.split(": ", 1)[1].split(";")[0] for p in results_problems(readme, results)] == [
        f"the results table reads {table[2].replace('0.50 / 0.50 |', '0.51 / 0.50 |', 1)!r}"]
    readme.write_text("# r\n")
    assert results_problems(readme, results) == [f"README.md: no results table headed {table[0]}"]
