"""Benchmark: one optimizer update (`train.optimizer_update`) with and without the shared prefix,
alternating in one process so both meet the same machine state, then each once more in a fresh
process for the update's own peak memory (VmHWM reset after loading, less the resident memory
before the update). The conversations are the toy preset's shape: a MemSearcher
prompt (system prompt, question, a memory of 10-120 words) and a response of 150-450 tokens.

    python bench/update_prefix.py --model runs/memsearcher/warm_start            # toy preset: bf16, micro-batch 1, checkpointing
    python bench/update_prefix.py --model ... --precision no --micro_batch_size 4 --no_checkpointing

A single GRPO step (bench/step_time.py) mixes the update with a rollout and moves by a quarter
between runs on a shared 2-core machine; this isolates the update and takes the median of --reps.
"""
import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def setup(args):
    import torch
    from accelerate import Accelerator

    import agent

    accelerator = Accelerator(mixed_precision=args.precision, cpu=True)
    model, tokenizer = agent.load_model(args.model)
    model.train()
    if args.checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every update sees the same weights
    model, optimizer = accelerator.prepare(model, optimizer)
    rows = [json.loads(line) for line in open(os.path.join(ROOT, "data", "toy", "test.jsonl"))][:args.conversations]
    rng = random.Random(0)
    conversations = []
    for row in rows:
        memory = "Known facts: " + " ".join(rng.choice(["Osk", "river", "town", "the", "of"]) for _ in range(rng.randint(10, 120)))
        c = agent.Conversation(agent.encode(tokenizer, agent.memsearcher_prompt(row["question"], memory)))
        c.append([rng.randint(100, 40000) for _ in range(rng.randint(150, 450))], trained=True)
        conversations.append(c)
    return accelerator, model, optimizer, tokenizer, conversations


def rss(field):
    """VmRSS or VmHWM of this process, GB (Linux); the lifetime maximum elsewhere."""
    try:
        return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def update(accelerator, model, optimizer, tokenizer, conversations, args, shared):
    import train

    config = types.SimpleNamespace(micro_batch_size=args.micro_batch_size, shared_prefix=shared, grad_clip=1.0)
    nll = lambda logprobs, entropy, f, n: (-(logprobs * f["loss_mask"]).sum() / n, {})  # noqa: E731
    t0 = time.time()
    train.optimizer_update(accelerator, model, optimizer, conversations, conversations[:1], tokenizer.pad_token_id,
                           config, (), nll, return_entropy=True)
    return time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a policy, e.g. runs/memsearcher/warm_start")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--micro_batch_size", type=int, default=1)
    ap.add_argument("--precision", default="bf16", choices=["no", "bf16"])
    ap.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", choices=["plain", "shared"], help=argparse.SUPPRESS)  # one update, for its peak memory
    args = ap.parse_args()
    state = setup(args)
    if args.only:  # the update's own peak: the high-water mark reset after loading (Linux), less the memory before it
        before = rss("VmRSS")
        reset = os.path.exists("/proc/self/clear_refs")
        if reset:
            open("/proc/self/clear_refs", "w").write("5")
        update(*state, args, args.only == "shared")
        print(rss("VmHWM") - (before if reset else 0))
        return
    seconds = {False: [], True: []}
    for _ in range(args.reps):
        for shared in (False, True):
            seconds[shared].append(update(*state, args, shared))
    peak = {}
    for shared in (False, True):
        cmd = [sys.executable, __file__] + sys.argv[1:] + ["--only", "shared" if shared else "plain"]
        peak[shared] = float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])
    plain, ours = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"{args.conversations} conversations, micro-batch {args.micro_batch_size}, precision {args.precision}, "
          f"checkpointing {args.checkpointing}, {os.environ.get('OMP_NUM_THREADS', os.cpu_count())} threads")
    print(f"{'':>24} {'plain':>8} {'shared':>8} {'ratio':>7}")
    print(f"{'update s (median of ' + str(args.reps) + ')':>24} {plain:8.1f} {ours:8.1f} {ours / plain:6.2f}x")
    print(f"{'update peak GB':>24} {peak[False]:8.2f} {peak[True]:8.2f} {peak[True] / peak[False]:6.2f}x")
    print("every run, s: plain " + " ".join(f"{s:.1f}" for s in seconds[False]) + "; shared " + " ".join(f"{s:.1f}" for s in seconds[True]))


if __name__ == "__main__":
    main()
