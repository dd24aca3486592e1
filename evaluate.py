"""Evaluate a search agent on QA benchmarks: EM, F1, acc (cover EM), and the efficiency report.

    python evaluate.py                                    # embedded default on the toy test set
    python evaluate.py --model M --data FILE_OR_DIR [...] [--agent memsearcher|react] \\
        [--retriever_url URL | --corpus C --index I --encoder E] [--output_dir DIR] [--limit N]
    accelerate launch evaluate.py ...                     # questions sharded across processes
    torchrun --nproc_per_node 2 evaluate.py ...           # two CPU processes (gloo)
    python evaluate.py --compare A/results.json B/results.json   # side by side; two runs: B - A, paired

As in the paper and its release (docs/design.md): greedy, at most 20 turns, an invalid memory update resets the
memory; weights in bfloat16 on a GPU, float32 on a CPU (--dtype, part of what a resume matches).
Data: FlashRAG jsonl (a file per dataset, a folder of them, or FlashRAG's folder of dataset folders,
each benchmark's paper split taken: nq/test.jsonl is "nq", hotpotqa/dev.jsonl "hotpotqa") or
Search-R1's or the release's parquet (rows carry `data_source`). In --output_dir (default runs/eval/<agent>):
- predictions.jsonl: every trajectory in full, one line per question (`record`);
- results.json: {"run", "config", "datasets": {name: metrics}, "average": metrics} (`summarize`);
  "average" is the paper's Avg (mean over datasets) for EM, F1, acc, turns, searches and seconds,
  and pools all questions for the rest;
- results.md: the paper's main-table layout, datasets as columns, Avg last;
- context_tokens_per_turn.png (with matplotlib): Figure 3, with the other agent's curve when a
  sibling folder (runs/eval/react beside runs/eval/memsearcher) holds its results.
Each rank appends finished chunks to its own predictions.rank*.jsonl, which the main process folds
into predictions.jsonl at the end; a rerun into the same folder skips finished questions.

1. data   2. metrics   3. evaluation (sharded, resumable)   4. aggregation   5. reports   6. main
"""
import argparse
import ast
import glob
import itertools
import json
import os
import random
import time
import uuid
from collections import Counter
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed
from tqdm import tqdm

import agent
import retriever
from tools import models, runs
from data.questions import SPLITS, data_files, load_questions

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DATA = os.path.join(HERE, "data", "toy", "test.jsonl")

# ---------------------------------------------------------------------------------------------
# 1. Data: files -> {dataset: questions}, each question with its position in its dataset
# ---------------------------------------------------------------------------------------------
PAPER_DATASETS = {"nq": "NQ", "triviaqa": "TriviaQA", "popqa": "PopQA", "hotpotqa": "HotpotQA",
                  "2wikimultihopqa": "2Wiki", "musique": "MuSiQue", "bamboogle": "Bamboogle"}


def paper_order(names) -> list[str]:
    """The paper's seven datasets in its column order, then any others as they came."""
    known = list(PAPER_DATASETS)
    return sorted(names, key=lambda n: known.index(n.lower()) if n.lower() in known else len(known))


def load_datasets(paths: list[str], limit: int | None = None, seed: int = 0) -> dict[str, list[dict]]:
    """Every question of every file; a bad row stops everything with its file and line. `limit`
    keeps a seeded sample per dataset (a prefix of one fixed shuffle: raising it keeps old picks)."""
    datasets = {}
    try:
        files = data_files(paths)
    except ValueError as e:
        raise SystemExit(f"evaluate.py: {e}") from None
    for path in files:
        stem = os.path.splitext(os.path.basename(path))[0]
        folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
        try:
            questions = load_questions(path)
        except (ValueError, ImportError, OSError) as e:
            raise SystemExit(f"evaluate.py: {e}") from None
        for q in questions:
            if q["dataset"] == stem and stem.lower() in SPLITS:  # FlashRAG layout: nq/test.jsonl is "nq"
                q["dataset"] = folder
            datasets.setdefault(q["dataset"], []).append(q)
    for name, questions in datasets.items():
        ids = Counter(q["id"] for q in questions)
        if max(ids.values()) > 1:
            raise SystemExit(f"evaluate.py: dataset {name}: duplicate id {ids.most_common(1)[0][0]!r}")
        for k, q in enumerate(questions):
            q["index"] = k
        if limit and len(questions) > limit:
            order = list(range(len(questions)))
            random.Random(seed).shuffle(order)
            datasets[name] = [questions[i] for i in sorted(order[:limit])]
    return {name: datasets[name] for name in paper_order(datasets)}


