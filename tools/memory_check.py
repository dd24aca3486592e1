"""The memory plans against measured peaks on this CPU: each phase of a step in a fresh process,
its VmHWM beside the plan of tools/memory_gpu.py (CPU settings: float32, one process), and the host
RAM of start-up beside tools/memory_host.py (bench/host_memory.py's measurement).

    python tools/memory_plan.py --validate        # GPU plan vs measured VmHWM per phase (~20 min)
    python tools/memory_plan.py --validate_host   # host plan vs a measured FSDP start-up

1. GPU memory per rank (a phase per process)     2. host RAM of start-up
"""
import ctypes
import datetime
import json
import os
import subprocess
import sys
import time

from memory_gpu import CHUNK_ELEMENTS, MODELS, Setup, count_params, gb, phases, resident
from memory_host import host_start_up

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


# ---------------------------------------------------------------------------------------------
# 1. GPU memory per rank: each phase in a fresh subprocess, its VmHWM against the plan
# ---------------------------------------------------------------------------------------------
VALIDATION = {  # random-weight models; shapes sized for ~1-2 minutes per process on 2 cores
    "135M": dict(rows=8, prompt=512, new=64, micro=2, tokens=512),
    "0.5B": dict(rows=4, prompt=256, new=32, micro=2, tokens=256),
}
TOLERANCE = 0.15


def proc_status(key: str) -> float:
    """A /proc/self/status field in bytes (VmHWM: peak resident set, VmRSS: resident now)."""
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024


def reset_peak():
    """Restart VmHWM from the resident size now (as tools/runs.peak_memory(reset=True)), after a trim, so that
    the peak covers the phase and not the model's construction (from_config builds an untied lm_head
    before tying it: V x H x 4 more for a moment)."""
    malloc_trim()
    open("/proc/self/clear_refs", "w").write("5")
    return proc_status("VmRSS")


def malloc_trim():
    """glibc: hand freed heap memory back (tools/runs.release_freed_memory does this after rollouts and updates)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def import_runtime():
    """What every measured process imports: torch, transformers' model classes, the project's modules."""
    sys.path.insert(0, ROOT)
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: F401

    import agent  # noqa: F401
    import grpo
    from tools import models  # noqa: F401
    assert grpo.CHUNK_ELEMENTS == CHUNK_ELEMENTS, "grpo.CHUNK_ELEMENTS changed: update the plan"


def load_tokenizer():
    """The embedded default's tokenizer, from its GGUF file (no weights), as tests/conftest.py does."""
    from transformers import AutoTokenizer

    from tools import models
    folder, name = os.path.split(models.default_model_file())
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.padding_side = "left"
    return tok


