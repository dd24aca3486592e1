"""Where does a toy question's reasoning chain break? A funnel over evaluate.py's predictions.

For every question of a toy world (rows with their reasoning chain, toy/make_toy.py) and each hop
of its chain, in order: did some search name the hop's entity, was the hop's passage among the
documents returned, and did some memory (after an update) hold the hop's answer; then, was the
final answer right (EM). Counts are per question type; a question counts at a stage only if it
passed every earlier stage (hops in the chain's order; a comparison's in the order that passes more),
so the first big drop is where the chain breaks. The last column is EM by any path. Reads predictions
only: no model, no CPU to speak of.

    python toy/chain_funnel.py runs/memsearcher/eval
    python toy/chain_funnel.py runs/eval/seed1 --data data/toy_seed1/test.jsonl
"""
import argparse
import json
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import agent  # noqa: E402

STAGES = ("searched", "retrieved", "in memory")


def contains(text: str, answer: str) -> bool:
    """The answer's normalised words appear, in order and whole, in the normalised text."""
    return f" {agent.normalize_answer(answer)} " in f" {agent.normalize_answer(text)} "


def funnel(prediction: dict, chain: list[dict], passages: dict) -> list[bool]:
    """[searched, retrieved, in memory] for each hop in turn, then answered right, each stage
    passed only if every stage before it was; last, answered right by any path (a comparison's
    guess counts here only)."""
    turns = prediction.get("turns") or []
    queries = [q for t in turns for q in t.get("queries", [])]
    documents = [d for t in turns for d in t.get("documents", [])]
    memories = [t.get("memory") or "" for t in turns]
    stages = []
    for hop in chain:
        passage = passages.get(str(hop["passage_id"]), "\0")
        stages += [any(hop["search"].lower() in q.lower() for q in queries),
                   any(passage in d for d in documents),
                   any(contains(m, hop["answer"]) for m in memories)]
    right = prediction["em"] == 1.0
    stages.append(right)
    passed = True
    for k, ok in enumerate(stages):
        passed = passed and ok
        stages[k] = passed
    return stages + [right]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("eval_dir", help="an evaluate.py --output_dir (its predictions.jsonl)")
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "toy", "test.jsonl"), help="the questions, with their chains")
    ap.add_argument("--corpus", default=None, help="the world's corpus (default: corpus.jsonl beside --data)")
    args = ap.parse_args()
    corpus = args.corpus or os.path.join(os.path.dirname(args.data), "corpus.jsonl")
    with open(corpus, encoding="utf-8") as f:  # passage text as the tool response shows it: its contents
        passages = {str(r["id"]): r["contents"].split("\n", 1)[-1] for r in map(json.loads, f)}
    with open(args.data, encoding="utf-8") as f:
        rows = {str(r["id"]): r for r in map(json.loads, f)}
    with open(os.path.join(args.eval_dir, "predictions.jsonl"), encoding="utf-8") as f:
        predictions = [json.loads(line) for line in f if line.strip()]
    counts, totals = defaultdict(lambda: None), defaultdict(int)
    for p in predictions:
        row = rows.get(str(p["id"]))
        if row is None:
            raise SystemExit(f"{p['id']!r} is not in {args.data}: pass the world's questions with --data")
        kind, chain = row["metadata"]["type"], row["metadata"]["chain"]
        stages = funnel(p, chain, passages)
        if kind == "comparison":  # its two hops in either order
            stages = max(stages, funnel(p, chain[::-1], passages), key=sum)
        counts[kind] = [a + b for a, b in zip(counts[kind] or [0] * len(stages), stages)]
        totals[kind] += 1
    print(f"{args.eval_dir}: {len(predictions)} questions; each column counts those that passed it and every column before")
    for kind in sorted(totals, key=lambda k: -len(counts[k])):
        hops = (len(counts[kind]) - 2) // len(STAGES)
        head = [f"hop {h + 1} {s}" for h in range(hops) for s in STAGES] + ["EM after all that", "EM"]
        print(f"\n{kind} ({totals[kind]} questions)\n| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
        print("| " + " | ".join(f"{c} ({c / totals[kind]:.0%})" for c in counts[kind]) + " |")


if __name__ == "__main__":
    main()
