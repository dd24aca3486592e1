"""One-shot check of the GPU path, for one H100/H200 (about 6 minutes; downloads nothing).

    python tools/gpu_check.py --prepare          # here, with network: writes .gpu/ (~17 MB, git-ignored)
    # on the GPU machine, .gpu/ carried beside the repository:
    pip install --no-deps --target /tmp/site .gpu/wheels/*.whl && PYTHONPATH=/tmp/site python tools/gpu_check.py
    python tools/gpu_check.py --device cpu --small   # a dry run of every part at toy sizes (any machine)

`--prepare` saves what the GPU machine may lack: the embedded default's tokenizer as a folder
(its ids for padding and stops; no weights) and the transformers wheel this code needs (5.24, the
oldest it supports, whose other requirements an up-to-date image has). Models are random, built
from their configs on the GPU. Parts, each printed as it ends:

1. versions (torch, CUDA, the GPU, transformers, accelerate, peft);
2. KV-cache parity on CUDA: a random 0.5B-shaped model, float32, greedy: the tokens of the
   cached rollout path (`agent.CachedGenerate`, across a tool response) equal the stateless
   `agent.generate`;
3. rollout probe at the paper's shape: a random Qwen2.5-3B, float32 weights under bf16 autocast (as
   DDP rolls out), R rows of 1,500-token prompts generating 512 tokens: seconds per decode step,
   peak memory beside tools/memory_plan.py's rollout term for the same shape;
4. update probe: one AdamW update of the 3B (float32 master weights, bf16 autocast, gradient
   checkpointing) on m conversations of 3,500 tokens through grpo's loss: time, peak memory beside
   the plan's, finite gradient norm;
5. a LoRA update of the 3B (bf16 base, rank 32): only adapter weights move; peak beside the plan;
6. the test suite's CUDA tests (`MEMSEARCHER_TEST_CUDA=1 pytest -m cuda`);
7. with 2 GPUs or more, the README's few-GPU sequence over NCCL (`tools/rehearsal.py --on_gpus`).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]
PREPARED = os.path.join(ROOT, ".gpu")
TRANSFORMERS_WHEEL = "transformers==5.24.0"

QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
QWEN_3B = dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
               intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=49152, tie_word_embeddings=True)


def prepare():
    """Write .gpu/tokenizer (the embedded default's tokenizer), .gpu/encoder_vocab (the embedded
    encoder's tokenizer files, no weights) and .gpu/wheels (transformers)."""
    from tools import models

    os.makedirs(os.path.join(PREPARED, "wheels"), exist_ok=True)
    folder, name = os.path.split(models.default_model_file())
    models.load_tokenizer(folder, {"gguf_file": name}).save_pretrained(os.path.join(PREPARED, "tokenizer"))
    import shutil

    import retriever
    shutil.copytree(retriever.default_encoder_path(), os.path.join(PREPARED, "encoder_vocab"), dirs_exist_ok=True,
                    ignore=lambda d, names: [n for n in names if n.endswith((".safetensors", ".bin", ".onnx"))])
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d",
                    os.path.join(PREPARED, "wheels"), TRANSFORMERS_WHEEL], check=True)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(PREPARED) for f in fs)
    print(f"{PREPARED}: {size / 2**20:.1f} MiB to carry")


# ---------------------------------------------------------------------------------------------
# 1. helpers: random models, memory, the plan
# ---------------------------------------------------------------------------------------------
def tokenizer():
    from transformers import AutoTokenizer

    from tools import models
    path = os.path.join(PREPARED, "tokenizer")
    if os.path.isdir(path):
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        return tok
    folder, name = os.path.split(models.default_model_file())  # a machine with the embedded default
    return models.load_tokenizer(folder, {"gguf_file": name})


def random_model(dims, tok, device, dtype):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**dims, max_position_embeddings=32768, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def peak_gb(device, reset=False):
    """The GPU's allocated peak in GiB (tensors only: the plan's total without its runtime term)."""
    import torch
    if device != "cuda":
        return float("nan")
    if reset:  # what an earlier probe left is freed first
        import gc
        gc.collect()
        torch.cuda.empty_cache()
    peak = torch.cuda.max_memory_allocated() / 2**30
    if reset:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return peak


