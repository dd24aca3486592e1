"""tools/runs.py: precision. Checkpoints, resume, the log files and sharded passes are exercised
whole through train.py (tests/test_train.py), the prediction files through evaluate.py
(tests/test_evaluate.py)."""
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
