"""Does a warm-started policy make the search-or-answer choice of the oracle's thought skeleton?

On held-out train rows (default: rows 1900-1999 of data/toy/train.jsonl, never demonstrated), for
each question and each number k of chain facts in the memory (0 .. all), the prompt holds exactly
the oracle's memory and the generation is teacher-forced with the oracle's own thought up to
"..., so I"; the probe reads whether " can" (answer) or " must" (search) is more likely, and
whether it is the oracle's choice (answer only once the memory holds the whole chain), and the
mean probability of that choice between the two words (what sampling at temperature 1 would take). It also
lets the model finish "The question asks for the" greedily and checks the kind it names.

    python toy/choice_probe.py runs/memsearcher/warm_start [--n 60]
"""
import argparse
import os
import sys
from collections import Counter

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import agent  # noqa: E402
from tools import models  # noqa: E402
from toy import oracle  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a checkpoint folder, e.g. runs/memsearcher/warm_start")
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "toy", "train.jsonl"))
    ap.add_argument("--rows", default="1900:2000", help="which rows (start:stop) of --data")
    ap.add_argument("--n", type=int, default=60, help="the first n of those rows")
    args = ap.parse_args()
    start, stop = map(int, args.rows.split(":"))
    rows = oracle.load_rows(args.data)[start:stop][:args.n]
    model, tokenizer = models.load(args.model)
    can, must = (agent.encode(tokenizer, w)[0] for w in (" can", " must"))
    policy = oracle.Oracle(rows, seed=0)
    right, seen, p_right, kind_right, kind_seen = Counter(), Counter(), Counter(), Counter(), Counter()
    for row in rows:
        chain, kind = row["metadata"]["chain"], row["metadata"]["type"]
        for k in range(len(chain) + 1):
            held = chain[:k]
            prompt = agent.memsearcher_prompt(row["question"], " ".join(oracle.labelled(h) for h in held)) + " "
            thought = policy.act(row, held)
            thought = thought[:thought.index("so I ") + len("so I")]
            with torch.no_grad():
                logits = model(torch.tensor([agent.encode(tokenizer, prompt + thought)])).logits[0, -1]
            wanted, other = (can, must) if k == len(chain) else (must, can)
            seen[kind, k] += 1
            right[kind, k] += int(logits[wanted] > logits[other])
            p_right[kind, k] += float(torch.softmax(logits[[wanted, other]].float(), 0)[0])
            if k == 0 and kind != "comparison":
                ids = agent.encode(tokenizer, prompt + "The question asks for the")
                out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
                said = tokenizer.decode(out[0, len(ids):]).split(".")[0].strip()
                kind_seen[kind] += 1
                kind_right[kind] += int(said == oracle.KIND[chain[-1]["relation"]])
    print("choice right (memory and thought as the oracle's), by question type and facts in memory:")
    for key in sorted(seen):
        want = "answer" if key[1] == (1 if key[0] == "single" else 2) else "search"
        print(f"  {key[0]:<10} {key[1]} facts: {right[key]}/{seen[key]}  ({want}; mean P {p_right[key] / seen[key]:.2f})")
    print("names what the question asks for:", ", ".join(f"{t} {kind_right[t]}/{kind_seen[t]}" for t in sorted(kind_seen)))


if __name__ == "__main__":
    main()