RELEASE_CLIENT = os.path.join("memsearcher", "inference", "memsearcher.py")  # in a clone of the release


def release_prompts(clone: str) -> dict:
    """The release's own prompt texts, read at run time from a clone of it (nothing of them is kept
    here): in its evaluation client, the last `system_prompt` class MemSearcher assigns, and the
    instruction its `cat_tool_results` writes after each `</tool_response>`. Parsed, not run."""
    path = os.path.join(clone, RELEASE_CLIENT)
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError) as e:
        raise SystemExit(f"evaluate.py: --release_prompts: cannot read {path} ({e})") from None
    body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MemSearcher"), [])
    systems = [n.value.value for n in body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
               and any(getattr(t, "id", None) == "system_prompt" for t in n.targets)]
    method = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == "cat_tool_results"]
    texts = [c.value for m in method for f in ast.walk(m) if isinstance(f, ast.JoinedStr) for c in f.values
             if isinstance(c, ast.Constant) and "</tool_response>\n" in c.value]
    if not systems or not texts:
        raise SystemExit(f"evaluate.py: --release_prompts: {path} has no MemSearcher.system_prompt and cat_tool_results "
                         "text where the release keeps them (another version of the release?)")
    return {"system_prompt": systems[-1].strip(), "memory_instruction": texts[-1].split("</tool_response>\n", 1)[1].strip()}


def release_tool_error(parsed) -> str | None:
    """The release's tool checks and texts (its evaluation client and training rollout alike), for
    `--release_prompts`: no `arguments` -> "Parse tool call failed"; arguments not an object ->
    "Parse query failed"; an empty query -> "invalid query"; what its server refuses (a query not a
    string, a top_n not an integer >= 1) -> its status, "error: 400"; else None (the call runs)."""
    if not isinstance(parsed, dict) or "arguments" not in parsed:
        return "Parse tool call failed"
    args = parsed["arguments"]
    if not isinstance(args, dict):
        return "Parse query failed"
    query, top_n = args.get("query", ""), args.get("top_n", 1)
    if query == "":
        return "invalid query"
    bad_top_n = isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1
    return "error: 400" if not isinstance(query, str) or bad_top_n else None


# ---------------------------------------------------------------------------------------------
# 2. Metrics: EM and F1 are agent.py's (the reward's normalisation); acc is cover EM
# ---------------------------------------------------------------------------------------------
def cover_match(prediction: str | None, golds: list[str]) -> float:
    """"acc": some normalised gold answer is contained in the normalised prediction."""
    if prediction is None:
        return 0.0
    pred = agent.normalize_answer(prediction)
    return float(any(gold and gold in pred for gold in map(agent.normalize_answer, golds)))


def evidence_share(trajectory: agent.Trajectory, supporting_ids) -> float:
    """Evidence recall: the share of the question's supporting passages whose corpus ids are among
    the documents the trajectory retrieved (toy worlds carry their ids; the toy recipe's evidence
    credit, train.py --evidence_weight, is the same share, as David-GRPO's evidence-guided reward).

        E = |supporting ∩ retrieved| / |supporting|          (0 for a question without supporting ids)
    """
    wanted = {str(i) for i in supporting_ids or ()}
    seen = {i for turn in trajectory.turns for ids in turn.get("document_ids", ()) for i in ids}
    return len(wanted & seen) / len(wanted) if wanted else 0.0


