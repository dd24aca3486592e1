"""data/questions.py: question rows from FlashRAG jsonl or Search-R1 parquet, one distinct id per row."""
import json

import pytest

from tools.rehearsal import StandInHub


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


# --- data/download.py against a stand-in hub on 127.0.0.1 (HF_ENDPOINT), the real hf_hub_download --
# (tools/rehearsal.StandInHub, which the rehearsal downloads from too)
def run_download(what, out, endpoint):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(out / ".hf"), HF_HUB_DISABLE_TELEMETRY="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, os.path.join(root, "data", "download.py"), what, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=120)


def test_download_all_from_a_stand_in_hub(tmp_path):
    """Every file in its real layout: the parquet files, the seven benchmarks in their paper splits,
    the corpus gunzipped and the index joined from its parts; a second run fetches nothing; the
    files load; a hub that cannot be reached is an error naming the file and the endpoint."""
    import gzip
    import io

    import pyarrow
    import pyarrow.parquet as pq

    from data import questions

    def parquet(rows):
        sink = io.BytesIO()
        pq.write_table(pyarrow.Table.from_pylist(rows), sink)
        return sink.getvalue()

    train_rows = [{"id": "train_0", "question": "Who?", "golden_answers": ["x"], "data_source": "nq"},
                  {"id": "train_0", "question": "Where?", "golden_answers": ["y"], "data_source": "hotpotqa"}]
    corpus = b'{"id": "0", "contents": "\\"Title\\"\\nText."}\n'
    index = bytes(range(256)) * 3
    files = {("PeterJinGo/nq_hotpotqa_train", "train.parquet"): parquet(train_rows),
             ("PeterJinGo/nq_hotpotqa_train", "test.parquet"): parquet(train_rows[:1]),
             ("PeterJinGo/wiki-18-corpus", "wiki-18.jsonl.gz"): gzip.compress(corpus),
             ("PeterJinGo/wiki-18-e5-index", "part_aa"): index[:500], ("PeterJinGo/wiki-18-e5-index", "part_ab"): index[500:]}
    for name, split in questions.PAPER_SPLIT.items():
        files["RUC-NLPIR/FlashRAG_datasets", f"{name}/{split}.jsonl"] = json.dumps(
            {"id": f"{split}_0", "question": f"{name}?", "golden_answers": ["z"]}).encode() + b"\n"
    hub = StandInHub(files)
    out = tmp_path / "paper"
    done = run_download("all", out, hub.url)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(hub.gets) == sorted(files)  # each file once
    assert (out / "wiki-18.jsonl").read_bytes() == corpus and (out / "e5_Flat.index").read_bytes() == index
    assert not (out / ".download").exists()
    assert [q["id"] for q in questions.load_questions(str(out / "nq_hotpotqa_train" / "train.parquet"))] == [
        "nq/train_0/row1", "hotpotqa/train_0/row2"]
    assert sorted(p.parent.name + "/" + p.name for p in (out / "flashrag").glob("*/*.jsonl")) == sorted(
        f"{n}/{s}.jsonl" for n, s in questions.PAPER_SPLIT.items())
    assert "Next:" in done.stdout and "retriever.py serve --corpus" in done.stdout
    again = run_download("all", out, hub.url)
    assert again.returncode == 0 and len(hub.gets) == len(files) and again.stdout.count("skip ") == len(files) - 1  # the index: one file of two parts
    gone = run_download("train", tmp_path / "elsewhere", "http://127.0.0.1:9")
    assert gone.returncode != 0
    assert "could not fetch train.parquet of the dataset PeterJinGo/nq_hotpotqa_train from http://127.0.0.1:9" in gone.stderr
