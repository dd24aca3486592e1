"""Benchmark: a GRPO step's time with old log-probs recomputed (as released) vs recorded while
sampling (the toy preset, float32 without autocast, where the two agree), from one rollout.

    python bench/step_time.py --model runs/memsearcher/warm_start      # a warm-started policy
    python bench/step_time.py --questions 2 --group 4

One rollout (toy train questions, G trajectories each, the toy preset's sampling), then, on its
conversations: the old log-prob forward pass, the reference forward pass, and one update's
forward + backward (no optimizer step), each timed once. Prints seconds per part, the step time
both ways, their ratio, and the largest gap between recorded and recomputed log-probs.
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import agent  # noqa: E402
import grpo  # noqa: E402
import retriever  # noqa: E402
import train  # noqa: E402
from data.questions import load_questions  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--questions", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--micro_batch_size", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model, tokenizer = agent.load_model(args.model)
    search = retriever.open_retriever(doc_format="release")
    questions = load_questions(os.path.join(ROOT, "data", "toy", "train.jsonl"))[:args.questions]
    t0 = time.time()
    trajectories = agent.rollout(model, tokenizer, questions, search, group_size=args.group, max_turns=3,
                                 max_new_tokens=args.max_new_tokens)
    seconds = {"rollout": time.time() - t0}
    conversations = [c for t in trajectories for c in t.conversations]
    pad = tokenizer.pad_token_id
    t0 = time.time()
    old = train.response_logprobs(model, conversations, pad, "cpu", args.micro_batch_size, 1.0)
    seconds["old log-probs (recomputed)"] = time.time() - t0
    t0 = time.time()
    train.response_logprobs(model, conversations, pad, "cpu", args.micro_batch_size, 1.0)  # the reference: same cost
    seconds["reference log-probs"] = time.time() - t0
    t0 = time.time()
    model.train()
    for s in range(0, len(conversations), args.micro_batch_size):
        ids, attn, start, f = train.pad_batch(conversations[s:s + args.micro_batch_size], pad, "cpu", ("loss_mask",))
        logprobs, entropy = grpo.token_logprobs(model, ids, attn, 1.0, response_start=start, return_entropy=True)
        (-(logprobs * f["loss_mask"]).sum() / f["loss_mask"].sum()).backward()
    seconds["update (forward + backward)"] = time.time() - t0
    gap = max(abs(a - b) for c, o in zip(conversations, old) for a, b, m in zip(c.logprobs, o.tolist(), c.loss_mask) if m)
    tokens = sum(len(c) for c in conversations)
    print(f"{len(trajectories)} trajectories, {len(conversations)} conversations, {tokens} context tokens, "
          f"{sum(sum(c.loss_mask) for c in conversations)} trained; CPU threads {torch.get_num_threads()}")
    for name, value in seconds.items():
        print(f"  {name:<30} {value:8.1f} s")
    recompute = sum(seconds.values())
    recorded = recompute - seconds["old log-probs (recomputed)"]
    print(f"step time: recomputed old log-probs {recompute:.1f} s, recorded {recorded:.1f} s "
          f"-> {recompute / recorded:.2f}x faster with recorded ones")
    print(f"largest |recorded - recomputed| over trained tokens: {gap:.2e}")


if __name__ == "__main__":
    main()
