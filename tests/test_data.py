"""The committed toy data set (data/toy/): formats, answerability, splits, and reproducibility."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOY = ROOT / "data" / "toy"
FILES = ("corpus.jsonl", "train.jsonl", "test.jsonl")
KINDS = ("single", "bridge", "comparison")


def read_jsonl(name):
    return [json.loads(line) for line in (TOY / name).read_text(encoding="utf-8").split("\n")[:-1]]


@pytest.fixture(scope="module")
def corpus():
    return read_jsonl("corpus.jsonl")


@pytest.fixture(scope="module")
def qa():
    return {split: read_jsonl(f"{split}.jsonl") for split in ("train", "test")}


def test_files_are_newline_terminated_jsonl_and_small():
    for name in FILES:
        data = (TOY / name).read_bytes()
        assert data.endswith(b"\n") and b"\r" not in data and b"\n\n" not in data
    assert (TOY / "corpus.jsonl").stat().st_size < 2_000_000


def test_corpus_ids_and_contents(corpus):
    assert len(corpus) >= 1000
    for i, row in enumerate(corpus):
        assert list(row) == ["id", "contents"]
        assert row["id"] == str(i)
        m = re.fullmatch(r'"([^"\n]+)"\n([^\n]+)', row["contents"])
        assert m, row
        assert 30 <= len(m.group(2).split()) <= 120


def test_qa_rows_are_well_formed(corpus, qa):
    for split, rows in qa.items():
        assert rows
        assert len({r["id"] for r in rows}) == len(rows)
        for r in rows:
            assert list(r) == ["id", "question", "golden_answers", "metadata"]
            assert isinstance(r["id"], str) and r["id"].startswith(split + "_")
            assert isinstance(r["question"], str) and r["question"].strip()
            answers = r["golden_answers"]
            assert isinstance(answers, list) and answers
            assert all(isinstance(a, str) and a.strip() for a in answers)
            assert r["metadata"]["type"] in KINDS
            sup = r["metadata"]["supporting_ids"]
            assert sup and all(isinstance(s, str) and s.isdigit() and int(s) < len(corpus) for s in sup)


def test_all_question_types_present(qa):
    for rows in qa.values():
        counts = {k: sum(r["metadata"]["type"] == k for r in rows) for k in KINDS}
        assert counts["single"] > counts["bridge"] > counts["comparison"] > 0, counts


def test_answers_are_stated_in_supporting_passages(corpus, qa):
    for rows in qa.values():
        for r in rows:
            passages = [corpus[int(s)]["contents"].lower() for s in r["metadata"]["supporting_ids"]]
            answers = [a.lower() for a in r["golden_answers"]]
            if r["metadata"]["type"] == "comparison":
                # the answer is yes/no or one of the two entities the question compares
                assert answers in (["yes"], ["no"]) or answers[0] in r["question"].lower(), r
                assert len(r["metadata"]["supporting_ids"]) == 2
            else:
                assert any(a in p for a in answers for p in passages), r


def test_train_and_test_questions_are_disjoint(qa):
    train = {r["question"] for r in qa["train"]}
    test = {r["question"] for r in qa["test"]}
    assert len(train) == len(qa["train"]) and len(test) == len(qa["test"])
    assert not train & test


def test_script_reproduces_committed_files(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "data" / "make_toy.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=300)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (TOY / name).read_bytes(), name