def build_model(size: str, pad_id: int, eos_id: int):
    """A random float32 model of `size`'s shape (LlamaConfig for 135M, Qwen2Config for 0.5B)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    d = MODELS[size]
    kind = Qwen2Config if d.qkv_bias else LlamaConfig
    config = kind(vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.intermediate, num_hidden_layers=d.layers,
                  num_attention_heads=d.heads, num_key_value_heads=d.kv_heads, tie_word_embeddings=d.tied,
                  max_position_embeddings=4096, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=eos_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == count_params(d), "the plan's parameter count is off"
    return model


def conversations(n: int, tokens: int, vocab: int, shorter: int = 16):
    """n synthetic conversations of `tokens` tokens (the first one `shorter` tokens shorter, so rows are
    padded and the attention mask is materialised as in training): a quarter prompt, the rest response,
    every response token trained; old/reference log-probs and advantages are arbitrary numbers."""
    import random

    import agent
    rng = random.Random(0)
    out = []
    for k in range(n):
        prompt = tokens // 4 - (shorter if k == 0 else 0)
        response = tokens - tokens // 4
        out.append(agent.Conversation(prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt)],
                                      response_ids=[rng.randrange(3, vocab) for _ in range(response)],
                                      loss_mask=[1] * response, logprobs=[0.0] * response,
                                      old_logprobs=[-3.0] * response, ref_logprobs=[-3.1] * response,
                                      advantage=1.0 if k % 2 else -1.0))
    return out


def measure_runtime(size: str) -> dict:
    """(a) imports only: VmHWM is the CPU plan's runtime term; then the tokenizer's resident cost."""
    import_runtime()
    out = {"runtime": proc_status("VmHWM")}
    before = proc_status("VmRSS")
    load_tokenizer()
    out["tokenizer"] = proc_status("VmRSS") - before
    out["tokenizer_load_hwm"] = proc_status("VmHWM")
    return out


def measure_rollout(size: str) -> dict:
    """(b) agent.generate on R random prompts of up to T tokens (rows differ in length by 8 tokens each)."""
    import_runtime()
    import torch

    import agent
    v = VALIDATION[size]
    tok = load_tokenizer()
    model = build_model(size, tok.pad_token_id, tok.eos_token_id).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(tok), (v["prompt"] - 8 * k,), generator=g).tolist() for k in range(v["rows"])]
    build = proc_status("VmHWM")
    start = reset_peak()
    t0 = time.time()
    torch.manual_seed(0)
    gens = agent.generate(model, tok, prompts, max_new_tokens=v["new"], temperature=1.0, top_p=1.0, top_k=0)
    return {"peak": proc_status("VmHWM"), "seconds": time.time() - t0, "new_tokens": max(len(x.ids) for x in gens),
            "build_peak": build, "start": start}


def measure_logprobs(size: str) -> dict:
    """(d) grpo.response_logprobs (no grad) over one micro-batch of m synthetic conversations."""
    import_runtime()
    import torch

    import grpo
    v = VALIDATION[size]
    model = build_model(size, 2, 2)
    convs = conversations(v["micro"], v["tokens"], MODELS[size].vocab)
    build = proc_status("VmHWM")
    start = reset_peak()
    t0 = time.time()
    grpo.response_logprobs(model, convs, 2, torch.device("cpu"), v["micro"], 1.0)
    return {"peak": proc_status("VmHWM"), "seconds": time.time() - t0, "build_peak": build, "start": start}


def measure_update(size: str, checkpointing: bool) -> dict:
    """(c) one steady-state micro-batch: AdamW's moments and the gradients already exist (a first step on
    zero gradients creates the moments; the gradients are kept, as for a micro-batch after the first),
    then grpo.micro_logprobs + grpo.policy_loss (KL to recorded reference log-probs, entropy bonus),
    backward, gradient clipping, AdamW step, zero_grad(set_to_none), malloc_trim."""
    import_runtime()
    import torch

    import grpo
    v = VALIDATION[size]
    model = build_model(size, 2, 2).train()
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates exp_avg and exp_avg_sq
    warm = proc_status("VmHWM")
    start = reset_peak()
    convs = conversations(v["micro"], v["tokens"], MODELS[size].vocab)
    fields = ("loss_mask", "old_logprobs", "ref_logprobs", "advantage")
    t0 = time.time()
    (logprobs, entropy), f = grpo.micro_logprobs(model, convs, 2, torch.device("cpu"), fields, 1.0, True)
    loss, _ = grpo.policy_loss(logprobs, f["old_logprobs"], f["advantage"], f["loss_mask"], f["ref_logprobs"],
                               kl_coef=0.001, entropy=entropy, entropy_coef=0.001, num_tokens=f["loss_mask"].sum())
    loss.backward()
    after_backward = proc_status("VmHWM")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rss = proc_status("VmRSS")
    malloc_trim()
    return {"peak": proc_status("VmHWM"), "seconds": time.time() - t0, "first_step_peak": warm, "start": start,
            "after_backward": after_backward, "rss_before_trim": rss, "rss_after_trim": proc_status("VmRSS")}


MEASURES = {"runtime": measure_runtime, "rollout": measure_rollout, "logprobs": measure_logprobs,
            "update": lambda size: measure_update(size, True), "update_nockpt": lambda size: measure_update(size, False)}


FIXED_MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # glibc: blocks >= 128 KiB mmapped, unmapped when freed


def run_measure(what: str, size: str, env: dict | None = None) -> dict:
    """One measurement in a fresh Python process (so its VmHWM covers that phase only); `env` adds
    environment variables (FIXED_MMAP: no heap retention of freed large blocks)."""
    cmd = [sys.executable, os.path.abspath(__file__), what, size]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def cpu_setup(size: str, runtime: float, note: str, **kw) -> Setup:
    """The CPU plan: float32 everywhere ("no"), one process, no DDP, no reference copy, measured runtime."""
    v = VALIDATION[size]
    return Setup(MODELS[size], strategy="ddp", gpus=1, precision="no", micro_batch_size=v["micro"], tokens=v["tokens"],
                 response_tokens=v["tokens"] - v["tokens"] // 4 + 1, reference=False, device="cpu", runtime_bytes=runtime,
                 runtime_note=note, batch_size=v["rows"], group_size=1, rollout_batch_size=v["rows"],
                 temperature=1.0, top_k=0, top_p=1.0, **kw)


def validation_plans(size: str, runtime: dict, new_tokens: int) -> dict:
    """{check: (Setup, phase)}: the plan each measured process is compared with."""
    v = VALIDATION[size]
    note = "measured: VmHWM of a process that only imports"
    rt = runtime["runtime"]
    rollout = cpu_setup(size, rt + runtime["tokenizer"], note + " + the tokenizer's resident size", optimizer=False,
                        context_tokens=v["prompt"], new_tokens=new_tokens)
    bare = cpu_setup(size, rt, note, optimizer=False)
    return {"rollout": (rollout, "rollout"), "logprobs": (bare, "logprobs"),
            "update": (cpu_setup(size, rt, note), "update"),
            "update_nockpt": (cpu_setup(size, rt, note, checkpointing=False), "update")}


def plan_total(s: Setup, phase: str) -> tuple[float, float]:
    """(total, dynamic part) of a phase's plan; for the update the larger of update and step."""
    ph = phases(s)
    names = ("update", "step") if phase == "update" else (phase,)
    best = max(names, key=lambda n: sum(t.bytes for t in ph[n]))
    static = sum(t.bytes for t in resident(s, best)) + s.runtime_bytes
    total = sum(t.bytes for t in ph[best])
    return total, total - static


