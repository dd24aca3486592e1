"""Question rows for training and evaluation: FlashRAG jsonl or Search-R1 parquet, one id per row.

    from data.questions import load_questions
    questions = load_questions("data/toy/train.jsonl")   # [{"id", "question", "golden_answers", "dataset"[, "metadata"]}, ...]

The id keys a GRPO group (the G rollouts of one row) and evaluation's resume, so it must be unique.
"""
import json
import os
from collections import Counter

# The split the paper evaluates of each of its seven benchmarks (FlashRAG's folder names): test where
# FlashRAG has one, else dev (as Search-R1's and the release's evaluation scripts take them).
PAPER_SPLIT = {"nq": "test", "triviaqa": "test", "popqa": "test", "hotpotqa": "dev", "2wikimultihopqa": "dev",
               "musique": "dev", "bamboogle": "test"}


def gold_answers(row: dict):
    """A row's gold answers: FlashRAG's `golden_answers`, else `reward_model.ground_truth`, which is
    {"target": [...]} in Search-R1's parquet and the list itself in the release's converted parquet
    (a string counts as one answer; an array, as pyarrow or numpy may give it, as a list)."""
    golds = row.get("golden_answers")
    if golds is None:
        truth = (row.get("reward_model") or {}).get("ground_truth")
        golds = truth.get("target") if isinstance(truth, dict) else truth
    golds = golds.tolist() if hasattr(golds, "tolist") else golds
    return [golds] if isinstance(golds, str) else golds


def load_questions(path: str) -> list[dict]:
    """Question rows as {"id", "question", "golden_answers", "dataset"} from FlashRAG jsonl
    ({"id", "question", "golden_answers": [...]}) or Search-R1's or the release's parquet (`question`,
    `data_source`, and `golden_answers` or `reward_model.ground_truth`: `gold_answers`). A bad row is an error naming file and row.
    Every row gets a distinct `id`: the file's own where it is unique, else `source/id/row<k>`."""
    dataset = os.path.splitext(os.path.basename(path))[0]
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError("reading parquet needs pyarrow: pip install pyarrow") from None
        rows = [(k + 1, r) for k, r in enumerate(pq.read_table(path).to_pylist())]
    else:
        rows = []
        with open(path, encoding="utf-8") as f:
            for k, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append((k, json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{k}: not valid JSON ({e.msg})") from None
    questions = []
    for k, row in rows:
        golds = gold_answers(row) if isinstance(row, dict) else None
        question = row.get("question") if isinstance(row, dict) else None
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{path}:{k}: missing or empty `question`")
        if not isinstance(golds, (list, tuple)) or not golds or not all(isinstance(g, str) for g in golds):
            raise ValueError(f"{path}:{k}: `golden_answers` must be a non-empty list of strings")
        source = str(row.get("data_source") or dataset)
        given = row.get("id")
        questions.append({"id": None if given is None else str(given), "question": question.strip(),
                          "golden_answers": list(golds), "dataset": source, "row": k})
        if isinstance(row.get("metadata"), dict):  # toy worlds: type, reasoning chain, supporting passage ids
            questions[-1]["metadata"] = row["metadata"]
    seen = Counter(q["id"] for q in questions)
    for q in questions:  # the GRPO group key and evaluation's resume key: unique per row
        if q["id"] is None or seen[q["id"]] > 1:  # e.g. Search-R1's parquet: NQ and HotpotQA both start at train_0
            q["id"] = "/".join(x for x in (q["dataset"], q["id"], f"row{q['row']}") if x)
        del q["row"]
    return questions
