"""Benchmark: peak memory and time of token_logprobs + policy_loss, forward and backward, on the
embedded default model, against the naive version (a full float32 log-softmax over [B, L, V]).

    python bench/grpo.py                      # batch 8 x 1024 tokens, both variants
    python bench/grpo.py --batch 2 --length 512 --response-start 256

Each variant runs in a fresh subprocess, so one's allocations cannot hide the other's. Peak memory
is measured above the memory held after loading the model and building the batch: on CUDA with
torch.cuda.max_memory_allocated, on CPU from the kernel's resident-set high-water mark (VmHWM,
reset through /proc/self/clear_refs). Both variants use the same model forward and backward
(with gradient checkpointing unless --no-checkpointing, so the model's own activations stay small
and the log-prob cost is what differs), the same loss, the same optimiser-free single step.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from grpo import policy_loss, token_logprobs  # noqa: E402


# ---------------------------------------------------------------------------------------------
# 1. The two ways to get log-probs
# ---------------------------------------------------------------------------------------------
def naive_token_logprobs(model, input_ids, attention_mask, temperature=1.0, *, response_start=None,
                         return_entropy=True):
    """The textbook version: logits -> float32 log_softmax over the whole [B, L, V] -> gather."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    logq = torch.log_softmax(logits.float() / temperature, dim=-1)[:, :-1]
    logp = logq.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logq.exp() * logq).sum(-1)
    pad = torch.nn.functional.pad
    return pad(logp, (1, 0)), pad(entropy, (1, 0))


def one_step(variant, model, batch, response_start):
    fn = token_logprobs if variant == "ours" else naive_token_logprobs
    logp, entropy = fn(model, batch["input_ids"], batch["attention_mask"],
                       response_start=response_start, return_entropy=True)
    loss, _ = policy_loss(logp, batch["old"], batch["advantages"], batch["loss_mask"], batch["ref"],
                          entropy=entropy, entropy_coef=0.001)
    loss.backward()
    return loss.item()


# ---------------------------------------------------------------------------------------------
# 2. Memory probes
# ---------------------------------------------------------------------------------------------
def _status_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    return _status_kb("VmRSS") / 1024


def peak_mb(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    return _status_kb("VmHWM") / 1024


# ---------------------------------------------------------------------------------------------
# 3. One variant (child process) and the table (parent)
# ---------------------------------------------------------------------------------------------
def run_variant(args):
    from agent import load_model

    torch.manual_seed(0)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, _ = load_model("default", dtype=getattr(torch, args.dtype), device=device)
    model.train()
    if args.checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    B, L, V = args.batch, args.length, model.config.vocab_size
    start = args.response_start or 1
    loss_mask = torch.zeros(B, L, dtype=torch.long, device=device)
    loss_mask[:, start:] = 1
    batch = {
        "input_ids": torch.randint(0, V, (B, L), device=device),
        "attention_mask": torch.ones(B, L, dtype=torch.long, device=device),
        "old": -torch.rand(B, L, device=device) * 10,
        "ref": -torch.rand(B, L, device=device) * 10,
        "advantages": torch.randn(B, device=device),
        "loss_mask": loss_mask,
    }
    base = reset_peak(device)
    t0 = time.perf_counter()
    loss = one_step(args.variant, model, batch, args.response_start)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(json.dumps({"variant": args.variant, "peak_mb": peak_mb(device) - base, "seconds": seconds,
                      "loss": loss, "device": str(device), "vocab": V}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--response-start", type=int, default=None,
                   help="score only tokens from this column on (ours: logits_to_keep); default all")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--variant", choices=["ours", "naive"], help="(internal) run one variant and print JSON")
    args = p.parse_args()
    if args.variant:
        return run_variant(args)

    rows = {}
    for variant in ["ours", "naive"]:
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant] + sys.argv[1:]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
        rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    ours, naive = rows["ours"], rows["naive"]
    print(f"token_logprobs + policy_loss, forward + backward: batch {args.batch} x {args.length} tokens, "
          f"vocab {ours['vocab']}, {args.dtype}, {ours['device']}, response_start={args.response_start}, "
          f"gradient checkpointing {'on' if args.checkpointing else 'off'}")
    print(f"{'':>16} {'ours':>10} {'naive':>10} {'naive/ours':>11}")
    print(f"{'peak memory MB':>16} {ours['peak_mb']:>10.0f} {naive['peak_mb']:>10.0f} "
          f"{naive['peak_mb'] / ours['peak_mb']:>10.2f}x")
    print(f"{'seconds':>16} {ours['seconds']:>10.1f} {naive['seconds']:>10.1f} "
          f"{naive['seconds'] / ours['seconds']:>10.2f}x")
    print(f"{'loss':>16} {ours['loss']:>10.5f} {naive['loss']:>10.5f}")


if __name__ == "__main__":
    main()