def cpu_name() -> str:
    """`lscpu`'s model name and CPU count."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("Model name"))
        cores = next(x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("CPU(s)"))
        return f"{name}, {cores} CPUs"
    except (OSError, StopIteration):
        return "unknown CPU"


def validate(sizes=("135M", "0.5B"), checks=("rollout", "logprobs", "update", "update_nockpt")) -> bool:
    """Plan vs measured VmHWM per phase and size, each in a fresh process, twice: glibc's default
    allocator (what train.py runs with) and a fixed mmap threshold (freed blocks of 128 KiB or more go
    back to the OS at once: the live peak without heap retention). PASS: within 15% of the plan's total."""
    print(f"CPU: {cpu_name()}; torch {torch_version()}; {datetime.date.today()}")
    print("CPU plan: precision no (float32 weights, KV cache, logits), one process, no DDP, no reference copy;\n"
          "runtime term measured (VmHWM of a process that only imports); VmHWM reset after each model is built;\n"
          "'dynamic' = peak minus the plan's static part (runtime + weights [+ gradients + AdamW])\n")
    ok = {"default": True, "fixed mmap": True}
    header = (f"{'size':<5} {'check':<14} {'plan':>13} | {'glibc default':>13} {'ratio':>6} {'':4} | {'fixed mmap':>13} "
              f"{'ratio':>6} {'':4} | dynamic MiB: plan, default, fixed")
    lines = []
    for size in sizes:
        runtime = {name: run_measure("runtime", size, env) for name, env in (("default", None), ("fixed mmap", FIXED_MMAP))}
        print(f"{size}: runtime (imports) {runtime['default']['runtime'] / 2**20:.0f} MiB (fixed mmap "
              f"{runtime['fixed mmap']['runtime'] / 2**20:.0f} MiB), tokenizer +{runtime['default']['tokenizer'] / 2**20:.0f} "
              f"MiB (its load peaks at {runtime['default']['tokenizer_load_hwm'] / 2**20:.0f} MiB, before any model)")
        for check in checks:
            row, dyn = [], []
            for name, env in (("default", None), ("fixed mmap", FIXED_MMAP)):
                m = run_measure(check, size, env)
                s, phase = validation_plans(size, runtime[name], m.get("new_tokens", 0))[check]
                total, dynamic = plan_total(s, phase)
                ratio = m["peak"] / total
                passed = abs(ratio - 1) <= TOLERANCE
                ok[name] &= passed
                row.append(f"{m['peak'] / 2**20:>9.0f} MiB {ratio:6.3f} {'PASS' if passed else 'FAIL'}")
                dyn.append((m["peak"] - (total - dynamic)) / 2**20)
                detail = ", ".join(f"{k} {x / 2**20:.0f} MiB" if isinstance(x, int) and x > 2**20 else f"{k} {x}"
                                   for k, x in m.items() if not isinstance(x, float)) + f", {m['seconds']:.0f} s"
                print(f"  {check:<14} [{name}] {detail}")
            lines.append(f"{size:<5} {check:<14} {total / 2**20:>9.0f} MiB | {row[0]} | {row[1]} | "
                         f"{dynamic / 2**20:.0f}, {dyn[0]:.0f}, {dyn[1]:.0f}")
            print("\n".join("      " + x for x in breakdown_phase(s, phase).splitlines()))
    print("\n" + header + "\n" + "\n".join(lines))
    print(f"\nglibc default: {'all PASS' if ok['default'] else 'some FAIL'}; fixed mmap threshold: "
          f"{'all PASS' if ok['fixed mmap'] else 'some FAIL'} (tolerance {TOLERANCE:.0%})")
    return ok["default"]


