"""Benchmark: the shared prefix (train.py's default) against the plain forward (`--no_shared_prefix`),
side by side from one run, with shared / plain ratios:

(a) one optimizer update alone (`train.optimizer_update`): the two alternate in one process, so both
    meet the same machine state, and the median of `--reps` is taken; the tokens its passes run
    through the model (`encoded_tokens`); then each once more in a fresh process for the update's
    own peak memory (VmHWM reset after loading, less the resident memory before the update). The
    conversations are the toy preset's shape: a MemSearcher prompt (system prompt, question, a
    memory of 10-120 words) and a response of 150-450 tokens.
(b) with `--steps N`: N whole GRPO steps through train.py, plain and shared, each in a fresh process
    (so each peak memory is its own), from the same policy and seed (both sample the same
    trajectories), the parts of a step as bench/step_time.py prints them; `--repeats K` alternates
    the pair K times.

    python bench/shared_prefix.py --model runs/memsearcher/warm_start                     # (a), the toy preset's shape
    python bench/shared_prefix.py --model runs/memsearcher/warm_start --base released      # (a), the released shape
    python bench/shared_prefix.py --model runs/memsearcher/warm_start --steps 1 --base released   # (a) and (b)

`--base` picks the configuration of both parts: `preset`, the toy preset's (train.py's defaults:
`--mixed_precision auto`, i.e. bf16 autocast where the CPU has AMX, `tools/runs.resolve_precision`;
micro-batches of 1 with activation checkpointing); `released`, bench/step_time.py's released recipe
(float32, micro-batches of 4 without checkpointing; in (b) also the KL reference pass and old
log-probs recorded while sampling). `--precision`, `--micro_batch_size` and `--no_checkpointing`
override (a)'s; `--train_flags` adds train.py flags to both runs of (b).

A single GRPO step mixes the update with a rollout, which is identical work both ways, and moves by a
quarter between runs on a shared 2-core machine; (a) isolates the update.
"""
import argparse
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import types
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before bench/ (which has its own grpo.py)


import step_time  # noqa: E402  (bench/step_time.py: this folder is on the path when run as a script)
BASES = {"preset": dict(precision="auto", micro_batch_size=1, checkpointing=True),
         "released": dict(precision="no", micro_batch_size=4, checkpointing=False)}


# ---------------------------------------------------------------------------------------------
# (a) One optimizer update alone
# ---------------------------------------------------------------------------------------------
def setup(args):
    import torch
    from accelerate import Accelerator

    import agent
    from tools import models

    torch.set_num_threads(args.threads)
    accelerator = Accelerator(mixed_precision=args.precision, cpu=True)
    model, tokenizer = models.load(args.model)
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
    """One `train.optimizer_update` over every conversation -> (seconds, tokens encoded)."""
    import train

    config = types.SimpleNamespace(micro_batch_size=args.micro_batch_size, shared_prefix=shared, grad_clip=1.0)
    nll = lambda logprobs, entropy, f, n: (-(logprobs * f["loss_mask"]).sum() / n, {})  # noqa: E731
    counter = Counter()
    t0 = time.time()
    train.optimizer_update(accelerator, model, optimizer, conversations, conversations[:1], tokenizer.pad_token_id,
                           config, (), nll, return_entropy=True, counter=counter)
    return time.time() - t0, counter["encoded_tokens"]


def isolated_update(args):
    """(a): {shared: [seconds per rep]}, {shared: tokens encoded}, {shared: peak GB}."""
    state = setup(args)
    seconds, encoded = {False: [], True: []}, {}
    for _ in range(args.reps):
        for shared in (False, True):
            s, encoded[shared] = update(*state, args, shared)
            seconds[shared].append(s)
    del state
    gc.collect()
    peak = {}
    for shared in (False, True):  # each in a fresh process
        cmd = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + ["--only", "shared" if shared else "plain"]
        peak[shared] = float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])
    return seconds, encoded, peak


def only(args):
    """Child process: one update, its own peak: the high-water mark reset after loading (Linux),
    less the memory before it; prints it in GB."""
    state = setup(args)
    before = rss("VmRSS")
    reset = os.path.exists("/proc/self/clear_refs")
    if reset:
        open("/proc/self/clear_refs", "w").write("5")
    update(*state, args, args.only == "shared")
    print(rss("VmHWM") - (before if reset else 0))


def ratio(a, b):
    return f"{b / a:6.2f}x" if a else "     -"