def record(q: dict, t: agent.Trajectory, seconds: float, peak_memory: int | None, run: dict) -> dict:
    """One line of predictions.jsonl: the question, the scores, and the whole trajectory."""
    return {"dataset": q["dataset"], "id": q["id"], "index": q["index"], "question": q["question"],
            "golden_answers": q["golden_answers"], "prediction": t.prediction,
            "em": agent.exact_match(t.prediction, q["golden_answers"]), "f1": agent.f1_score(t.prediction, q["golden_answers"]),
            "acc": cover_match(t.prediction, q["golden_answers"]), "reward": t.reward, "end_reason": t.end_reason,
            "num_turns": t.num_turns, "num_searches": t.num_searches, "context_tokens": t.context_tokens,
            "memory": t.memory, "turns": t.turns, "seconds": seconds, "peak_memory_bytes": peak_memory, "run": run,
            "evidence": evidence_share(t, supporting) if (supporting := (q.get("metadata") or {}).get("supporting_ids"))
            else None}  # share of the question's supporting passages retrieved (toy worlds carry their ids)


# ---------------------------------------------------------------------------------------------
# 3. Evaluation: this rank's share in chunks; finished chunks are appended and flushed
#    (the prediction files, their resume and merge: tools/runs.py)
# ---------------------------------------------------------------------------------------------
def evaluate_shard(model, tokenizer, search, questions, args, run, path, generate_fn, show_progress):
    """Greedy rollouts in chunks of --batch_size questions of one dataset, each finished chunk
    appended to `path` and flushed: an interruption loses at most one chunk."""
    groups = [list(g) for _, g in itertools.groupby(questions, key=lambda q: q["dataset"])]
    chunks = [g[i:i + args.batch_size] for g in groups for i in range(0, len(g), args.batch_size)]
    settings = agent.RolloutSettings(
        agent=args.agent, greedy=True, evaluation=True, max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
        max_memory_tokens=args.max_memory_tokens, max_response_tokens=args.max_response_tokens,
        default_top_n=args.default_top_n, max_top_n=args.max_top_n, system_prompt=run["system_prompt"],
        memory_instruction=run["memory_instruction"], tool_error=release_tool_error if run["tool_texts"] == "release" else None)
    with open(path, "a", encoding="utf-8") as f, tqdm(total=len(questions), disable=not show_progress, desc="questions") as bar:
        for chunk in chunks:
            runs.peak_memory(reset=True)
            t0 = time.time()
            trajectories = agent.rollout(model, tokenizer, chunk, search, settings, generate_fn=generate_fn)
            seconds, peak = (time.time() - t0) / len(chunk), runs.peak_memory()
            f.writelines(json.dumps(record(q, t, seconds, peak, run), ensure_ascii=False) + "\n"
                         for q, t in zip(chunk, trajectories))
            f.flush()
            bar.update(len(chunk))


# ---------------------------------------------------------------------------------------------
# 4. Aggregation: per dataset, and the Avg column
# ---------------------------------------------------------------------------------------------
INTERVAL_METRICS = ("em", "f1", "acc", "format_valid", "turns", "searches")


