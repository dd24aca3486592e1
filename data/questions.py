"""Question rows for training and evaluation: FlashRAG jsonl or Search-R1 parquet, one id per row.

    from data.questions import load_questions
    questions = load_questions("data/toy/train.jsonl")   # [{"id", "question", "golden_answers", "dataset"[, "metadata"]}, ...]

The id keys a GRPO group (the G rollouts of one row) and evaluation's resume, so it must be unique.
"""
import glob
import json
import os
from collections import Counter

# The split the paper evaluates of each of its seven benchmarks (FlashRAG's folder names): test where
# FlashRAG has one, else dev (as Search-R1's and the release's evaluation scripts take them).
PAPER_SPLIT = {"nq": "test", "triviaqa": "test", "popqa": "test", "hotpotqa": "dev", "2wikimultihopqa": "dev",
               "musique": "dev", "bamboogle": "test"}
SPLITS = {"train", "dev", "test", "val", "validation"}


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


def data_files(paths: list[str]) -> list[str]:
    """The files evaluate.py --data names: files as given; a folder's *.jsonl and *.parquet; FlashRAG's layout
    (a folder of dataset folders, `nq/test.jsonl`, ...) one level down. A dataset folder's split
    files (train/dev/test) are never merged: the paper's split of one of its seven benchmarks is
    taken (`PAPER_SPLIT`), a single split as it is, and several with no rule to choose are an error."""
    files = []
    for path in paths:
        if os.path.isfile(path):
            files.append(path)
        elif not os.path.isdir(path):
            raise ValueError(f"--data not found: {path}")
        elif folder_files(path):
            files += split_of(path)
        else:  # FlashRAG's layout: a folder per dataset
            folders = sorted(d for d in glob.glob(os.path.join(path, "*")) if os.path.isdir(d) and folder_files(d))
            if not folders:
                raise ValueError(f"no *.jsonl or *.parquet file in {path} or its folders")
            files += [f for d in folders for f in split_of(d)]
    return files


def folder_files(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*.jsonl")) + glob.glob(os.path.join(folder, "*.parquet")))


def split_of(folder: str) -> list[str]:
    """A folder's data files, with at most one split file (`split_stem`): its other files come whole."""
    found = folder_files(folder)
    splits = [f for f in found if split_stem(f)]
    if len(splits) <= 1:
        return found
    name, names = os.path.basename(os.path.abspath(folder)), ", ".join(os.path.basename(f) for f in splits)
    wanted = [f for f in splits if split_stem(f) == PAPER_SPLIT.get(name.lower())]
    if not wanted:
        raise ValueError(f"{folder} holds several splits ({names}) and no rule says which to evaluate "
                         f"(the paper's split is known for {', '.join(PAPER_SPLIT)}): name the file in --data")
    return [f for f in found if not split_stem(f)] + wanted


def split_stem(path: str) -> str | None:
    stem = os.path.splitext(os.path.basename(path))[0].lower()
    return stem if stem in SPLITS else None
