"""Benchmark: one toy GRPO step under the released recipe and under the toy preset's small-budget
recipe, from the same policy and the same questions, each in a fresh process (so each peak memory
is its own).

    python bench/step_time.py --model runs/memsearcher/warm_start          # a warm-started policy
    python bench/step_time.py --model runs/memsearcher/warm_start --steps 2
    python bench/step_time.py --model runs/memsearcher/warm_start --repeats 3   # alternating, with the spread

(Plain vs shared prefix, whole steps and one optimizer update alone: bench/shared_prefix.py, which
imports `compare`, `print_parts`, `RELEASED`, `step_seconds` and `cpu_name` from here.)

Runs `train.py --warm_start_steps 0 --max_steps N --seed S` twice:
  released  float32 without autocast, old log-probs recorded while sampling, KL reference pass
            (0.001), every group trained, no oracle, no evidence credit, micro-batches of 4 without
            activation checkpointing (the toy preset before the recipe)
  recipe    the toy preset's defaults (`--mixed_precision auto`: bf16 autocast where the CPU has AMX,
            old log-probs then recomputed; no KL reference; equal-reward groups skipped; the oracle
            in unsolved groups; evidence credit; micro-batches of 1 with activation checkpointing)
and prints, per configuration and as recipe / released ratios: seconds of rollout, log-prob passes
(old + reference) and update, the step time, the tokens the log-prob passes ran through the model
(`encoded_tokens`), the peak memory of the step and of its update alone (VmHWM, reset before the
update; `tools/runs.peak_gb`), and the trajectories and trained tokens the update saw. Rollouts
differ between the two (another precision samples other tokens), so the step times compare whole
steps, as a user meets them.

Single steps on a shared 2-core machine move by a quarter between runs; `--repeats K` runs the pair
K times, alternating (A, B, A, B, ...), averages over all of them and prints each repeat's step
ratio, so the spread is on the page beside the mean.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASED = ["--mixed_precision", "no", "--old_logprobs", "recorded", "--kl_coef", "0.001", "--no_skip_equal_groups",
            "--oracle_per_group", "0", "--evidence_weight", "0", "--micro_batch_size", "4", "--no_gradient_checkpointing"]


def cpu_name():
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def run(model, flags, steps, seed, threads):
    """One train.py run in a fresh process; its GRPO rows of metrics.jsonl. Its output folder (a
    2 GB checkpoint) is removed afterwards."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory(prefix="step_time_") as out:
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", model, "--preset", "toy", "--warm_start_steps", "0",
               "--max_steps", str(steps), "--seed", str(seed), "--output_dir", out, "--save_every", "1000"] + flags
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in rows if r["phase"] == "grpo"]


def step_seconds(row):
    return row["seconds_rollout"] + row["seconds_reference"] + row["seconds_update"]


PARTS = [("rollout", lambda r: r["seconds_rollout"]), ("log-prob passes", lambda r: r["seconds_reference"]),
         ("update", lambda r: r["seconds_update"]),
         ("log-prob + update", lambda r: r["seconds_reference"] + r["seconds_update"]),
         ("step", step_seconds),
         ("encoded tokens", lambda r: r.get("encoded_tokens", 0)),
         ("peak memory GB", lambda r: r["peak_memory_gb"]),
         ("update's peak GB", lambda r: r.get("peak_update_gb", 0)),
         ("oracle trajectories", lambda r: r["oracle_trajectories"]),
         ("trajectories skipped", lambda r: r["skipped_trajectories"]),
         ("trained tokens", lambda r: r["trained_tokens"]),
         ("sampled reward", lambda r: r["reward"]), ("equal-reward groups", lambda r: r["equal_reward_groups"])]


def compare(model, names, flags, steps, seed, threads, repeats):
    """Run the two configurations `names` (train.py flags `flags[name]`) `repeats` times, alternating;
    -> ({name: every GRPO row}, [step ratio second / first, per repeat])."""
    results, step_ratios = {name: [] for name in names}, []
    for _ in range(repeats):
        rows = {name: run(model, flags[name], steps, seed, threads) for name in names}
        for name in names:
            results[name] += rows[name]
        step_ratios.append(sum(map(step_seconds, rows[names[1]])) / sum(map(step_seconds, rows[names[0]])))
    return results, step_ratios


def print_parts(names, results, step_ratios):
    """The mean per step of each part, side by side, with the ratio second / first."""
    print(f"{'':<22}{names[0]:>10}{names[1]:>10}{'ratio':>8}")
    for name, get in PARTS:
        a, b = (sum(get(r) for r in results[n]) / len(results[n]) for n in names)
        worst = max(get(r) for r in results[names[1]]) if name == "peak memory GB" else None
        ratio = f"{b / a:7.2f}x" if a else "      -"
        print(f"{name:<22}{a:>10.2f}{b:>10.2f}{ratio}" + (f"   ({names[1]} max {worst:.2f})" if worst else ""))
    if len(step_ratios) > 1:
        print(f"step ratio per repeat: {', '.join(f'{r:.2f}x' for r in step_ratios)} "
              f"(min {min(step_ratios):.2f}x, max {max(step_ratios):.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--model", required=True, help="a warm-started policy, e.g. runs/memsearcher/warm_start")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--recipe", default="", help="extra train.py flags for the recipe run, e.g. '--micro_batch_size 2'")
    ap.add_argument("--repeats", type=int, default=1, help="run the pair this many times, alternating")
    args = ap.parse_args()
    names = ("released", "recipe")
    results, step_ratios = compare(args.model, names, {"released": RELEASED, "recipe": args.recipe.split()},
                                   args.steps, args.seed, args.threads, args.repeats)
    print(f"{cpu_name()}, {args.threads} threads; {args.steps} step(s) x {args.repeats} repeat(s) from {args.model}, "
          f"seed {args.seed}; mean per step")
    print_parts(names, results, step_ratios)


if __name__ == "__main__":
    main()
