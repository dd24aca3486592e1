"""tools/rehearsal.py: the README's few-GPU sequence, run on CPUs from an empty folder (a stand-in
hub, FSDP2 over two processes, a resume, LoRA, a sharded evaluation of the seven benchmarks), then
docs/reproduce.md's two-machine block (two launchers, each in its own folder, the run folder shared)."""
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


def test_the_two_machine_block_is_read_as_steps_and_pairs():
    steps = rehearsal.machine_steps(rehearsal.two_machine_commands(os.path.join(ROOT, "docs", "reproduce.md")))
    assert [len(step) for step in steps] == [1, 1, 2, 2]  # download (each machine), the server, training, evaluation
    assert steps[1][0].endswith("&") and "--host 0.0.0.0" in steps[1][0]
    for pair in steps[2:]:
        assert "--machine_rank 0" in pair[0] and "--machine_rank 1" in pair[1] and "--num_machines 2" in pair[0]
        assert "--main_process_ip MACHINE0" in pair[0] and "/shared/runs/" in pair[0]
    assert "--use_fsdp --fsdp_version 2" in steps[2][0] and "evaluate.py" in steps[3][0]


def test_the_readme_sequence_runs_on_cpus(tmp_path, capsys):
    rehearsal.rehearse(str(tmp_path / "work"))
    out = capsys.readouterr().out
    # one machine: download, FSDP train, its resume, LoRA, evaluation; two: a download each, train, resume, evaluation
    assert "rehearsal passed" in out and out.count("  ok in ") == 10
    run = tmp_path / "work" / "runs" / "memsearcher-3b"
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and sorted(os.listdir(run / "checkpoint-3")).count("config.json") == 1
    results = json.load(open(tmp_path / "work" / "runs" / "eval" / "memsearcher-3b" / "results.json"))
    assert results["run"]["model"].endswith("memsearcher-3b") and results["config"]["world_size"] == 2
    # two machines: the unshared folder stopped both; then training, its resume and evaluation in the shared folder
    assert "two-machine rehearsal passed" in out and "both machines stopped, naming the folder" in out
    shared = tmp_path / "work" / "shared" / "runs"
    rows = [json.loads(line) for line in open(shared / "memsearcher-7b" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and (shared / "memsearcher-7b" / "checkpoint-3" / "config.json").is_file()
    results = json.load(open(shared / "eval" / "memsearcher-7b" / "results.json"))
    assert results["config"]["world_size"] == 2 and len(results["datasets"]) == 7
    for machine in ("machine0", "machine1"):  # each machine downloaded its own data
        assert (tmp_path / "work" / machine / "data" / "paper" / "e5_Flat.index").is_file()


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


def test_a_broken_two_machine_pair_fails_the_rehearsal_naming_it(tmp_path):
    """Machine 1's training line copied from machine 0's without changing its rank: the rehearsal
    stops before launching anything, with both lines."""
    docs = tmp_path / "reproduce.md"
    text = open(os.path.join(ROOT, "docs", "reproduce.md")).read()
    broken = text.replace("--machine_rank 1", "--machine_rank 0", 1)
    assert broken != text
    docs.write_text(broken)
    with pytest.raises(rehearsal.RehearsalError, match=r"(?s)^two-machine block: a --machine_rank 0 line must be followed by "
                       r"the same line with --machine_rank 1:\n  accelerate launch --num_machines 2 --machine_rank 0 .*train\.py"):
        rehearsal.rehearse_two_machines({"dir": str(tmp_path)}, {}, str(docs))
