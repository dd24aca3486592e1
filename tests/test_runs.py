"""tools/runs.py: precision, and which checkpoint a run folder stands for. Checkpoints, resume and
the log files are exercised whole through train.py (tests/test_train.py)."""
import pytest
import torch

from tools import runs


def test_mixed_precision_auto(tmp_path, monkeypatch):
    amx, plain = tmp_path / "amx", tmp_path / "plain"
    amx.write_text("flags\t\t: fpu avx512f amx_bf16 amx_tile\n")
    plain.write_text("flags\t\t: fpu avx2\n")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # what `accelerate launch` sets by default
    assert runs.resolve_precision("auto", str(amx)) == ("no" if torch.cuda.is_available() else "bf16")
    assert runs.resolve_precision("auto", str(plain)) == "no"
    assert runs.resolve_precision("no", str(amx)) == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # `accelerate launch --mixed_precision bf16`
    assert runs.resolve_precision("auto", str(plain)) == "bf16"
    with pytest.raises(SystemExit, match="--mixed_precision must be auto, no, bf16 or fp16"):
        runs.resolve_precision("half")


def test_mixed_precision_auto_on_cuda(monkeypatch):
    """auto = bf16 on a GPU that supports it (Ampere and later), none on one that does not."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for supported, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: supported)
        assert runs.resolve_precision("auto") == expected
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # the launcher's choice comes first
    assert runs.resolve_precision("auto") == "fp16"


def test_a_run_folder_stands_for_its_newest_checkpoint(tmp_path):
    assert runs.newest_checkpoint(str(tmp_path)) == str(tmp_path)  # nothing saved yet
    for name in ("warm_start", "checkpoint-2", "checkpoint-10", "checkpoint-12.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "trainer_state.json").write_text("{}")
    assert runs.newest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")
    for name in ("checkpoint-2", "checkpoint-10"):
        (tmp_path / name / "config.json").unlink()
    assert runs.newest_checkpoint(str(tmp_path)) == str(tmp_path / "warm_start")
    assert runs.newest_checkpoint(str(tmp_path / "warm_start")) == str(tmp_path / "warm_start")


def test_empty_model_is_a_frame_of_the_right_shapes_never_written():
    """runs.empty_model: every parameter in the dtype asked for and the config's shape, tied
    embeddings tied, the rotary frequencies as a normally built model has them, and the weights
    left unwritten (not an initialised model: two frames of one config need not be equal)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    built, state = LlamaForCausalLM(config), torch.random.get_rng_state()
    frame = runs.empty_model(config, torch.bfloat16)
    assert torch.equal(torch.random.get_rng_state(), state)  # no initialisation drew random numbers
    assert frame.lm_head.weight is frame.model.embed_tokens.weight
    assert {k: (v.shape, v.dtype) for k, v in frame.state_dict().items()} == {
        k: (v.shape, torch.bfloat16) for k, v in built.state_dict().items()}
    assert torch.equal(frame.model.rotary_emb.inv_freq, built.model.rotary_emb.inv_freq)


def test_safetensors_files_say_where_each_rank_can_read_its_shards(tmp_path, tiny_lm_dir):
    """A saved model folder (or a train.py run folder: its newest checkpoint) gives its safetensors
    files; the embedded GGUF default and a LoRA checkpoint give None (loaded the ordinary way)."""
    import os
    import shutil

    assert runs.safetensors_files(tiny_lm_dir) == [os.path.join(tiny_lm_dir, "model.safetensors")]
    run = tmp_path / "run"
    shutil.copytree(tiny_lm_dir, run / "checkpoint-3")
    (run / "checkpoint-3" / "trainer_state.json").write_text("{}")
    assert runs.safetensors_files(str(run)) == [str(run / "checkpoint-3" / "model.safetensors")]
    assert runs.safetensors_files("default") is None and runs.safetensors_files("x.gguf") is None
    (run / "checkpoint-3" / "adapter_config.json").write_text("{}")
    assert runs.safetensors_files(str(run)) is None
