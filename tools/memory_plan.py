"""Which model, strategy and GPUs fit a GRPO training step: the plan's tables, a breakdown, host RAM.

    python tools/memory_plan.py                                     # the table: which setups fit which GPUs
    python tools/memory_plan.py --model 3B --strategy fsdp --gpus 4 --gpu_gb 80 --rollout_batch_size 64
    python tools/memory_plan.py --model 7B --strategy lora --gpus 1 --gpu_gb 80 --lora_rank 32
    python tools/memory_plan.py --validate                          # plan vs measured peak RSS on this CPU
    python tools/memory_plan.py --host [--validate_host]            # host RAM of start-up per rank and node
    python tools/memory_plan.py --host --gpus 4 --machines 2        # 2 x 4 GPUs beside 1 x 8: per rank, per machine

The plan is split by what it plans (docs/memory_plan.md):
  tools/memory_gpu.py    each rank's peak GPU memory, phase by phase and term by term
  tools/memory_host.py   host RAM of start-up, per rank and per node
  tools/memory_check.py  both against peaks measured on this CPU
This file prints them: 1. the table and the breakdown     2. command line
"""
import argparse
import dataclasses
import sys

from memory_gpu import MODELS, Dims, GiB, Setup, count_params, dims_from_config, gb, label, peak, phases
from memory_host import RETRIEVER_NODE, host_start_up, host_table


# ---------------------------------------------------------------------------------------------
# 1. The table and the breakdown
# ---------------------------------------------------------------------------------------------
def rollout_candidates(rows: int) -> list[int]:
    """R values tried, largest first: the rank's rows, then 256, 128, ..., 5 (one question's group)."""
    return [r for r in dict.fromkeys([rows, 256, 128, 64, 32, 16, 8, 5]) if r <= rows]


def best_fit(s: Setup, gpu_gb: float):
    """The largest R (rows per rank first) that fits, with the reference on the GPU if it fits, else on the
    CPU; (setup, peak) or (None, peak at R=5 with the reference on the CPU)."""
    for r in rollout_candidates(s.rows_per_rank):
        for on_cpu in (False, True) if s.reference and s.strategy != "lora" else (False,):
            t = dataclasses.replace(s, rollout_batch_size=r, reference_on_cpu=on_cpu)
            p, _ = peak(t)
            if p <= gpu_gb * GiB:
                return t, p
    t = dataclasses.replace(s, rollout_batch_size=5, reference_on_cpu=s.reference and s.strategy != "lora")
    return None, peak(t)[0]


def fit_line(s: Setup, gpu_gb: float) -> str:
    """e.g. `3B FSDP 4x80: fits, R=128, peak 61.2 GB` or `no (needs 93.0 GB at R=5)`."""
    t, p = best_fit(s, gpu_gb)
    head = f"{s.dims.name.split()[0]} {label(s)} {s.gpus}x{gpu_gb:g}"
    if t is None:
        return f"{head}: no (needs {gb(p)} at R=5, reference on CPU)"
    ref = ", reference on CPU" if t.reference_on_cpu else ""
    return f"{head}: fits, R={t.rollout_batch_size} ({t.rows_per_call} rows per call){ref}, peak {gb(p)} ({peak(t)[1]})"


GPUS, SIZES = (1, 2, 4, 8), (24, 48, 80)


TIGHT = 0.9  # a fit above 90% of the card's size is marked: GPU allocator fragmentation is not modelled


def table(base: Setup, models=("0.5B", "1.5B", "3B", "7B")) -> str:
    """One line per model x strategy; a cell per W x GB: the largest R that fits ('c': reference on the
    CPU; '*': peak above 90% of the card; '-': does not fit even at R=5 with the reference on the CPU)."""
    cols = [(w, g) for w in GPUS for g in SIZES]
    lines = ["model strategy   " + " ".join(f"{w}x{g:<4d}" for w, g in cols)]
    for name in models:
        for strategy in ("ddp", "fsdp", "lora"):
            cells = []
            for w, g in cols:
                s = dataclasses.replace(base, dims=MODELS[name], strategy=strategy, gpus=w)
                t, p = best_fit(s, g)
                tight = "*" if t is not None and p > TIGHT * g * GiB else ""
                cells.append("-" if t is None else f"{t.rollout_batch_size}{'c' if t.reference_on_cpu else ''}{tight}")
            lines.append(f"{name:<5} {label(s):<10} " + " ".join(f"{x:<6}" for x in cells))
    return "\n".join(lines)


def peak_table(base: Setup, models=("0.5B", "1.5B", "3B", "7B")) -> str:
    """Peak per rank at the setup's own R (reference on the GPU), per W: one line per model x strategy."""
    lines = ["model strategy   " + " ".join(f"W={w:<12d}" for w in GPUS)]
    for name in models:
        for strategy in ("ddp", "fsdp", "lora"):
            cells = []
            for w in GPUS:
                s = dataclasses.replace(base, dims=MODELS[name], strategy=strategy, gpus=w)
                total, phase = peak(s)
                cells.append(f"{total / GiB:5.1f} {phase:<8}")
            lines.append(f"{name:<5} {label(s):<10} " + " ".join(f"{x:<14}" for x in cells))
    return "\n".join(lines)


