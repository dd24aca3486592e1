"""Peak memory and time of one training update: MemSearcher vs ReAct (the paper's Figure 4).

    python bench/train_memory.py                                  # 2 questions x 4 turns, micro-batch 1
    python bench/train_memory.py --questions 8 --turns 5 --micro_batch_size 4 --by_tokens   # a big machine

Defaults are sized for a 2-CPU, 24 GB machine (under ~10 minutes): activations cost about 1.9 MB
per padded token in float32 (30 layers; attention is SDPA, linear in length), so 4 ReAct
conversations of 4 turns (~2,600 tokens each) in one micro-batch would need ~20 GB.
`--by_tokens` adds a ReAct row whose micro-batches hold at most as many padded tokens as
MemSearcher's widest (micro_batch_size x its longest context): equal memory, more forwards.

The same questions (the first N of data/toy/test.jsonl) are rolled out by the scripted policy of
bench/rollout.py (a search every turn, real default retriever, top_n 5, memory = the first
`--memory_words` words of the latest documents), except that the last turn answers with
\\boxed{gold}. That gives, for the same trajectories:
  (a) MemSearcher: `turns` short conversations per trajectory, each (question, memory) + one search;
  (b) ReAct: one conversation per trajectory that holds every search result so far.

One update, exactly as train.py does it with one mini-batch holding every conversation (each
variant in a fresh process, so peaks do not mix):
  1. old log-probs without grad (`grpo.response_logprobs`, micro-batches);
  2. forward + backward of `grpo.token_logprobs` (with entropy) + `grpo.policy_loss` over every
     trained token, conversations sorted by length and cut into micro-batches (`grpo.pad_batch`),
     losses summed with the batch's token count (token-mean over the batch);
  3. gradient clipping (1.0) and one AdamW step (its state is created here, as in a first step).
Advantages are fixed (+1/-1 alternating per trajectory, copied to its conversations); no
reference model (kl term off): the work and memory do not depend on the values.

Peak memory: on CPU the peak RSS (VmHWM, reset through /proc/self/clear_refs just before the
update) minus the RSS at that moment (model loaded, trajectories built); on CUDA
max_memory_allocated() minus memory_allocated() after reset_peak_memory_stats(). Both are printed
for the whole update and for the forward+backward phase alone (where activations live; the
AdamW state, 2x the parameters, is the same for both variants and lands in the step phase).
"""
import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # before bench/ (which has its own retriever.py and grpo.py)

import agent  # noqa: E402
import grpo  # noqa: E402
from tools import models  # noqa: E402
import retriever  # noqa: E402


import rollout as bench_rollout  # noqa: E402  (bench/rollout.py: this folder is on the path when run as a script)


# ---------------------------------------------------------------------------------------------
# 1. Scripted trajectories: search every turn, answer at the last one
# ---------------------------------------------------------------------------------------------
def build_conversations(tokenizer, variant, args):
    """(trajectories, conversations, per-conversation advantages) for one variant."""
    questions = bench_rollout.load_questions(args.questions)
    search = retriever.open_retriever()
    settings = agent.RolloutSettings(agent=variant, max_turns=args.turns, max_response_tokens=10**9)
    trajectories = agent.rollout(None, tokenizer, questions, search, settings,
                                 generate_fn=bench_rollout.scripted_policy(
                                     variant, args.memory_words, answers={q["question"]: q["golden_answers"][0] for q in questions},
                                     answer_turn=args.turns))
    conversations = [c for t in trajectories for c in t.conversations]
    owner = [i for i, t in enumerate(trajectories) for _ in t.conversations]
    advantages = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(trajectories))])
    return trajectories, conversations, grpo.propagate_advantages(advantages, owner)


