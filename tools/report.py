"""Trajectories as one self-contained HTML page: the memory at work, turn by turn.

    python tools/report.py runs/memsearcher/eval -o report.html    # evaluate.py's folder (predictions.jsonl)
    python tools/report.py runs/memsearcher -o samples.html        # train.py's folder (samples.jsonl)

An evaluation gives one card per question: the question, its gold answers and (toy worlds) its
gold chain, the prediction and its scores; then a row per turn with what the context held (the
question and the memory in), the thought, the search, the documents returned (the question's
supporting passages marked), the memory out with what changed, and the turn's context tokens.
Filters keep the cards of one question type, outcome, end reason, or second-hop search; the
header holds the run's figures from results.json.

A training run gives, per step, each group written to samples.jsonl side by side: every
trajectory's reward, group advantage and end, the oracle's marked; then its turns, and per
conversation its tokens with the trained ones lit by their log-probability and the masked ones
(tool responses, headers) greyed.

The page needs no server, network or outside library: the standard library writes it (every text
through html.escape), and its CSS and the few lines of script (the filters) are inside it.
"""
import argparse
import difflib
import html
import json
import math
import os
import re
import sys
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY_CORPUS = os.path.join(ROOT, "data", "toy", "corpus.jsonl")
esc = html.escape