def breakdown(s: Setup) -> str:
    """Every phase, term by term, and the step's peak."""
    d = s.dims
    P = count_params(d)
    out = [f"{d.name}: P = {P:,} ({P / 1e9:.3f}B; published {d.known or '?'}), {label(s)}, W={s.gpus}, precision {s.precision}, "
           f"R={s.rollout_batch_size} ({s.rows_per_call} rows per call of {s.rows_per_rank} per rank), m={s.micro_batch_size}, "
           f"T={s.tokens}, T_ctx={s.context_tokens}, checkpointing {'on' if s.checkpointing else 'off'}, "
           f"reference {'on CPU' if s.reference_on_cpu else 'on device' if s.reference else 'none'}"]
    for phase, terms in phases(s).items():
        out.append(f"  {phase:<9} {gb(sum(t.bytes for t in terms)):>9}")
        out += [f"    {t.name:<34} {gb(t.bytes):>9}   {t.formula}" for t in terms]
    total, phase = peak(s)
    out.append(f"  peak {gb(total)} ({phase})")
    return "\n".join(out)


def param_check() -> str:
    """The counted parameters beside the published sizes."""
    return "\n".join(f"  {k:<5} {count_params(d):>14,}  = {count_params(d) / 1e9:.3f}B   published {d.known}"
                     for k, d in MODELS.items())


def goals(base: Setup) -> str:
    """The questions the plan answers, true or false."""
    def fits(name, strategy, w, g):
        return best_fit(dataclasses.replace(base, dims=MODELS[name], strategy=strategy, gpus=w), g)[0] is not None
    ddp3 = [f"{w}x{g}" for w in GPUS for g in SIZES if fits("3B", "ddp", w, g)]

    def at(name, strategy, w):
        total, phase = peak(dataclasses.replace(base, dims=MODELS[name], strategy=strategy, gpus=w))
        return f"{gb(total)} ({phase})"
    lines = [fit_line(dataclasses.replace(base, dims=MODELS["3B"], strategy="fsdp", gpus=4), 80),
             fit_line(dataclasses.replace(base, dims=MODELS["3B"], strategy="ddp", gpus=4), 80),
             fit_line(dataclasses.replace(base, dims=MODELS["3B"], strategy="lora", gpus=1), 24),
             fit_line(dataclasses.replace(base, dims=MODELS["7B"], strategy="lora", gpus=1), 80),
             f"at R={base.rollout_batch_size}: 3B FSDP 4 GPUs {at('3B', 'fsdp', 4)}, 3B DDP 4 GPUs {at('3B', 'ddp', 4)}, "
             f"3B LoRA 1 GPU {at('3B', 'lora', 1)}, 7B LoRA 1 GPU {at('7B', 'lora', 1)}",
             f"paper preset, 3B, FSDP, 4 x 80 GB fits: {fits('3B', 'fsdp', 4, 80)}",
             f"3B under DDP fits: {', '.join(ddp3) if ddp3 else 'nowhere in the table'}",
             f"3B LoRA (r={base.lora_rank}) fits 1 x 24 GB: {fits('3B', 'lora', 1, 24)}",
             f"7B LoRA (r={base.lora_rank}) fits 1 x 80 GB: {fits('7B', 'lora', 1, 80)}"]
    return "\n".join(lines)