# ---------------------------------------------------------------------------------------------
# 2. Peak memory: CPU (peak RSS, resettable) or CUDA (allocator peak)
# ---------------------------------------------------------------------------------------------
def _status_kb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak(device):
    """Reset the peak counter; returns the current level in bytes. On CPU, memory freed by
    earlier phases is first handed back to the OS (malloc_trim), so a phase starts at its level."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _status_kb("VmRSS") * 1024


def read_peak(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status_kb("VmHWM") * 1024


# ---------------------------------------------------------------------------------------------
# 3. One update, as train.py does it (one mini-batch = every conversation)
# ---------------------------------------------------------------------------------------------
def micro_batches(conversations, size, max_tokens):
    """Conversations sorted by length (train.py's order), cut every `size` conversations, or,
    with `max_tokens`, as many as fit in max_tokens padded tokens (at least one)."""
    ordered = sorted(conversations, key=len)
    if not max_tokens:
        return [ordered[s:s + size] for s in range(0, len(ordered), size)]
    batches, current = [], []
    for c in ordered:  # sorted ascending: the newest is the widest
        if current and (len(current) + 1) * len(c) > max_tokens:
            batches.append(current)
            current = []
        current.append(c)
    return batches + [current] if current else batches


def one_update(model, optimizer, conversations, pad_id, device, args, temperature=1.0):
    """Returns {phase: seconds}, {phase: peak bytes over the pre-update level}, (padded tokens
    of all micro-batches, of the widest one), the gradient norm before clipping."""
    seconds, peaks = {}, {}
    base = reset_peak(device)

    t = time.perf_counter()  # 1. old log-probs, no grad (train.py: batch order, micro_batch_size at a time)
    batches = micro_batches(conversations, args.micro_batch_size, args.micro_batch_tokens)
    if args.micro_batch_tokens:  # the same token-sized micro-batches as the update
        pairs = [(c, lp) for b in batches for c, lp in zip(b, grpo.response_logprobs(
            model, b, pad_id, device, len(b), temperature))]
    else:
        pairs = zip(conversations, grpo.response_logprobs(model, conversations, pad_id, device,
                                                           args.micro_batch_size, temperature))
    for c, lp in pairs:
        c.old_logprobs = lp.tolist()
    seconds["old_logprobs"], peaks["old_logprobs"] = time.perf_counter() - t, read_peak(device) - base

    reset_peak(device)  # 2. forward + backward over every trained token, micro-batch by micro-batch
    t = time.perf_counter()
    model.train()
    num_tokens = sum(sum(c.loss_mask) for c in conversations)
    padded = widest = 0
    for micro in batches:
        ids, attn, start, f = grpo.pad_batch(micro, pad_id, device, ("loss_mask", "old_logprobs", "advantage"))
        padded, widest = padded + ids.numel(), max(widest, ids.numel())
        logprobs, entropy = grpo.token_logprobs(model, ids, attn, temperature, response_start=start,
                                                return_entropy=True)
        loss, _ = grpo.policy_loss(logprobs, f["old_logprobs"], f["advantage"], f["loss_mask"], None,
                                   clip_eps=0.2, clip_ratio_c=3.0, entropy=entropy, entropy_coef=0.001,
                                   num_tokens=max(num_tokens, 1))
        loss.backward()
        del logprobs, entropy, loss, ids, attn, f
    seconds["forward_backward"], peaks["forward_backward"] = time.perf_counter() - t, read_peak(device) - base

    reset_peak(device)  # 3. clip + AdamW step
    t = time.perf_counter()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds["clip_step"], peaks["clip_step"] = time.perf_counter() - t, read_peak(device) - base
    if not torch.isfinite(torch.tensor(grad_norm)):
        raise RuntimeError(f"non-finite gradient norm {grad_norm}")
    return seconds, peaks, (padded, widest), grad_norm


def run_variant(args):
    """Child process: load, roll out, one update; prints one `RESULT {json}` line."""
    try:  # if memory runs out, the kernel should kill this benchmark, not a neighbour
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = models.load("default", dtype=torch.float32, device=device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    trajectories, conversations, advantages = build_conversations(tokenizer, args.variant, args)
    for c, a in zip(conversations, advantages.tolist()):
        c.advantage = a
    seconds, peaks, (padded, widest), grad_norm = one_update(model, optimizer, conversations, tokenizer.pad_token_id,
                                                   device, args)
    lengths = [len(c) for c in conversations]
    result = {
        "variant": args.variant, "device": device.type, "trajectories": len(trajectories),
        "conversations": len(conversations), "trained_tokens": sum(sum(c.loss_mask) for c in conversations),
        "context_tokens": sum(lengths), "longest_context": max(lengths), "padded_tokens": padded,
        "widest_micro_batch": widest,
        "micro_batch": f"{args.micro_batch_tokens} tok" if args.micro_batch_tokens else str(args.micro_batch_size),
        "peak_bytes": max(peaks.values()), "peaks": peaks, "seconds": sum(seconds.values()), "phases": seconds,
        "grad_norm": grad_norm, "ends": sorted({t.end_reason for t in trajectories}),
        "reward": sum(t.reward for t in trajectories) / len(trajectories),
        "searches": sum(t.num_searches for t in trajectories)}
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# 4. Parent: one fresh process per variant, then the table
# ---------------------------------------------------------------------------------------------
def child(args, variant, micro_batch_tokens=0):
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--questions", str(args.questions),
           "--turns", str(args.turns), "--micro_batch_size", str(args.micro_batch_size),
           "--memory_words", str(args.memory_words), "--micro_batch_tokens", str(micro_batch_tokens)]
    if args.gradient_checkpointing:
        cmd.append("--gradient_checkpointing")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        print(f"{variant}: the child process failed (exit code {proc.returncode}; -9 is usually the OOM killer)"
              f" after {wall:.0f} s:\n{tail}", flush=True)
        return None
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall"] = wall
    print(f"{variant:>11}: done in {wall:.0f} s (process); {result['trajectories']} trajectories, "
          f"{result['searches']} searches, ends {result['ends']}, reward {result['reward']:.2f}, "
          f"grad norm {result['grad_norm']:.3g}; load average {os.getloadavg()[0]:.2f}", flush=True)
    return result


def mb(x):
    return x / 2**20


def print_table(rows):
    head = (f"{'variant':>20} | {'convs':>5} | {'trained tok':>11} | {'context tok':>11} | {'longest':>7} | "
            f"{'padded tok':>10} | {'micro-batch':>11} | {'widest mb':>9} | {'peak MB':>8} | {'fwd+bwd MB':>10} | {'seconds':>7}")
    print(head)
    print("-" * len(head))
    for label, r in rows:
        print(f"{label:>20} | {r['conversations']:>5} | {r['trained_tokens']:>11} | {r['context_tokens']:>11} | "
              f"{r['longest_context']:>7} | {r['padded_tokens']:>10} | {r['micro_batch']:>11} | "
              f"{r['widest_micro_batch']:>9} | "
              f"{mb(r['peak_bytes']):>8.0f} | {mb(r['peaks']['forward_backward']):>10.0f} | {r['seconds']:>7.1f}")
    print("\nphases (seconds; peak MB over the pre-update level):")
    print(f"{'variant':>20} | {'old log-probs':>16} | {'forward+backward':>16} | {'clip+AdamW step':>16}")
    for label, r in rows:
        cells = [f"{r['phases'][k]:>6.1f} s {mb(r['peaks'][k]):>6.0f} MB"
                 for k in ("old_logprobs", "forward_backward", "clip_step")]
        print(f"{label:>20} | " + " | ".join(f"{c:>16}" for c in cells))


def ratio_line(label, a, b):
    def r(x, y):
        return f"{x / y:.2f}x" if y else "n/a"
    return (f"{label}: peak memory {r(a['peak_bytes'], b['peak_bytes'])}, forward+backward memory "
            f"{r(a['peaks']['forward_backward'], b['peaks']['forward_backward'])}, time {r(a['seconds'], b['seconds'])}, "
            f"longest context {r(a['longest_context'], b['longest_context'])}, context tokens "
            f"{r(a['context_tokens'], b['context_tokens'])}, padded tokens {r(a['padded_tokens'], b['padded_tokens'])}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=2, help="questions from data/toy/test.jsonl (one trajectory each)")
    ap.add_argument("--turns", type=int, default=4, help="turns per trajectory: turns-1 searches, then the answer")
    ap.add_argument("--micro_batch_size", type=int, default=1, help="conversations per forward, both variants (train.py toy: 4)")
    ap.add_argument("--memory_words", type=int, default=60, help="words the scripted memory keeps")
    ap.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations in backward")
    ap.add_argument("--by_tokens", action="store_true",
                    help="also ReAct with micro-batches capped at MemSearcher's largest padded micro-batch in tokens")
    ap.add_argument("--variant", choices=["memsearcher", "react"], help=argparse.SUPPRESS)  # child process
    ap.add_argument("--micro_batch_tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variant:
        return run_variant(args)
    if args.turns < 2:
        ap.error("--turns must be >= 2 (at least one search before the answer)")

    import transformers

    start = time.perf_counter()
    device = "cuda " + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"machine: {os.cpu_count()} CPUs, {device}, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"transformers {transformers.__version__}; load average at start {os.getloadavg()[0]:.2f} "
          f"(1 min) {os.getloadavg()[1]:.2f} (5 min)")
    print(f"one update on SmolLM2-135M float32: {args.questions} questions x {args.turns} turns ({args.turns - 1} "
          f"searches, top_n 5, then \\boxed answer), micro-batch {args.micro_batch_size} conversations, gradient "
          f"checkpointing {'on' if args.gradient_checkpointing else 'off'}; each variant in a fresh process", flush=True)
    results = {}
    for variant in ("memsearcher", "react"):
        results[variant] = child(args, variant)
    rows = [(name, results[key]) for key, name in (("memsearcher", "MemSearcher"), ("react", "ReAct"))
            if results[key]]
    if args.by_tokens and results["memsearcher"]:
        ms = results["memsearcher"]
        budget = args.micro_batch_size * ms["longest_context"]
        by_tokens = child(args, "react", budget)
        if by_tokens:
            rows.append((f"ReAct <={budget} tok", by_tokens))
            results["react_tokens"] = by_tokens

    print(f"\n== One update (peak memory = growth over the level after loading the model and building the "
          f"trajectories; {'CUDA max_memory_allocated' if torch.cuda.is_available() else 'CPU peak RSS, VmHWM'})")
    print_table(rows)
    if results["memsearcher"] and results["react"]:
        print("\n" + ratio_line("ReAct / MemSearcher", results["react"], results["memsearcher"]))
    if results.get("react_tokens"):
        print(ratio_line("ReAct (token-sized micro-batches) / MemSearcher", results["react_tokens"],
                         results["memsearcher"]))
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average at end {os.getloadavg()[0]:.2f} (1 min) "
          f"{os.getloadavg()[1]:.2f} (5 min)")


if __name__ == "__main__":
    main()