def bootstrap_interval(values: list[float], resamples: int = 1000, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of the mean, resampling questions with replacement."""
    if not values:
        return [float("nan"), float("nan")]
    rng, n = random.Random(seed), len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return [means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]]


def summarize(records: list[dict]) -> dict:
    n = len(records)
    mean = lambda values: sum(values) / max(len(values), 1)  # noqa: E731
    contexts = [r["context_tokens"] for r in records]
    per_turn = [[c[k] for c in contexts if len(c) > k] for k in range(max(map(len, contexts), default=0))]
    memory = [r["peak_memory_bytes"] for r in records if r.get("peak_memory_bytes") is not None]
    all_turns = [tokens for c in contexts for tokens in c]
    values = {"em": [r["em"] for r in records], "f1": [r["f1"] for r in records], "acc": [r["acc"] for r in records],
              "format_valid": [float(r["reward"] > 0) for r in records],  # the final conversation passed the format check
              "turns": [r["num_turns"] for r in records], "searches": [r["num_searches"] for r in records]}
    return {"n": n, **{m: mean(values[m]) for m in ("em", "f1", "acc", "format_valid")},
            "interval": {m: bootstrap_interval(values[m]) for m in INTERVAL_METRICS},
            "turns": mean([r["num_turns"] for r in records]), "searches": mean([r["num_searches"] for r in records]),
            "context_tokens_mean": mean(all_turns), "context_tokens_max": max(all_turns, default=0),
            "context_tokens_per_turn": {"mean": [mean(t) for t in per_turn], "max": [max(t) for t in per_turn],
                                        "n": [len(t) for t in per_turn]},
            "peak_context_tokens": mean([max(c, default=0) for c in contexts]),  # per question: its largest context
            "total_context_tokens": mean([sum(c) for c in contexts]),  # per question: all its turns' contexts
            "seconds_per_question": mean([r["seconds"] for r in records]),
            "peak_memory_gb": max(memory) / 2**30 if memory else None,
            "end_reasons": dict(Counter(r["end_reason"] for r in records)),
            "evidence_recall": mean(evidence) if (evidence := [r["evidence"] for r in records if r.get("evidence") is not None])
            else None}


def aggregate(records: list[dict], names: list[str]) -> tuple[dict, dict]:
    datasets = {name: summarize([r for r in records if r["dataset"] == name]) for name in names}
    average = summarize(records)  # pooled over all questions ...
    for m in ("em", "f1", "acc", "format_valid", "turns", "searches", "seconds_per_question"):  # ... except the paper's Avg
        average[m] = sum(d[m] for d in datasets.values()) / len(datasets)
    return datasets, average


# ---------------------------------------------------------------------------------------------
# 5. Reports: the main table, context tokens per turn, the Figure 3 plot, --compare
# ---------------------------------------------------------------------------------------------
ROWS = [("EM", "em", "{:.3f}"), ("F1", "f1", "{:.3f}"), ("acc", "acc", "{:.3f}"), ("format-valid", "format_valid", "{:.3f}"),
        ("turns / question", "turns", "{:.2f}"), ("searches / question", "searches", "{:.2f}"),
        ("evidence recall", "evidence_recall", "{:.3f}"),
        ("context tokens / turn", "context_tokens_mean", "{:.0f}"),
        ("peak context tokens / question", "peak_context_tokens", "{:.0f}"),
        ("seconds / question", "seconds_per_question", "{:.2f}"), ("peak memory GB", "peak_memory_gb", "{:.2f}"),
        ("questions", "n", "{}")]
AGENTS = {"memsearcher": "MemSearcher", "react": "ReAct"}


def label(results: dict) -> str:
    model = results["run"]["model"]
    return f"{AGENTS[results['run']['agent']]} ({os.path.basename(model.rstrip('/')) or model})"


def read_reference(path: str | None) -> dict | None:
    """--reference FILE: published EM to print beside ours, e.g. a row of the paper's main table:
    {"method": "MemSearcher 3B (paper)", "source": "where the numbers come from", "em": {"nq": 0.4, ...}}
    (dataset names as in --data; EM in [0, 1]). No numbers ship with this project."""
    if path is None:
        return None
    ref = read_json(path)
    if not (isinstance(ref.get("method"), str) and isinstance(ref.get("source"), str) and isinstance(ref.get("em"), dict)
            and all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in ref["em"].values())):
        raise SystemExit(f"--reference {path}: expected {{\"method\": str, \"source\": str, \"em\": {{dataset: EM in [0, 1]}}}}")
    return ref


def reference_rows(reference: dict, ours: tuple[str, dict], names: list[str]) -> list[str]:
    """The published EM and ours minus it, per dataset both have; Avg only where both cover the same datasets."""
    em = {k.lower(): v for k, v in reference["em"].items()}
    theirs = [em.get(n.lower()) for n in names]
    same = set(em) == {n.lower() for n in names}
    avg = sum(theirs) / len(theirs) if same else None
    mine = [ours[1]["datasets"][n]["em"] for n in names] + [ours[1]["average"]["em"]]
    show = lambda v, sign="": "–" if v is None else f"{v:{sign}.3f}"  # noqa: E731
    return [f"| {reference['method']} | EM | " + " | ".join(show(v) for v in theirs + [avg]) + " |",
            f"| {ours[0]} minus it | EM | " + " | ".join(show(None if t is None else m - t, "+")
                                                       for m, t in zip(mine, theirs + [avg])) + " |"]


def report(methods: list[tuple[str, dict]], reference: dict | None = None) -> str:
    """Markdown: rows (metric, method), datasets as columns, Avg last (after EM, a --reference's
    published EM and the first method's difference from it); then context tokens per turn."""
    names = paper_order(dict.fromkeys(n for _, res in methods for n in res["datasets"]))
    def cell(fmt, summary, m, interval=True):  # the value, with its 95% bootstrap interval where there is one
        if summary is None or summary.get(m) is None:
            return "–"
        lo_hi = summary.get("interval", {}).get(m) if interval else None
        return fmt.format(summary[m]) + (f" [{fmt.format(lo_hi[0])}, {fmt.format(lo_hi[1])}]" if lo_hi else "")

    lines = ["| Method | Metric | " + " | ".join(PAPER_DATASETS.get(n.lower(), n) for n in names) + " | Avg |",
             "| --- " * (len(names) + 3) + "|"]
    for title, m, fmt in ROWS:
        for name, res in methods:
            cells = [cell(fmt, res["datasets"].get(n), m) for n in names] + [cell(fmt, res["average"], m, interval=False)]
            lines.append(f"| {name} | {title} | " + " | ".join(cells) + " |")
        if m == "em" and reference:
            lines += reference_rows(reference, methods[0], names)
    turns = max(len(res["average"]["context_tokens_per_turn"]["mean"]) for _, res in methods)
    lines += ["", "Context tokens per turn, all questions (mean / max; questions still running at that turn):", "",
              "| Method | " + " | ".join(f"turn {k}" for k in range(1, turns + 1)) + " |", "| --- " * (turns + 1) + "|"]
    for name, res in methods:
        c = res["average"]["context_tokens_per_turn"]
        lines.append(f"| {name} | " + " | ".join(f"{a:.0f} / {b} ({n})" for a, b, n in zip(c["mean"], c["max"], c["n"]))
                     + " |" * (turns - len(c["mean"]) + 1))
    kinds = sorted({res["config"]["memory_kind"] for _, res in methods})
    return "\n".join(lines) + f"\n\nPeak memory: {', '.join(kinds)}. Avg: mean over datasets (EM, F1, acc, format, turns, " \
        "searches, seconds); all questions pooled (context tokens); max (memory). [a, b]: 95% bootstrap interval " \
        "over questions (1,000 resamples). format-valid: the final conversation passed the reward's format check.\n" \
        + (f"\n{reference['method']}: {reference['source']}.\n" if reference else "")


def plot_context_tokens(methods: list[tuple[str, dict]], path: str):
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot (pip install matplotlib to get {os.path.basename(path)})")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, res in methods:
        curve = res["average"]["context_tokens_per_turn"]
        turns = range(1, len(curve["mean"]) + 1)
        (line,) = ax.plot(turns, curve["mean"], marker="o", label=f"{name} mean")
        ax.plot(turns, curve["max"], linestyle="--", marker="x", color=line.get_color(), label=f"{name} max")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("turn")
    ax.set_ylabel("tokens in context")
    ax.set_title("Context tokens per turn")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def paired_difference(a: list[dict], b: list[dict]) -> dict:
    """B - A over the questions both runs answered (matched by dataset and id): per score the mean
    difference and its 95% bootstrap interval, resampling those questions. Both runs saw the same
    questions, so this paired interval is the test of "B beats A", tighter than two runs' intervals."""
    first = {(r["dataset"], r["id"]): r for r in a}
    pairs = [(first[(r["dataset"], r["id"])], r) for r in b if (r["dataset"], r["id"]) in first]
    out = {"n": len(pairs)}
    for m in ("em", "f1", "acc"):
        d = [y[m] - x[m] for x, y in pairs]
        out[m] = (sum(d) / len(d) if d else float("nan"), bootstrap_interval(d))
    return out


def compare(paths: list[str], output_dir: str | None, reference: dict | None = None):
    methods = [(f"{label(res)} [{os.path.basename(os.path.dirname(os.path.abspath(path)))}]", res)
            for path, res in ((path, read_json(path)) for path in paths)]
    print(report(methods, reference))
    folders = [os.path.dirname(os.path.abspath(path)) for path in paths]
    if len(paths) == 2 and all(runs.prediction_files(f) for f in folders):  # the two runs' predictions, paired
        a, b = ([r for path in runs.prediction_files(f) for _, r in runs.scan(path, warn=False)] for f in folders)
        diff = paired_difference(a, b)
        print(f"\nPaired difference, {methods[1][0]} minus {methods[0][0]}, over the {diff['n']} questions both answered "
              "(95% bootstrap interval over those questions): "
              + ", ".join(f"{name} {diff[m][0]:+.3f} [{diff[m][1][0]:+.3f}, {diff[m][1][1]:+.3f}]"
                          for name, m in (("EM", "em"), ("F1", "f1"), ("acc", "acc"))))
    folder = output_dir or os.path.dirname(os.path.abspath(paths[0]))
    os.makedirs(folder, exist_ok=True)
    plot_context_tokens(methods, os.path.join(folder, "context_tokens_compare.png"))


def other_agent(output_dir: str, results: dict) -> list[dict]:
    """Results of the other agent on the same datasets in sibling folders (for the Figure 3 plot)."""
    found = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(output_dir)), "*", "results.json"))):
        try:
            other = read_json(path)
            if other["run"]["agent"] != results["run"]["agent"] and set(other["datasets"]) == set(results["datasets"]):
                found.append(other)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not an evaluate.py results file
    return found