def machines_table(base: Setup, ranks: int, machines: int, models=("3B", "7B")) -> str:
    """FSDP over one machine or several, the same W ranks: each rank's GPU memory (it depends on W,
    not on where the ranks are) and each machine's host RAM (its own ranks only)."""
    layouts = list(dict.fromkeys([(1, ranks), (machines, ranks // machines)] if machines > 1 else [(1, 8), (2, 4)]))
    lines = [f"FSDP on one machine or two, the same ranks; R = {base.rollout_batch_size}, the rest as the paper preset",
             "", "| model | machines x GPUs | GPU per rank (phase) | host RAM per machine | the machine with the wiki-18 server |",
             "| --- " * 5 + "|"]
    for name in models:
        for n, per in layouts:
            total, phase = peak(dataclasses.replace(base, dims=MODELS[name], strategy="fsdp", gpus=n * per))
            node = sum(t.bytes for t in host_start_up(MODELS[name], "fsdp", per))
            lines.append(f"| {name} | {n} x {per} | {gb(total)} ({phase}) | {gb(node)} | {gb(node + RETRIEVER_NODE)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 2. Command line
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    """The breakdown's flags (train.py's names where they exist), --host, --validate and --validate_host."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, choices=list(MODELS), help="a breakdown for this model (else the table)")
    ap.add_argument("--config", default=None, help="an HF config.json instead of --model")
    ap.add_argument("--strategy", default="fsdp", choices=["ddp", "fsdp", "lora"])
    ap.add_argument("--gpus", type=int, default=1, help="GPUs per machine")
    ap.add_argument("--machines", type=int, default=1, help="machines: W = machines x gpus ranks; host RAM is per machine")
    ap.add_argument("--gpu_gb", type=float, default=80)
    ap.add_argument("--rollout_batch_size", type=int, default=64, help="R rows per generate call (0: all the rank's rows)")
    ap.add_argument("--micro_batch_size", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=3500, help="T: a conversation's tokens and the rollout's context T_ctx")
    ap.add_argument("--prefill_tokens", type=int, default=1536, help="tokens one generate call prefills per row")
    ap.add_argument("--response_tokens", type=int, default=0, help="logit rows kept per conversation (0: T, an upper bound)")
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--group_size", type=int, default=5)
    ap.add_argument("--reference_on_cpu", action="store_true")
    ap.add_argument("--no_reference", action="store_true", help="kl_coef 0: no reference model")
    ap.add_argument("--no_checkpointing", action="store_true")
    ap.add_argument("--no_autocast_cache", action="store_true", help="autocast with cache_enabled=False (not train.py's)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "no"])
    ap.add_argument("--lora_rank", type=int, default=32)
    ap.add_argument("--runtime_gb", type=float, default=1.0, help="GPU runtime term (assumed)")
    ap.add_argument("--validate", action="store_true", help="plan vs measured peak RSS on this CPU")
    ap.add_argument("--host", action="store_true", help="host RAM of start-up per rank and per node (3B, 7B)")
    ap.add_argument("--validate_host", action="store_true", help="the host plan vs bench/host_memory.py on this CPU")
    return ap.parse_args(argv)


def setup_from_args(args, dims: Dims) -> Setup:
    """The Setup the flags describe (T sets both the conversations' and the rollout's context)."""
    return Setup(dims, strategy=args.strategy, gpus=args.gpus * args.machines, precision=args.precision,
                 rollout_batch_size=args.rollout_batch_size, batch_size=args.batch_size, group_size=args.group_size,
                 micro_batch_size=args.micro_batch_size, tokens=args.tokens, context_tokens=args.tokens,
                 prefill_tokens=min(args.prefill_tokens, args.tokens), response_tokens=args.response_tokens,
                 checkpointing=not args.no_checkpointing, reference=not args.no_reference,
                 reference_on_cpu=args.reference_on_cpu, lora_rank=args.lora_rank, runtime_bytes=args.runtime_gb * GiB,
                 autocast_cache=not args.no_autocast_cache)


def main(argv=None):
    """Table and goals by default; a breakdown with --model/--config; the CPU check with --validate."""
    args = parse_args(argv)
    if args.validate:
        import memory_check
        sys.exit(0 if memory_check.validate() else 1)
    if args.host or args.validate_host:
        print(host_table())
        print("\n" + machines_table(setup_from_args(args, MODELS["7B"]), args.gpus * args.machines, args.machines))
        if args.validate_host:
            import memory_check
            sys.exit(0 if memory_check.validate_host() else 1)
        return
    if args.model or args.config:
        dims = dims_from_config(args.config) if args.config else MODELS[args.model]
        s = setup_from_args(args, dims)
        print(breakdown(s))
        total, phase = peak(s)
        verdict = "fits" if total <= args.gpu_gb * GiB else "does not fit"
        print(f"{verdict} in {args.gpu_gb:g} GB; best for this GPU: {fit_line(s, args.gpu_gb)}")
        node = sum(t.bytes for t in host_start_up(dims, args.strategy, 1 if args.strategy == "lora" else args.gpus))
        print(f"host RAM of start-up per machine ({args.machines} machine(s) x {args.gpus} GPUs): {gb(node)}, "
              f"{gb(node + RETRIEVER_NODE)} on the one with the wiki-18 server (memory_host.py)")
        return
    base = setup_from_args(args, MODELS["3B"])
    print("parameter counts (from the dims):\n" + param_check())
    print(f"\npaper preset: {base.batch_size} questions x G {base.group_size} per step, T = T_ctx = {base.tokens}, "
          f"m = {base.micro_batch_size}, {base.precision}, checkpointing {'on' if base.checkpointing else 'off'}, "
          f"reference {'none' if not base.reference else 'needed'}, LoRA r = {base.lora_rank}, runtime {gb(base.runtime_bytes)} "
          f"assumed\ncell: the largest R (rows per generate call) that fits; c: reference on the CPU; -: no fit at R=5\n")
    print(table(base))
    print(f"\npeak per rank in GB (and the phase that sets it) at R = {base.rollout_batch_size} "
          f"({base.rows_per_call} rows per call), reference on the GPU:\n")
    print(peak_table(base))
    print("\n" + goals(base))


if __name__ == "__main__":
    main()
