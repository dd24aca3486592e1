"""The decode step beside the machine's floor: one read of the model's weights.

    python bench/decode.py                          # this checkout: batch 1, 16, 64 x 100, 400, 1600 cached tokens
    python bench/decode.py --repo ../old_checkout   # the same, and another checkout's, in one run
    python bench/decode.py --compile --batches 1 16 --contexts 400   # does torch.compile pay for the step here?

A decode step is measured inside `agent.generate` itself (greedy, float32, the embedded default):
a logits processor stamps the clock at every step, and the step is the median gap between stamps
after the first (the first follows the prefill). Prompts are B rows of C random tokens (no
padding), and the stop id is one that never comes, so every row makes every token. The floor is
the time one decode step must take at least, reading every weight once: half the time of copying
the model's parameter bytes (a copy reads and writes each byte), measured in the same process.
Beside it, the weight matmuls alone at batch B (every linear layer on B rows): on a few CPU cores
they, not the read, bound the step from batch 16 up. Each checkout runs in its own process, one
configuration at a time. Prints the step, the floor, their ratio and the matmuls per (B, C), and
with --repo the ratio of the two checkouts' steps.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weights_read_seconds(model, repeats: int = 5) -> float:
    """Half the fastest of `repeats` copies of every parameter into buffers made beforehand."""
    import torch

    params = [p.detach() for p in model.parameters()]
    buffers = [torch.empty_like(p) for p in params]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b, p in zip(buffers, params):
            b.copy_(p)
        best = min(best, time.perf_counter() - t0)
    return best / 2


def matmul_seconds(model, batch: int, repeats: int = 5) -> float:
    """The step's weight matmuls alone: every linear layer (and the head) on `batch` rows, the fastest
    of `repeats`. Where it exceeds the read floor, the step is bound by arithmetic, not memory."""
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(batch, m.in_features) for m in linears}
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            for m in linears:
                torch.nn.functional.linear(inputs[m.in_features], m.weight)
            best = min(best, time.perf_counter() - t0)
    return best


def child(repo: str, batch: int, context: int, new_tokens: int, threads: int) -> dict:
    """One configuration in `repo`'s agent.generate: its decode step, and the floor."""
    sys.path.insert(0, repo)
    import torch

    import agent
    torch.set_num_threads(threads)
    try:
        from tools import models
        model, tokenizer = models.load("default")
    except ImportError:  # a checkout from before tools/models.py
        model, tokenizer = agent.load_model("default")
    model.eval()
    stamps, make_recorder = [], agent.make_recorder

    class Stamped:  # the recorder, with the clock read at every step
        def __init__(self, temperature):
            self.inner = make_recorder(temperature)

        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return self.inner(input_ids, scores)

        def score(self, tokens):
            self.inner.score(tokens)

        logprobs = property(lambda self: self.inner.logprobs)

    agent.make_recorder = Stamped
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, len(tokenizer) - 100, (context,), generator=g).tolist() for _ in range(batch)]
    out = agent.generate(model, tokenizer, prompts, max_new_tokens=new_tokens, greedy=True, stop_ids=[len(tokenizer) + 7])
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    return {"step": statistics.median(gaps), "floor": weights_read_seconds(model), "matmuls": matmul_seconds(model, batch),
            "tokens": out[0].ids[:8],
            "bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def compiled_step(batch: int, context: int, new_tokens: int, threads: int) -> dict:
    """One decode step of this checkout's default model with transformers' static cache, run as it
    is and through `torch.compile` (fixed shapes): the median step of each, the compile time, and
    whether the greedy tokens agree. Where the compiled step is not faster, compiling does not pay."""
    sys.path.insert(0, ROOT)
    import torch
    from transformers import StaticCache

    from tools import models
    torch.set_num_threads(threads)
    model, _ = models.load("default")
    model.eval()
    prompt = torch.randint(100, 40000, (batch, context), generator=torch.Generator().manual_seed(0))

    def decode(step_fn) -> tuple[torch.Tensor, float]:
        cache = StaticCache(config=model.config, max_cache_len=context + new_tokens + 1)
        with torch.no_grad():
            out = model(input_ids=prompt, past_key_values=cache, cache_position=torch.arange(context))
            token, tokens, times = out.logits[:, -1].argmax(-1, keepdim=True), [], []
            for k in range(new_tokens):
                t0 = time.perf_counter()
                token = step_fn(token, cache, torch.tensor([context + k]))[:, -1].argmax(-1, keepdim=True)
                times.append(time.perf_counter() - t0)
                tokens.append(token)
        return torch.cat(tokens, 1), statistics.median(times[2:])

    def eager(ids, cache, position):
        return model(input_ids=ids, past_key_values=cache, cache_position=position).logits

    compiled = torch.compile(eager, dynamic=False)
    plain_tokens, plain = decode(eager)
    t0 = time.perf_counter()
    decode(compiled)  # the first call compiles
    compile_seconds = time.perf_counter() - t0
    tokens, fast = decode(compiled)
    return {"eager": plain, "compiled": fast, "compile_seconds": compile_seconds, "equal": torch.equal(tokens, plain_tokens)}


def measure(repo: str, batch: int, context: int, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", repo, "--batches", str(batch), "--contexts", str(context),
           "--new_tokens", str(args.new_tokens), "--threads", str(args.threads)] + ["--compile"] * args.compile
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def cpu_name() -> str:
    try:
        return next(x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=None, help="another checkout to measure beside this one (e.g. the commit before a change)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 400, 1600], help="cached tokens (the prompt's length)")
    ap.add_argument("--new_tokens", type=int, default=12, help="tokens per row; the steps after the first are timed")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--compile", action="store_true",
                    help="instead: the decode step with a static cache, as it is and through torch.compile (does compiling pay here?)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run = compiled_step if args.compile else lambda *a: child(args.child, *a)
        print(json.dumps(run(args.batches[0], args.contexts[0], args.new_tokens, args.threads)))
        return
    if args.compile:
        print(f"{cpu_name()}, {args.threads} threads; float32, greedy, static cache, {args.new_tokens} new tokens a row")
        print("batch context | eager ms | compiled ms | eager / compiled | compile s | same tokens")
        for batch in args.batches:
            for context in args.contexts:
                r = measure(ROOT, batch, context, args)
                print(f"{batch:5d} {context:7d} | {r['eager'] * 1e3:8.1f} | {r['compiled'] * 1e3:11.1f} | "
                      f"{r['eager'] / r['compiled']:15.2f}x | {r['compile_seconds']:9.0f} | {r['equal']}", flush=True)
        return
    repos = [("this", ROOT)] + ([("other", os.path.abspath(args.repo))] if args.repo else [])
    print(f"{cpu_name()}, {args.threads} threads; float32, greedy, {args.new_tokens} new tokens a row")
    print("floor: one read of the weights (half a copy of their bytes); matmuls: the weight matmuls alone at this batch")
    head = "batch context | " + " | ".join(f"{name}: step ms, floor ms, step/floor, matmuls ms" for name, _ in repos)
    print(head + (" | other / this" if args.repo else ""))
    for batch in args.batches:
        for context in args.contexts:
            got = [measure(repo, batch, context, args) for _, repo in repos]
            cells = [f"{r['step'] * 1e3:8.1f} {r['floor'] * 1e3:6.1f} {r['step'] / r['floor']:5.1f}x {r['matmuls'] * 1e3:7.1f}"
                     for r in got]
            same = "" if len(got) < 2 else f" | {got[1]['step'] / got[0]['step']:5.2f}x" + (
                "" if got[0]["tokens"] == got[1]["tokens"] else " (tokens differ)")
            print(f"{batch:5d} {context:7d} | " + " | ".join(cells) + same, flush=True)


if __name__ == "__main__":
    main()