# ---------------------------------------------------------------------------------------------
# 1. Reading a folder: its records, and where it can, the questions' rows and the corpus
# ---------------------------------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict]:
    """Every record of a jsonl file; a line that is not a JSON object stops with its file and line
    (a last line cut mid-write, with no newline, is skipped with a warning)."""
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if k == len(lines):  # no newline after it: a write that was cut
                print(f"warning: {path}:{k}: a cut last line, skipped", file=sys.stderr)
                continue
            raise SystemExit(f"report.py: {path}:{k}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("turns", []), list):
            raise SystemExit(f"report.py: {path}:{k}: not a trajectory record")
        records.append(record)
    return records


def read_rows(paths: list[str]) -> dict:
    """{id: row} and {"question: " + text: row} of the question files that exist (rows with metadata)."""
    rows = {}
    for path in paths:
        if path and os.path.isfile(path) and path.endswith(".jsonl"):
            for row in read_jsonl(path):
                rows[str(row.get("id"))] = rows["question: " + str(row.get("question"))] = row
    return rows


def read_passages(path: str | None, ids: set) -> dict:
    """{passage id: (title, text)} of the passages the records name, read by line from the corpus
    (retriever.Corpus: line i is passage i, so a 13 GB wiki-18 is not read whole); an id that is
    not its line's is left out (its documents then show as the text the model read)."""
    if not path or not os.path.isfile(path):
        return {}
    sys.path.insert(0, ROOT)
    import retriever

    corpus, passages = retriever.Corpus(path), {}
    for i in ids:
        if i.isdigit() and int(i) < len(corpus) and (row := corpus[int(i)])["id"] == i:
            passages[i] = retriever.split_title(row["contents"])
    return passages


def sources(folder: str, data: list[str] | None, corpus: str | None, records: list[dict]) -> tuple[dict, dict]:
    """The rows and corpus a folder's records came from: those given, else those its run names
    (results.json's config; a training run's trainer_state.json args), else the toy world's."""
    config = {}
    for path in (os.path.join(folder, "results.json"), *sorted_checkpoint_states(folder)):
        if os.path.isfile(path):
            with open(path) as f:
                loaded = json.load(f)
            config = loaded.get("config") or loaded.get("args") or {}
            break
    files = data or [p for p in config.get("data") or [config.get("train_data")] if p]
    files = [f for p in files for f in ([os.path.join(p, n) for n in sorted(os.listdir(p))] if os.path.isdir(p) else [p])]
    ids = {str(i) for r in records for t in r.get("turns", []) for x in t.get("document_ids") or [] for i in x}
    return read_rows(files), read_passages(corpus or config.get("corpus") or TOY_CORPUS, ids)


def sorted_checkpoint_states(folder: str) -> list[str]:
    names = [n for n in os.listdir(folder) if re.fullmatch(r"checkpoint-\d+", n)] if os.path.isdir(folder) else []
    return [os.path.join(folder, n, "trainer_state.json") for n in sorted(names, key=lambda n: -int(n.split("-")[1]))]


# ---------------------------------------------------------------------------------------------
# 2. The pieces of a turn: thought and action, documents, the memory's change
# ---------------------------------------------------------------------------------------------
def thought_and_action(generation: str) -> tuple[str, str]:
    """The thought (before </think>) and the rest (tool call or answer), special tokens dropped."""
    text = re.sub(r"<\|im_end\|>|<\|endoftext\|>", "", generation or "")
    thought, sep, action = text.partition("</think>")
    thought = thought.replace("<think>", "")
    return (thought.strip(), action.strip()) if sep else ("", text.strip())


def memory_diff(before: str, after: str | None) -> str:
    """The memory out as HTML: words new since the memory in as <ins>, words dropped as <del>."""
    if after is None:
        return '<span class="bad">no valid memory written</span>'
    old, new, out = (before or "").split(), after.split(), []
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if op in ("replace", "delete"):
            out.append(f"<del>{esc(' '.join(old[a0:a1]))}</del>")
        if op in ("replace", "insert"):
            out.append(f"<ins>{esc(' '.join(new[b0:b1]))}</ins>")
        if op == "equal":
            out.append(esc(" ".join(new[b0:b1])))
    return " ".join(out) or '<span class="dim">(empty)</span>'


def documents(turn: dict, corpus: dict, supporting: set) -> str:
    """The documents a turn's searches returned, one line each (title, id), supporting ones marked;
    the raw text the model read where the corpus is not at hand."""
    ids, texts, out = turn.get("document_ids") or [], turn.get("documents") or [], []
    for k, text in enumerate(texts):
        found = [str(i) for i in (ids[k] if k < len(ids) else [])]
        if not found or any(i not in corpus for i in found):
            out.append(f"<pre>{esc(str(text))}</pre>")
            continue
        for i in found:
            title, body = corpus[i]
            mark = ' class="support" title="a supporting passage of this question"' if i in supporting else ""
            out.append(f"<details{mark}><summary>{'★ ' if i in supporting else ''}{esc(title)} <span class=dim>#{esc(i)}</span>"
                       f"</summary>{esc(body)}</details>")
    n, hits = sum(len(x) for x in ids), sum(str(i) in supporting for x in ids for i in x)
    head = f"{n} passages" + (f", {hits} supporting" if supporting else "") if ids else f"{len(texts)} results"
    return f'<div class="docs"><div class="dim">{head}</div>{"".join(out)}</div>' if texts else ""


def chain_html(row: dict | None) -> str:
    """A toy row's gold chain: per hop, the entity searched, the fact and its passage."""
    chain = ((row or {}).get("metadata") or {}).get("chain") or []
    if not chain:
        return ""
    hops = "".join(f"<li><b>{esc(str(h.get('search', '')))}</b>: {esc(str(h.get('fact', '')))} "
                   f"<span class=dim>#{esc(str(h.get('passage_id', '')))} → {esc(str(h.get('answer', '')))}</span></li>"
                   for h in chain)
    return f'<ol class="chain">{hops}</ol>'


def searched_second_hop(record: dict, row: dict | None) -> str:
    """'yes' / 'no' for a question of two hops or more (a query named the second hop's entity), else 'n/a'."""
    chain = ((row or {}).get("metadata") or {}).get("chain") or []
    if len(chain) < 2:
        return "n/a"
    queries = [q for t in record.get("turns", []) for q in t.get("queries") or []]
    return "yes" if any(str(chain[1].get("search", "")).lower() in str(q).lower() for q in queries) else "no"


def turn_pieces(record: dict, corpus: dict, supporting: set):
    """Per turn, its parts as HTML: number, memory in, thought, action, documents, memory out, tokens."""
    memory, tokens = "", record.get("context_tokens") or []
    for k, turn in enumerate(record.get("turns", [])):
        thought, action = thought_and_action(turn.get("generation", ""))
        queries, boxed = turn.get("queries"), re.findall(r"\\boxed\{(.*)\}", action)
        act = ("search: " + "; ".join(f"<q>{esc(str(q))}</q>" for q in queries)) if queries else \
            f"answer: <b>{esc(boxed[-1])}</b>" if boxed else f"<code>{esc(action)}</code>"
        out = memory_diff(memory, turn["memory"]) if "memory" in turn else '<span class="dim">(no update)</span>'
        yield (esc(str(turn.get("turn", k + 1))), esc(memory) or '<span class="dim">(empty)</span>', esc(thought), act,
               documents(turn, corpus, supporting), out, str(tokens[k]) if k < len(tokens) else "")
        if "memory" in turn:
            memory = turn["memory"] or ""  # evaluation: an unusable memory becomes empty


def turn_rows(record: dict, corpus: dict, supporting: set) -> str:
    """One table row per turn: memory in, thought, search or answer, documents, memory out, tokens."""
    rows = "".join(f'<tr class="turn"><td>{n}</td><td class="mem">{mem}</td><td>{thought}</td><td>{act}</td><td>{docs}</td>'
                   f'<td class="mem">{out}</td><td class="num">{tokens}</td></tr>'
                   for n, mem, thought, act, docs, out, tokens in turn_pieces(record, corpus, supporting))
    head = "<tr><th>turn</th><th>memory in</th><th>thought</th><th>action</th><th>documents</th><th>memory out</th><th>context tokens</th></tr>"
    return f'<table class="turns">{head}{rows}</table>'


def turn_blocks(record: dict, corpus: dict, supporting: set) -> str:
    """The same turns stacked, for a narrow column: the memory in is the memory out above it."""
    return "".join(f'<div class="turn"><b>turn {n}</b> <span class="dim">· {tokens} context tokens</span><p><i>{thought}</i></p>'
                   f'<p>{act}</p>{docs}<p class="mem">memory: {out}</p></div>'
                   for n, mem, thought, act, docs, out, tokens in turn_pieces(record, corpus, supporting))


# ---------------------------------------------------------------------------------------------
# 3. An evaluation: the run's figures, the filters, one card per question
# ---------------------------------------------------------------------------------------------
def figures(results: dict | None) -> str:
    if not results:
        return ""
    run, rows = results.get("run", {}), []
    for name, d in {**results.get("datasets", {}), **({"average": results["average"]} if len(results.get("datasets", {})) > 1 else {})}.items():
        iv = d.get("interval", {})
        cell = lambda m: f"{d[m]:.3f}" + (f" <span class=dim>[{iv[m][0]:.2f}, {iv[m][1]:.2f}]</span>" if m in iv else "")  # noqa: E731
        rows.append(f"<tr><td>{esc(name)}</td><td>{d.get('n', '')}</td>" + "".join(f"<td>{cell(m)}</td>" for m in
                    ("em", "f1", "format_valid", "searches", "turns") if m in d)
                    + f"<td>{esc(', '.join(f'{k} {v}' for k, v in d.get('end_reasons', {}).items()))}</td></tr>")
    return (f'<p class="dim">{esc(str(run.get("agent", "")))} · {esc(str(run.get("model", "")))} · {esc(str(run.get("dtype", "")))} · '
            f'{run.get("max_turns", "")} turns × {run.get("max_new_tokens", "")} tokens</p><table class="figures"><tr><th>dataset</th>'
            "<th>n</th><th>EM</th><th>F1</th><th>format-valid</th><th>searches</th><th>turns</th><th>ends</th></tr>"
            + "".join(rows) + "</table>")


def evaluation_card(record: dict, row: dict | None, corpus: dict) -> str:
    meta = (row or {}).get("metadata") or {}
    supporting = {str(i) for i in meta.get("supporting_ids") or []}
    kind, right = meta.get("type", "unknown"), "right" if record.get("em") == 1 else "wrong"
    attrs = {"type": kind, "outcome": right, "end": record.get("end_reason", ""), "hop2": searched_second_hop(record, row)}
    data = " ".join(f'data-{k}="{esc(str(v))}"' for k, v in attrs.items())
    golds = " | ".join(map(str, record.get("golden_answers") or []))
    return (f'<article class="card {right}" {data}><h3><span class="tag">{esc(kind)}</span> {esc(str(record.get("question", "")))}</h3>'
            f'<p>gold: <b>{esc(golds)}</b> · prediction: <b>{esc(str(record.get("prediction")))}</b> · '
            f'EM {record.get("em", 0):.0f} · F1 {record.get("f1", 0):.2f} · end: {esc(str(record.get("end_reason", "")))} · '
            f'{record.get("num_searches", 0)} searches</p>{chain_html(row)}{turn_rows(record, corpus, supporting)}</article>')


def filters(cards_attrs: list[dict]) -> str:
    """A select per attribute, with the values present and their counts."""
    labels = {"type": "question type", "outcome": "outcome", "end": "end reason", "hop2": "searched the 2nd hop"}
    out = []
    for key, label in labels.items():
        counts = Counter(a[key] for a in cards_attrs)
        options = "".join(f'<option value="{esc(v)}">{esc(v)} ({n})</option>' for v, n in sorted(counts.items()))
        out.append(f'<label>{label} <select data-filter="{key}"><option value="">all</option>{options}</select></label>')
    return f'<nav class="filters">{"".join(out)} <span><b id="shown">{len(cards_attrs)}</b> shown</span></nav>'


def evaluation_page(folder: str, data: list[str] | None, corpus_path: str | None) -> str:
    records = read_jsonl(os.path.join(folder, "predictions.jsonl"))
    results_path = os.path.join(folder, "results.json")
    results = json.load(open(results_path)) if os.path.isfile(results_path) else None
    rows, corpus = sources(folder, data, corpus_path, records)
    cards, attrs = [], []
    for r in records:
        row = rows.get(str(r.get("id")))
        meta = (row or {}).get("metadata") or {}
        attrs.append({"type": meta.get("type", "unknown"), "outcome": "right" if r.get("em") == 1 else "wrong",
                      "end": r.get("end_reason", ""), "hop2": searched_second_hop(r, row)})
        cards.append(evaluation_card(r, row, corpus))
    return page(f"Evaluation: {folder}", figures(results) + filters(attrs) + "".join(cards))


# ---------------------------------------------------------------------------------------------
# 4. A training run: per step, each group's trajectories side by side, tokens by loss mask
# ---------------------------------------------------------------------------------------------
def tokens_html(conversation: dict) -> str:
    """Response tokens: masked runs greyed (one span), trained tokens lit by probability p =
    exp(log-prob) in five bands (p0: p < 0.2 ... p4: p >= 0.8), the log-prob on hover."""
    tokens, mask, lps = conversation.get("tokens") or [], conversation.get("loss_mask") or [], conversation.get("logprobs")
    out, k = [], 0
    while k < len(tokens):
        if k < len(mask) and not mask[k]:
            end = k
            while end < len(tokens) and end < len(mask) and not mask[end]:
                end += 1
            out.append(f'<span class="m">{esc("".join(tokens[k:end]))}</span>')
            k = end
            continue
        if lps is not None and k < len(lps):
            band = min(int(math.exp(lps[k]) * 5), 4)
            out.append(f'<span class="p{band}" title="{lps[k]:.3f}">{esc(tokens[k])}</span>')
        else:
            out.append(esc(tokens[k]))
        k += 1
    return f'<pre class="tokens">{"".join(out)}</pre>'


def trajectory_column(sample: dict, corpus: dict, supporting: set) -> str:
    adv = sample.get("advantage")
    badges = "".join(f'<span class="tag {c}">{t}</span>' for t, c, on in (
        ("oracle", "oracle", sample.get("oracle")), ("tied: not trained", "tied", sample.get("trained") is False)) if on)
    head = (f'<p>{badges} reward <b>{sample.get("reward", 0):.2f}</b>'
            + (f' · shaped {sample["shaped_reward"]:.2f}' if sample.get("shaped_reward") not in (None, sample.get("reward")) else "")
            + (f' · advantage <b class="{"pos" if adv > 0 else "neg" if adv < 0 else ""}">{adv:+.2f}</b>' if adv is not None else "")
            + f' · end: {esc(str(sample.get("end_reason", "")))} · answer: <b>{esc(str(sample.get("prediction")))}</b></p>')
    conversations = sample.get("conversations") or []
    views = "".join(f"<details><summary>conversation {k + 1}: {c.get('prompt_tokens', 0)} prompt tokens, "
                    f"{sum(c.get('loss_mask') or [])} of {len(c.get('tokens') or [])} response tokens trained</summary>"
                    f"{tokens_html(c)}</details>" for k, c in enumerate(conversations))
    return f'<div class="member{" is-oracle" if sample.get("oracle") else ""}">{head}{turn_blocks(sample, corpus, supporting)}{views}</div>'


def training_page(folder: str, data: list[str] | None, corpus_path: str | None) -> str:
    samples = read_jsonl(os.path.join(folder, "samples.jsonl"))
    rows, corpus = sources(folder, data, corpus_path, samples)
    groups = defaultdict(list)  # (step, group) -> members; a line without a group (older runs) is its own
    for k, s in enumerate(samples):
        groups[s.get("step"), s.get("group", f"sample {k}")].append(s)
    sections, last_step = [], None
    for (step, group), members in groups.items():
        row = rows.get(str(group)) or rows.get("question: " + str(members[0].get("question")))
        supporting = {str(i) for i in ((row or {}).get("metadata") or {}).get("supporting_ids") or []}
        advantages = [m["advantage"] for m in members if m.get("advantage") is not None]
        spread = f" · advantages {min(advantages):+.2f} … {max(advantages):+.2f}" if advantages else ""
        if step != last_step:
            sections.append(f"<h2>step {esc(str(step))}</h2>")
            last_step = step
        sections.append(f'<section class="group"><h3>{esc(str(members[0].get("question", "")))}</h3>'
                        f'<p>gold: <b>{esc(" | ".join(map(str, members[0].get("golden_answers") or [])))}</b> · '
                        f'{len(members)} trajectories{spread}</p>{chain_html(row)}'
                        f'<div class="members" style="--n:{len(members)}">'
                        + "".join(trajectory_column(m, corpus, supporting) for m in members) + "</div></section>")
    legend = ('<p class="legend">tokens: <span class="m">masked (tool response, headers)</span> · trained, by p = exp(log-prob): '
              + " ".join(f'<span class="p{b}">{lo:.1f}–{lo + 0.2:.1f}</span>' for b, lo in enumerate((0, 0.2, 0.4, 0.6, 0.8))) + "</p>")
    return page(f"Training samples: {folder}", legend + "".join(sections))


# ---------------------------------------------------------------------------------------------
# 5. The page: style and the filters' script inside it
# ---------------------------------------------------------------------------------------------
STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222}
.dim{color:#888}.bad{color:#b00}.num{text-align:right}
.card,.group{border:1px solid #ccc;border-radius:6px;padding:.4em .8em;margin:.8em 0}
.card.right{border-left:6px solid #3a3}.card.wrong{border-left:6px solid #c44}
.tag{background:#eef;border-radius:3px;padding:0 .4em;font-size:12px}.tag.oracle{background:#fd8}.tag.tied{background:#ddd}
table{border-collapse:collapse;width:100%}td,th{border-top:1px solid #eee;padding:.25em .4em;vertical-align:top;text-align:left}
.turns td:nth-child(2),.turns td:nth-child(6){width:22%}.turns td:nth-child(5){width:18%}
.mem{background:#f7f7fb}ins{background:#cfc;text-decoration:none}del{background:#fcc}
.support>summary{font-weight:bold;color:#060}details{margin:.1em 0}pre{white-space:pre-wrap;margin:.2em 0}
.filters{position:sticky;top:0;background:#fff;padding:.5em 0;border-bottom:1px solid #ccc}.filters label{margin-right:1em}
.members{display:grid;grid-template-columns:repeat(var(--n),minmax(22em,1fr));gap:.6em;overflow-x:auto}
.member{border:1px solid #ddd;padding:.3em;font-size:12px}.member .turn{border-top:1px solid #eee;padding:.2em 0}.member p{margin:.2em 0}.member.is-oracle{background:#fffbea}
.pos{color:#080}.neg{color:#b00}.m{color:#999;background:#f2f2f2}
.p0{background:#f99}.p1{background:#fc9}.p2{background:#fe9}.p3{background:#dfb}.p4{background:#fff}
"""
SCRIPT = """
const selects = [...document.querySelectorAll('select[data-filter]')];
function applyFilters() {
  let shown = 0;
  for (const card of document.querySelectorAll('.card')) {
    card.hidden = !selects.every(s => !s.value || card.dataset[s.dataset.filter] === s.value);
    shown += !card.hidden;
  }
  document.getElementById('shown').textContent = shown;
}
selects.forEach(s => s.addEventListener('change', applyFilters));
for (const [key, value] of new URLSearchParams(location.hash.slice(1))) {  // report.html#outcome=wrong&type=bridge
  const s = selects.find(s => s.dataset.filter === key);
  if (s) s.value = value;
}
applyFilters();
addEventListener('load', () => { document.body.dataset.loadedMs = Math.round(performance.now()); });
"""


def page(title: str, body: str) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f"<style>{STYLE}</style></head><body><h1>{esc(title)}</h1>{body}<script>{SCRIPT}</script></body></html>\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="an evaluate.py --output_dir (predictions.jsonl) or a train.py --output_dir (samples.jsonl)")
    ap.add_argument("-o", "--output", default=None, help="the HTML file (default: FOLDER/report.html)")
    ap.add_argument("--data", nargs="+", default=None, help="the questions' files, for types and chains (default: the run's)")
    ap.add_argument("--corpus", default=None, help="the corpus jsonl, for passages' titles (default: the run's, else the toy world's)")
    args = ap.parse_args(argv)
    if os.path.isfile(os.path.join(args.folder, "predictions.jsonl")):
        text = evaluation_page(args.folder, args.data, args.corpus)
    elif os.path.isfile(os.path.join(args.folder, "samples.jsonl")):
        text = training_page(args.folder, args.data, args.corpus)
    else:
        raise SystemExit(f"report.py: {args.folder} has neither predictions.jsonl (evaluate.py) nor samples.jsonl (train.py)")
    output = args.output or os.path.join(args.folder, "report.html")
    with open(output + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(output + ".tmp", output)
    print(f"{output}: {len(text.encode()) / 1e6:.2f} MB")
    return output


if __name__ == "__main__":
    main()