def print_update(args, seconds, encoded, peak):
    plain, ours = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"\n(a) one optimizer update alone: {args.conversations} conversations, micro-batch {args.micro_batch_size}, "
          f"precision {args.precision}, checkpointing {args.checkpointing}")
    print(f"{'':>24} {'plain':>8} {'shared':>8} {'ratio':>7}")
    print(f"{'update s (median of ' + str(args.reps) + ')':>24} {plain:8.1f} {ours:8.1f} {ratio(plain, ours)}")
    print(f"{'update peak GB':>24} {peak[False]:8.2f} {peak[True]:8.2f} {ratio(peak[False], peak[True])}")
    print(f"{'encoded tokens':>24} {encoded[False]:8d} {encoded[True]:8d} {ratio(encoded[False], encoded[True])}")
    print("every update, s: plain " + " ".join(f"{s:.1f}" for s in seconds[False]) + "; shared "
          + " ".join(f"{s:.1f}" for s in seconds[True]))


# ---------------------------------------------------------------------------------------------
# (b) Whole GRPO steps through train.py
# ---------------------------------------------------------------------------------------------
def whole_steps(args):
    """(b): step_time.compare over plain and shared -> (names, {name: GRPO rows}, step ratios)."""
    base = (step_time.RELEASED if args.base == "released" else []) + args.train_flags.split()
    names = ("plain", "shared")
    results, step_ratios = step_time.compare(args.model, names, {"plain": base + ["--no_shared_prefix"], "shared": base},
                                             args.steps, args.seed, args.threads, args.repeats)
    return names, results, step_ratios


def mean(rows, key):
    return sum(key(r) for r in rows) / len(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a policy, e.g. runs/memsearcher/warm_start")
    ap.add_argument("--base", default="preset", choices=sorted(BASES), help="the configuration of (a) and (b)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    g = ap.add_argument_group("(a) one optimizer update alone")
    g.add_argument("--conversations", type=int, default=16)
    g.add_argument("--reps", type=int, default=3, help="updates of each kind, alternating; the median is printed")
    g.add_argument("--precision", choices=["auto", "no", "bf16"], help="default: --base's (preset: auto, released: no)")
    g.add_argument("--micro_batch_size", type=int, help="default: --base's (preset: 1, released: 4)")
    g.add_argument("--checkpointing", action="store_true", default=None, help="default: --base's (preset: on, released: off)")
    g.add_argument("--no_checkpointing", dest="checkpointing", action="store_false")
    g = ap.add_argument_group("(b) whole GRPO steps through train.py")
    g.add_argument("--steps", type=int, default=0, help="GRPO steps per train.py run (0: skip part b)")
    g.add_argument("--repeats", type=int, default=1, help="run the plain/shared pair this many times, alternating")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--train_flags", default="", help="extra train.py flags for both runs, e.g. '--micro_batch_size 2'")
    ap.add_argument("--only", choices=["plain", "shared"], help=argparse.SUPPRESS)  # one update, for its peak memory
    args = ap.parse_args()
    for name, value in BASES[args.base].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.precision == "auto":
        from tools import runs

        args.precision = runs.resolve_precision("auto")
    if args.only:
        return only(args)

    print(f"{step_time.cpu_name()}, {args.threads} threads; {args.base} configuration, plain vs shared prefix, "
          f"from {args.model}", flush=True)
    seconds, encoded, peak = isolated_update(args)
    steps = whole_steps(args) if args.steps else None
    print_update(args, seconds, encoded, peak)
    if steps:
        names, results, step_ratios = steps
        print(f"\n(b) whole GRPO steps through train.py: {args.steps} step(s) x {args.repeats} repeat(s), seed {args.seed}"
              f"{', flags ' + repr(args.train_flags) if args.train_flags else ''}; mean per step")
        step_time.print_parts(names, results, step_ratios)
    update_ratio = statistics.median(seconds[True]) / statistics.median(seconds[False])
    summary = (f"\nshared / plain: update alone {update_ratio:.2f}x time, {peak[True] / peak[False]:.2f}x peak, "
               f"{encoded[True] / max(encoded[False], 1):.2f}x encoded tokens")
    if steps:
        plain, ours = (results[n] for n in names)
        passes = lambda r: r["seconds_reference"] + r["seconds_update"]  # noqa: E731
        summary += (f"; whole step {mean(ours, step_time.step_seconds) / mean(plain, step_time.step_seconds):.2f}x time "
                    f"(log-prob passes + update {mean(ours, passes) / mean(plain, passes):.2f}x), "
                    f"{mean(ours, lambda r: r['encoded_tokens']) / max(mean(plain, lambda r: r['encoded_tokens']), 1):.2f}x "
                    f"encoded tokens, update's peak "
                    f"{mean(ours, lambda r: r['peak_update_gb']) / max(mean(plain, lambda r: r['peak_update_gb']), 1e-9):.2f}x")
    print(summary)


if __name__ == "__main__":
    main()
