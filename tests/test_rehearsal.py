"""tools/rehearsal.py: the README's few-GPU sequence, run on CPUs from an empty folder (a stand-in
hub, FSDP2 over two processes, a resume, LoRA, a sharded evaluation of the seven benchmarks)."""
import json
import os
import shutil

import pytest

from tools import rehearsal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_readme_block_is_read_as_its_commands():
    commands = rehearsal.readme_commands(os.path.join(ROOT, "README.md"))
    scripts = [next(w for w in c.split() if w.endswith(".py")) for c in commands]
    assert scripts == ["data/download.py", "retriever.py", "train.py", "train.py", "evaluate.py"]
    assert commands[1].endswith("&") and "--use_fsdp --fsdp_version 2" in commands[2] and "--lora_rank" in commands[3]
    assert all("#" not in c and "\\" not in c for c in commands)


def test_the_readme_sequence_runs_on_cpus(tmp_path, capsys):
    rehearsal.rehearse(str(tmp_path / "work"))
    out = capsys.readouterr().out
    assert "rehearsal passed" in out and out.count("  ok in ") == 5  # download, FSDP train, its resume, LoRA, evaluation
    run = tmp_path / "work" / "runs" / "memsearcher-3b"
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and sorted(os.listdir(run / "checkpoint-3")).count("config.json") == 1
    results = json.load(open(tmp_path / "work" / "runs" / "eval" / "memsearcher-3b" / "results.json"))
    assert results["run"]["model"].endswith("memsearcher-3b") and results["config"]["world_size"] == 2


def test_a_broken_readme_command_fails_the_rehearsal_naming_it(tmp_path):
    """A path the README gets wrong (here the FSDP command's --train_data) stops the rehearsal with
    that command line and train.py's own error."""
    readme = tmp_path / "README.md"
    text = open(os.path.join(ROOT, "README.md")).read()
    broken = text.replace("nq_hotpotqa_train/train.parquet", "nq_hotpotqa_train.parquet", 1)
    assert broken != text
    readme.write_text(broken)
    with pytest.raises(rehearsal.RehearsalError, match=r"(?s)^training failed \(exit 1\):\n  .*--use_fsdp.*"
                       r"--train_data not found: \S*/data/paper/nq_hotpotqa_train\.parquet"):
        rehearsal.rehearse(str(tmp_path / "work"), str(readme))
    shutil.rmtree(tmp_path / "work", ignore_errors=True)