def plan_gb(dims, phases, **setup):
    """tools/memory_gpu.py's largest total over `phases` for this shape, in GiB, without its runtime
    term (max_memory_allocated counts tensors only); NaN for the toy sizes of a dry run."""
    import memory_gpu
    name = {id(QWEN_3B): "3B", id(QWEN_05B): "0.5B"}.get(id(dims))
    if name is None:
        return float("nan")
    s = memory_gpu.Setup(dims=memory_gpu.MODELS[name], gpus=1, runtime_bytes=0.0, **setup)
    totals = {k: sum(t.bytes for t in v) for k, v in memory_gpu.phases(s).items()}
    return max(totals[p] for p in phases) / 2**30


def report(name, **figures):
    print(f"== {name}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()),
          flush=True)


def prompt(tok, n, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(len(tok), 40000), (n,), generator=g).tolist()


# ---------------------------------------------------------------------------------------------
# 2. the checks
# ---------------------------------------------------------------------------------------------
def versions(device):
    import accelerate
    import torch
    import transformers
    try:
        import peft
        peft_version = peft.__version__
    except ImportError:
        peft_version = "not installed"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none"
    report("versions", torch=torch.__version__, cuda=torch.version.cuda, gpu=gpu, transformers=transformers.__version__,
           accelerate=accelerate.__version__, peft=peft_version)


def kv_parity(device, tok, dims):
    """Greedy tokens of CachedGenerate (a fresh batch, then a continuation after a tool response)
    equal the stateless generate's, in float32."""
    import torch

    import agent
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_model(dims, tok, device, torch.float32)
    prompts = [prompt(tok, n, s) for s, n in enumerate((40, 57, 33, 61))]
    system = prompt(tok, 30, 99)
    prompts = [system + p for p in prompts]  # a shared prefix, as the system prompt is
    cached, kw = agent.CachedGenerate(), dict(max_new_tokens=24, greedy=True)
    first = cached(model, tok, prompts, **kw)
    follow = [p + o.ids + prompt(tok, 7 + 5 * k, 50 + k) for k, (p, o) in enumerate(zip(prompts, first))]
    second = cached(model, tok, follow, **kw)
    same = [a.ids == b.ids for a, b in zip(first + second, agent.generate(model, tok, prompts, **kw)
                                                            + agent.generate(model, tok, follow, **kw))]
    report("kv-cache parity (float32, greedy)", rows=len(same), equal=sum(same), ok=all(same))
    del model
    return all(same)