def write_reports(output_dir: str, results: dict, reference: dict | None = None):
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = report([(label(results), results)], reference)
    with open(os.path.join(output_dir, "results.md"), "w") as f:
        f.write(f"# {label(results)}\n\n{text}")
    print(text)
    plot_context_tokens([(label(res), res) for res in [results] + other_agent(output_dir, results)],
                        os.path.join(output_dir, "context_tokens_per_turn.png"))
    html_report(output_dir)


def html_report(output_dir: str):
    """report.html: every question's trajectory, turn by turn, as one page (tools/report.py)."""
    from tools import report
    try:
        path = report.main([output_dir, "-o", os.path.join(output_dir, "report.html")])
    except (Exception, SystemExit) as e:  # the results are saved already: say so, and go on
        print(f"warning: no report.html ({e}); results.json is written. Retry: python tools/report.py {output_dir}")
        return
    print(f"the trajectories, turn by turn (open in a browser): {path}")


# ---------------------------------------------------------------------------------------------
# 6. Main
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="HF name/path, a train.py checkpoint, or `default` (embedded SmolLM2)")
    ap.add_argument("--data", nargs="+", default=[DEFAULT_DATA], help="jsonl/parquet files or folders (default: toy test set)")
    ap.add_argument("--agent", default=None, choices=list(AGENTS),
                    help="default: the agent a train.py checkpoint was trained as, else memsearcher")
    ap.add_argument("--retriever_url", default=None, help="a retrieval server shared by all ranks: .../retrieve (Search-R1 API) or .../search (the release's); else a local index")
    ap.add_argument("--corpus", default=None, help="local corpus jsonl (default: data/toy/corpus.jsonl)")
    ap.add_argument("--index", default=None, help="local FAISS index (default: built beside the corpus)")
    ap.add_argument("--encoder", default=None, help="retrieval encoder (default: embedded MiniLM)")
    ap.add_argument("--output_dir", default=None, help="default: runs/eval/<agent>")
    ap.add_argument("--limit", type=int, default=None, help="at most N questions per dataset (a seeded sample)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch_size", type=int, default=16, help="questions per rollout call (per process)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="weights' precision; auto: bfloat16 on GPU (as released), float32 on CPU (bfloat16 is faster there with AMX, but shifts a float32-trained policy's greedy choices)")
    ap.add_argument("--max_turns", type=int, default=20)
    ap.add_argument("--max_new_tokens", type=int, default=512)
    ap.add_argument("--max_memory_tokens", type=int, default=None, help="memory cap (none by default, as released)")
    ap.add_argument("--max_response_tokens", type=int, default=16384, help="a conversation's response budget (ReAct grows)")
    ap.add_argument("--default_top_n", type=int, default=10, help="passages for a call without top_n (10: the release's server)")
    ap.add_argument("--max_top_n", type=int, default=None, help="the most passages a call may ask for (none, as released; training: 10)")
    ap.add_argument("--retriever_timeout", type=float, default=300.0, help="seconds a request to --retriever_url may take before it is tried again")
    ap.add_argument("--retriever_retries", type=int, default=5, help="tries after the first for a failed request (timeouts, 5xx), waits 1, 2, 4, ... s")
    ap.add_argument("--doc_format", default="release", choices=["release", "search-r1"], help="how results are shown")
    ap.add_argument("--system_prompt", default=None, help="a file with the system prompt (e.g. the release's wording)")
    ap.add_argument("--memory_instruction", default=None, help="a file with the memory-update instruction")
    ap.add_argument("--release_prompts", default=None, metavar="CLONE",
                    help="a clone of the release: its own system prompt and memory instruction, read from its evaluation client")
    ap.add_argument("--reference", default=None, metavar="JSON", help="published EM per dataset to print beside ours (read_reference)")
    ap.add_argument("--compare", nargs="+", metavar="RESULTS_JSON", help="print these runs side by side and exit")
    return ap.parse_args(argv)


