"""data/questions.py: question rows from FlashRAG jsonl or Search-R1 parquet, one distinct id per row."""
import json

import pytest


def test_load_questions_gives_every_row_a_distinct_id(tmp_path):
    rows = [{"id": "train_0", "question": "a?", "golden_answers": ["x"], "data_source": "nq"},
            {"id": "train_0", "question": "b?", "golden_answers": ["y"], "data_source": "hotpotqa"},
            {"id": "train_1", "question": "c?", "golden_answers": ["z"], "data_source": "nq"},
            {"question": "d?", "golden_answers": ["w"]}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from data import questions
    ids = [q["id"] for q in questions.load_questions(str(path))]
    assert ids == ["nq/train_0/row1", "hotpotqa/train_0/row2", "train_1", "train/row4"]
    import grpo
    adv = grpo.group_advantages([1.0, 0.0, 0.0, 1.0], [ids[0], ids[0], ids[1], ids[1]])  # two groups, not one
    assert adv.tolist() == pytest.approx([0.7071, -0.7071, -0.7071, 0.7071], abs=1e-4)