def rollout_probe(device, tok, dims, rows, prompt_tokens, new_tokens):
    """Rows of `prompt_tokens`, each generating `new_tokens` (a random model rarely stops early)."""
    import torch

    import agent
    model = random_model(dims, tok, device, torch.float32)
    prompts = [prompt(tok, prompt_tokens, s) for s in range(rows)]
    peak_gb(device, reset=True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        agent.generate(model, tok, prompts[:1], max_new_tokens=2)  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        out = agent.generate(model, tok, prompts, max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, top_k=0)
        if device == "cuda":
            torch.cuda.synchronize()
    seconds, made = time.time() - t0, max(len(o.ids) for o in out)
    plan = plan_gb(dims, ["rollout"], strategy="ddp", rollout_batch_size=rows, batch_size=rows, group_size=1,
                   context_tokens=prompt_tokens + new_tokens, prefill_tokens=prompt_tokens, reference=False, optimizer=False)
    report("rollout probe", rows=rows, prompt_tokens=prompt_tokens, new_tokens=made, seconds=seconds,
           seconds_per_decode_step=seconds / max(made, 1), peak_gb=peak_gb(device), plan_gb=plan)
    del model


def conversations(tok, m, tokens, seed=0):
    import agent
    out = []
    for k in range(m):
        c = agent.Conversation(prompt_ids=prompt(tok, tokens // 3, seed + k))
        c.append(prompt(tok, tokens - tokens // 3, seed + 100 + k), trained=True)
        c.old_logprobs = c.ref_logprobs = [-10.0] * len(c.response_ids)
        c.advantage = 1.0 if k % 2 else -1.0
        out.append(c)
    return out


def update_probe(device, tok, dims, m, tokens, lora_rank=0):
    """One update: float32 master weights (or a bf16 base with LoRA), bf16 autocast on CUDA,
    gradient checkpointing, grpo's loss over m conversations of `tokens`; returns whether only
    the trained weights moved and the norm is finite."""
    import torch

    import grpo
    from tools import models
    model = random_model(dims, tok, device, torch.bfloat16 if lora_rank and device == "cuda" else torch.float32)
    enable = getattr(model, "activation_checkpointing_enable", None)  # newer transformers; the old name warns
    if enable:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_rank:
        model = models.add_adapter(model, lora_rank, 2 * lora_rank, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    frozen = {k: v.detach().clone() for k, v in model.named_parameters() if not v.requires_grad}
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-6)
    batch = conversations(tok, m, tokens)
    model.train()
    peak_gb(device, reset=True)
    t0 = time.time()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        (logprobs, entropy), f = grpo.micro_logprobs(model, batch, tok.pad_token_id, device,
                                                     ("loss_mask", "old_logprobs", "ref_logprobs", "advantage"), 1.0, True)
        loss, _ = grpo.policy_loss(logprobs, f["old_logprobs"], f["advantage"], f["loss_mask"], f["ref_logprobs"],
                                   entropy=entropy.detach(), num_tokens=f["loss_mask"].sum())
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(trained, 1.0))
    optimizer.step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.time() - t0
    kept = all(torch.equal(v, dict(model.named_parameters())[k]) for k, v in frozen.items())
    plan = plan_gb(dims, ["update", "step"], strategy="lora" if lora_rank else "ddp", micro_batch_size=m, tokens=tokens,
                   response_tokens=tokens - tokens // 3 + 1, reference=False, lora_rank=lora_rank or 32)
    report("LoRA update probe" if lora_rank else "update probe", conversations=m, tokens=tokens, seconds=seconds,
           grad_norm=norm, finite=math.isfinite(norm), frozen_unchanged=kept, peak_gb=peak_gb(device), plan_gb=plan)
    del model, optimizer
    return math.isfinite(norm) and kept


def cuda_tests(device):
    env = dict(os.environ, MEMSEARCHER_TEST_CUDA="1", MEMSEARCHER_TEST_TOKENIZER=os.path.join(PREPARED, "tokenizer"),
               PYTHONPATH=os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    ran = proc.returncode == 0 and (device != "cuda" or ("passed" in summary and "skipped" not in summary))
    report("CUDA-marked tests", summary=summary, ok=ran)
    return ran


def rehearsal(device):
    """Two GPUs or more: tools/rehearsal.py --on_gpus, the README's sequence over NCCL."""
    import torch
    if device != "cuda" or torch.cuda.device_count() < 2:
        report("multi-GPU rehearsal", skipped=f"{torch.cuda.device_count() if device == 'cuda' else 0} GPU(s): needs 2")
        return True
    env = dict(os.environ, MEMSEARCHER_TEST_TOKENIZER=os.path.join(PREPARED, "tokenizer"),
               MEMSEARCHER_TEST_ENCODER_VOCAB=os.path.join(PREPARED, "encoder_vocab"))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "rehearsal.py"), "--on_gpus"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    report("multi-GPU rehearsal", ok=proc.returncode == 0)
    return proc.returncode == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="write .gpu/ (tokenizer, transformers wheel) and stop")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="toy sizes (a dry run on any machine)")
    ap.add_argument("--rollout_batch_size", type=int, default=64, help="rows of the rollout probe (the paper preset's R)")
    ap.add_argument("--micro_batch_size", type=int, default=4, help="conversations of the update probe (paper preset: 4)")
    ap.add_argument("--skip_tests", action="store_true")
    args = ap.parse_args()
    if args.prepare:
        return prepare()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device visible (use --device cpu --small for a dry run)")
    t0, tok, device = time.time(), tokenizer(), args.device
    big, small = (TINY, TINY) if args.small else (QWEN_3B, QWEN_05B)
    rows = 5 * max(1, args.rollout_batch_size // 5)  # G x (R // G) rows per call, as train.rollout_in_chunks makes them
    rows, prompt_tokens, new_tokens, tokens = (4, 64, 16, 96) if args.small else (rows, 1500, 512, 3500)
    results = {}
    versions(device)
    results["kv_parity"] = kv_parity(device, tok, small)
    rollout_probe(device, tok, big, rows, prompt_tokens, new_tokens)
    results["update"] = update_probe(device, tok, big, 2 if args.small else args.micro_batch_size, tokens)
    if importlib_has("peft"):
        results["lora"] = update_probe(device, tok, big, 2 if args.small else args.micro_batch_size, tokens, lora_rank=32)
    if not args.skip_tests:
        results["cuda_tests"] = cuda_tests(device)
    results["rehearsal"] = rehearsal(device)
    print(json.dumps({"ok": all(results.values()), **results, "seconds": round(time.time() - t0, 1)}))
    return 0 if all(results.values()) else 1


def importlib_has(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    sys.exit(main())