def torch_version() -> str:
    """torch and transformers versions."""
    import torch
    import transformers
    return f"{torch.__version__}, transformers {transformers.__version__}"


def breakdown_phase(s: Setup, phase: str) -> str:
    """A validation phase's terms in MiB, one line (update: also the step)."""
    ph = phases(s)
    names = ("update", "step") if phase == "update" else (phase,)
    return "\n".join(f"{n}: " + ", ".join(f"{t.name} {t.bytes / 2**20:.0f}" for t in ph[n] if t.bytes) + " (MiB)"
                     for n in names)


# ---------------------------------------------------------------------------------------------
# 2. Host RAM of start-up: the plan against bench/host_memory.py
# ---------------------------------------------------------------------------------------------
def validate_host() -> bool:
    """bench/host_memory.py (0.5B shapes, FSDP2, 2 processes, reference and rollout copy) against
    host_start_up(where="cpu"), each rank's own measured VmRSS before the model as its runtime."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import host_memory
    measured = host_memory.main([])
    ok = True
    for rank, (peak_gib, base_gib) in sorted(measured.items()):
        plan = host_start_up(MODELS["0.5B"], "fsdp", 2, where="cpu", base=base_gib * GiB)[rank]
        ratio = peak_gib * GiB / plan.bytes
        ok &= abs(ratio - 1) <= TOLERANCE
        print(f"rank {rank}: plan {gb(plan.bytes)} ({plan.formula}), measured {peak_gib:.2f} GB: "
              f"{ratio:.3f} {'PASS' if abs(ratio - 1) <= TOLERANCE else 'FAIL'}")
    return ok


if __name__ == "__main__":  # one measurement, in a process of its own (run_measure)
    print(json.dumps(MEASURES[sys.argv[1]](sys.argv[2])))