def main(argv=None, generate_fn=None):
    args = parse_args(argv)
    reference = read_reference(args.reference)  # a bad file fails before anything runs
    if args.compare:
        return compare(args.compare, args.output_dir, reference)
    trained_as = models.trained_agent(args.model)
    if args.agent and trained_as and args.agent != trained_as:
        print(f"evaluate.py: note: {args.model} was trained as {trained_as}, evaluated here as --agent {args.agent}")
    args.agent = args.agent or trained_as or "memsearcher"
    args.output_dir = args.output_dir or os.path.join("runs", "eval", args.agent)
    multi_cpu = not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1  # torchrun on CPUs: gloo
    accelerator = Accelerator(cpu=multi_cpu, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(hours=12))])
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    datasets = load_datasets(args.data, args.limit, args.seed)  # a bad row fails here, before any model loads
    questions = [q for qs in datasets.values() for q in qs]
    if args.release_prompts and (args.system_prompt or args.memory_instruction):
        raise SystemExit("evaluate.py: --release_prompts reads both prompt texts; give it without --system_prompt/--memory_instruction")
    prompts = (release_prompts(args.release_prompts) if args.release_prompts
               else agent.read_prompts(args.agent, args.system_prompt, args.memory_instruction))
    dtype = args.dtype if args.dtype != "auto" else "bfloat16" if device.type == "cuda" else "float32"
    run = {"agent": args.agent, "model": args.model, "dtype": dtype, "max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens,
           "max_memory_tokens": args.max_memory_tokens, "doc_format": args.doc_format, "default_top_n": args.default_top_n,
           "max_top_n": args.max_top_n, "tool_texts": "release" if args.release_prompts else "ours",
           **prompts,
           "retriever": args.retriever_url or [args.corpus, args.index, args.encoder]}  # a resumed run must match
    os.makedirs(args.output_dir, exist_ok=True)
    runs.check_shared_folder(accelerator, args.output_dir)  # the first rank merges every rank's file
    done = runs.finished(args.output_dir, run, warn=accelerator.is_main_process)
    mine = [q for q in questions[rank::world] if runs.key(q) not in done]
    todo = sum(runs.key(q) not in done for q in questions)
    accelerator.print(f"{len(questions)} questions in {len(datasets)} datasets ({', '.join(datasets)}); "
                      f"{len(questions) - todo} already in {args.output_dir}; {todo} to go on {world} process(es)")
    set_seed(args.seed)
    with accelerator.local_main_process_first():  # also: every rank has read the old files before any writes
        search = retriever.open_retriever(args.corpus, args.index, args.encoder, url=args.retriever_url, check=True,
                                          doc_format=args.doc_format, timeout=args.retriever_timeout,
                                          retries=args.retriever_retries, device=device) if mine else None
    t0 = time.time()
    if mine:
        model, tokenizer = models.load(args.model, dtype=getattr(torch, dtype), device=device)
        path = os.path.join(args.output_dir, f"predictions.rank{rank}-{uuid.uuid4().hex[:8]}.jsonl")
        evaluate_shard(model, tokenizer, search, mine, args, run, path, generate_fn, accelerator.is_main_process)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return None
    records = runs.merge(args.output_dir, questions, run)
    per_dataset, average = aggregate(records, list(datasets))
    config = {**vars(args), "world_size": world, "device": str(device), "evaluated_now": todo, "wall_seconds": time.time() - t0,
              "memory_kind": "gpu_max_allocated" if device.type == "cuda" else "cpu_peak_rss"}
    results = {"run": run, "config": config, "datasets": per_dataset, "average": average}
    write_reports(args.output_dir, results, reference)
    return results


if __name__ == "__main__":
    main()
