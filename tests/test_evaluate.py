"""evaluate.py: metrics by hand, both input formats, a tiny model's run and its outputs, aggregation
by hand with a scripted policy, resume, and two processes (torchrun, gloo) giving one's results."""
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import types

import pytest
import torch

import agent
import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD_FIELDS = {"dataset", "id", "index", "question", "golden_answers", "prediction", "em", "f1", "acc", "reward",
                 "end_reason", "num_turns", "num_searches", "context_tokens", "memory", "turns", "seconds",
                 "peak_memory_bytes", "run", "evidence"}
METRIC_FIELDS = {"n", "em", "f1", "acc", "turns", "searches", "context_tokens_mean", "context_tokens_max",
                 "context_tokens_per_turn", "peak_context_tokens", "total_context_tokens", "seconds_per_question",
                 "peak_memory_gb", "end_reasons", "format_valid", "interval", "evidence_recall"}
TIMING = {"seconds", "peak_memory_bytes", "seconds_per_question", "peak_memory_gb"}

# Two small datasets; per question: (searches before answering, the boxed answer)
ALPHA = [("Where was Velmora Quint born?", ["Osk", "Osk town"], 0, "The osk!"),  # EM 1, F1 1, acc 1
         ("When was Mount Norve first climbed?", ["1825"], 2, "in 1825")]  # EM 0, F1 2/3, acc 1
BETA = [("Is Osk a town?", ["yes"], 1, "no"),  # 0, 0, 0
        ("Is Osk a city?", ["no"], 0, "yes, it is no"),  # EM 0, F1 0 (yes/no rule), acc 1
        ("Who founded Osk?", ["Ana Vell", "Vell Ana"], 1, "Vell")]  # EM 0, F1 2/3, acc 0
PLAN = {q: (n, answer) for q, _, n, answer in ALPHA + BETA}
CALL = '</think>\n<tool_call>{"name": "wikipedia_search", "arguments": {"query": "%s"}}</tool_call>'


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qa")
    for name, rows in (("alpha", ALPHA), ("beta", BETA)):
        write_jsonl(folder / f"{name}.jsonl", [{"id": f"{name}{k}", "question": q, "golden_answers": g}
                                              for k, (q, g, _, _) in enumerate(rows)])
    return str(folder)


def scripted(seen=None):
    """A generate_fn that follows PLAN: search n times (memory counts them), then answer.
    Records each question's first prompt in `seen`."""
    def generate_fn(model, tokenizer, prompts, **sampling):
        outs = []
        for p in prompts:
            text = tokenizer.decode(p)
            question = re.search(r"<question> (.*?) </question>", text, re.S).group(1)
            memory = re.findall(r"<memory> searched (\d+) </memory>", text)
            done = text.count("</tool_response>") + int(memory[-1] if memory else 0)
            searches, answer = PLAN[question]
            if agent.MEMORY_INSTRUCTION in text.rsplit("<|im_start|>user", 1)[-1]:
                out = f"<memory>searched {done}</memory>"
            elif done < searches:
                out = CALL % question
            else:
                out = "</think>\n\\boxed{%s}" % answer
            if seen is not None and done == 0 and text.endswith("<think>"):
                seen.append(question)
            ids = agent.encode(tokenizer, out) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
            outs.append(agent.Generation(ids=ids, logprobs=[0.0] * len(ids), finished=True))
        return outs
    return generate_fn


def args_for(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, *extra):
    return ["--model", tiny_lm_dir, "--corpus", small_corpus, "--encoder", tiny_encoder_dir,
            "--output_dir", str(out), "--max_new_tokens", "8", *map(str, extra)]


def without_timing(d):
    if isinstance(d, dict):
        return {k: without_timing(v) for k, v in d.items() if k not in TIMING}
    return d


# --- metrics -------------------------------------------------------------------------------------
def test_metrics_by_hand():
    assert evaluate.cover_match("It was the Osk town, I think.", ["Osk"]) == 1.0  # normalised, contained
    assert evaluate.cover_match("Oskar", ["osk"]) == 1.0  # a substring, as in cover EM
    assert evaluate.cover_match("Lund", ["Osk", "Lund"]) == 1.0  # any of several golds
    assert evaluate.cover_match("Osk", ["Osk town"]) == 0.0 and evaluate.cover_match(None, ["Osk"]) == 0.0
    assert evaluate.cover_match("the", ["The"]) == 0.0  # a gold that normalises to nothing never matches
    assert evaluate.cover_match("yes, it is no", ["no"]) == 1.0
    assert agent.exact_match("  The OSK! ", ["osk"]) == 1.0 and agent.exact_match("Osk town", ["Osk"]) == 0.0
    assert agent.f1_score("yes, it is no", ["no"]) == 0.0 and agent.f1_score("No.", ["no"]) == 1.0
    assert agent.f1_score("in 1825", ["1999", "1825"]) == pytest.approx(2 / 3)


# --- data ----------------------------------------------------------------------------------------
def test_jsonl_files_folders_split_names_order_and_limit(tmp_path):
    rows = lambda n: [{"id": str(k), "question": f"Q{k}?", "golden_answers": ["a"]} for k in range(n)]  # noqa: E731
    write_jsonl(tmp_path / "flat" / "bamboogle.jsonl", rows(3))
    write_jsonl(tmp_path / "flat" / "mine.jsonl", rows(2))
    write_jsonl(tmp_path / "flat" / "nq.jsonl", rows(30))
    hotpot = write_jsonl(tmp_path / "hotpotqa" / "dev.jsonl", rows(4))  # FlashRAG layout: the folder names it
    data = evaluate.load_datasets([str(tmp_path / "flat"), hotpot])
    assert list(data) == ["nq", "hotpotqa", "bamboogle", "mine"]  # the paper's order, then others
    assert [q["index"] for q in data["nq"]] == list(range(30)) and data["hotpotqa"][0]["dataset"] == "hotpotqa"
    small, large = (evaluate.load_datasets([str(tmp_path / "flat")], limit=n, seed=0)["nq"] for n in (5, 10))
    assert len(small) == 5 and [q["index"] for q in small] == sorted(q["index"] for q in small)
    assert {q["id"] for q in small} < {q["id"] for q in large}  # raising --limit keeps the earlier picks
    assert small == evaluate.load_datasets([str(tmp_path / "flat")], limit=5, seed=0)["nq"]
    assert small != evaluate.load_datasets([str(tmp_path / "flat")], limit=5, seed=1)["nq"]


def test_parquet_rows_split_by_data_source(monkeypatch, tmp_path):
    rows = [{"id": "test_0", "question": "Q0?", "golden_answers": ["a"], "data_source": "nq"},
            {"question": "Q1?", "data_source": "triviaqa", "reward_model": {"ground_truth": {"target": ["b"]}}},
            {"id": "test_0", "question": "Q2?", "golden_answers": ["c"], "data_source": "nq"}]
    table = types.SimpleNamespace(to_pylist=lambda: rows)
    parquet = types.SimpleNamespace(read_table=lambda path: table)  # pyarrow is optional: a stand-in
    monkeypatch.setitem(sys.modules, "pyarrow", types.SimpleNamespace(parquet=parquet))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", parquet)
    (tmp_path / "test.parquet").write_bytes(b"")
    data = evaluate.load_datasets([str(tmp_path / "test.parquet")])  # a repeated id is made unique per row
    assert {n: [(q["id"], q["golden_answers"]) for q in qs] for n, qs in data.items()} == {
        "nq": [("nq/test_0/row1", ["a"]), ("nq/test_0/row3", ["c"])], "triviaqa": [("triviaqa/row2", ["b"])]}
    rows[2]["id"] = "test_2"
    data = evaluate.load_datasets([str(tmp_path)])
    assert {n: [(q["id"], q["golden_answers"]) for q in qs] for n, qs in data.items()} == {
        "nq": [("test_0", ["a"]), ("test_2", ["c"])], "triviaqa": [("triviaqa/row2", ["b"])]}
    (tmp_path / "more").mkdir()  # the same dataset in two files: an id in both is an error
    (tmp_path / "more" / "nq.jsonl").write_text(json.dumps({"id": "test_0", "question": "Q?", "golden_answers": ["a"]}) + "\n")
    with pytest.raises(SystemExit, match="dataset nq: duplicate id 'test_0'"):
        evaluate.load_datasets([str(tmp_path / "test.parquet"), str(tmp_path / "more" / "nq.jsonl")])


def test_search_r1_parquet_file(tmp_path):
    import pyarrow
    import pyarrow.parquet as pq

    rows = [{"id": "test_0", "question": "Q0?", "golden_answers": ["a", "A"], "data_source": "musique"},
            {"id": "test_0", "question": "Q1?", "golden_answers": ["b"], "data_source": "bamboogle"}]
    pq.write_table(pyarrow.Table.from_pylist(rows), tmp_path / "test.parquet")
    data = evaluate.load_datasets([str(tmp_path / "test.parquet")])
    assert {n: [(q["question"], q["golden_answers"]) for q in qs] for n, qs in data.items()} == {
        "musique": [("Q0?", ["a", "A"])], "bamboogle": [("Q1?", ["b"])]}


def flashrag_layout(root, splits):
    """FlashRAG's folders: {dataset: [split, ...]}, each split a jsonl file of two rows."""
    for name, names in splits.items():
        (root / name).mkdir(parents=True)
        for split in names:
            rows = [{"id": f"{split}_{k}", "question": f"{name} {split} {k}?", "golden_answers": ["x"]} for k in range(2)]
            (root / name / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_flashrag_layout_takes_each_benchmarks_paper_split(tmp_path):
    """A folder of FlashRAG dataset folders: test for NQ and Bamboogle, dev for HotpotQA (the paper's
    splits), never train; a dataset folder given alone likewise; several splits of a dataset the
    paper does not name are an error that names them, never a merge."""
    flashrag_layout(tmp_path / "flashrag", {"nq": ["train", "dev", "test"], "hotpotqa": ["train", "dev"],
                                            "bamboogle": ["test"]})
    data = evaluate.load_datasets([str(tmp_path / "flashrag")])
    assert {n: sorted({q["question"].split()[1] for q in qs}) for n, qs in data.items()} == {
        "nq": ["test"], "hotpotqa": ["dev"], "bamboogle": ["test"]}
    assert list(data) == ["nq", "hotpotqa", "bamboogle"]  # the paper's column order
    nq = evaluate.load_datasets([str(tmp_path / "flashrag" / "nq")])
    assert list(nq) == ["nq"] and [q["id"] for q in nq["nq"]] == ["test_0", "test_1"]
    flashrag_layout(tmp_path / "mine", {"mydata": ["train", "dev"]})
    with pytest.raises(SystemExit, match=r"several splits \(dev.jsonl, train.jsonl\)"):
        evaluate.load_datasets([str(tmp_path / "mine")])
    with pytest.raises(SystemExit, match="no rule says which"):
        evaluate.load_datasets([str(tmp_path / "mine" / "mydata")])
    assert list(evaluate.load_datasets([str(tmp_path / "mine" / "mydata" / "dev.jsonl")])) == ["mydata"]


def test_the_releases_parquet_with_ground_truth_as_a_list(tmp_path):
    """The release's converted parquet: `reward_model.ground_truth` is the list of answers itself
    (Search-R1's is {"target": [...]}); both load, through pyarrow."""
    import pyarrow
    import pyarrow.parquet as pq

    rows = [{"id": "a", "question": "Q0?", "data_source": "nq", "reward_model": {"ground_truth": ["a", "b"], "style": "rule"}},
            {"id": "b", "question": "Q1?", "data_source": "nq", "reward_model": {"ground_truth": {"target": ["c"]}, "style": "rule"}}]
    for k, row in enumerate(rows):  # one file each: the two layouts never share a file
        pq.write_table(pyarrow.Table.from_pylist([row]), tmp_path / f"part{k}.parquet")
    data = evaluate.load_datasets([str(tmp_path / "part0.parquet"), str(tmp_path / "part1.parquet")])
    assert [q["golden_answers"] for q in data["nq"]] == [["a", "b"], ["c"]]


def test_parquet_needs_pyarrow_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed: importing it fails
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "test.parquet").write_bytes(b"")
    with pytest.raises(SystemExit, match="pip install pyarrow"):
        evaluate.load_datasets([str(tmp_path / "test.parquet")])


@pytest.mark.parametrize("line, message", [
    ('{"id": "2", "question": "Q?"}', "bad.jsonl:2: `golden_answers`"),
    ('{"id": "2", "golden_answers": ["a"]}', "bad.jsonl:2: missing or empty `question`"),
    ('{"id": "2", "question": "Q?", "golden', "bad.jsonl:2: not valid JSON")])
def test_bad_rows_name_file_and_line(tmp_path, line, message):
    good = json.dumps({"id": "1", "question": "Q?", "golden_answers": ["a"]})
    (tmp_path / "bad.jsonl").write_text(f"{good}\n{line}\n{good}\n")
    with pytest.raises(SystemExit, match=re.escape(message)):
        evaluate.main(["--data", str(tmp_path / "bad.jsonl"), "--output_dir", str(tmp_path / "out")])
    assert not os.path.exists(tmp_path / "out")  # failed before anything was loaded or written


# --- a run on a tiny random model: every output and field ----------------------------------------
def test_tiny_model_run_writes_all_outputs(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path):
    out = tmp_path / "run"
    results = evaluate.main(args_for(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, "--limit", 3, "--batch_size", 2))
    plot = ["context_tokens_per_turn.png"] if importlib.util.find_spec("matplotlib") else []
    assert sorted(os.listdir(out)) == sorted(["predictions.jsonl", "results.json", "results.md", "report.html"] + plot)
    assert open(out / "report.html").read().count('<article class="card') == 3  # tools/report.py: a card per question
    records = read_jsonl(out / "predictions.jsonl")
    assert len(records) == 3 and all(set(r) == RECORD_FIELDS for r in records)
    assert [r["dataset"] for r in records] == ["toy"] * 3 and [r["index"] for r in records] == sorted(r["index"] for r in records)
    for r in records:
        assert r["num_turns"] == len(r["turns"]) == len(r["context_tokens"]) >= 1
        assert r["turns"][0]["context"].startswith("<|im_start|>system") and "generation" in r["turns"][0]
        assert r["run"]["agent"] == "memsearcher" and r["seconds"] > 0 and r["peak_memory_bytes"] > 0
    saved = json.load(open(out / "results.json"))
    assert saved == json.loads(json.dumps(results)) and set(saved) == {"run", "config", "datasets", "average"}
    assert list(saved["datasets"]) == ["toy"] and set(saved["datasets"]["toy"]) == METRIC_FIELDS == set(saved["average"])
    assert saved["config"]["max_turns"] == 20 and saved["config"]["memory_kind"] == "cpu_peak_rss"
    table = open(out / "results.md").read()
    assert "| Method | Metric | toy | Avg |" in table and "| MemSearcher (tiny-llama) | EM |" in table


# --- aggregation by hand (scripted policy), both agents, --compare --------------------------------
def test_scripted_metrics_by_hand_and_compare(tiny_lm_dir, small_corpus, tiny_encoder_dir, two_datasets, tmp_path, capsys):
    runs = {}
    for name in ("memsearcher", "react"):
        argv = args_for(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path / name, "--data", two_datasets, "--agent", name)
        runs[name] = evaluate.main(argv, generate_fn=scripted())
    res = runs["memsearcher"]
    alpha, beta, avg = res["datasets"]["alpha"], res["datasets"]["beta"], res["average"]
    assert (alpha["n"], alpha["em"], alpha["f1"], alpha["acc"]) == (2, 0.5, pytest.approx(5 / 6), 1.0)
    assert (beta["n"], beta["em"], beta["f1"], beta["acc"]) == (3, 0.0, pytest.approx(2 / 9), pytest.approx(1 / 3))
    assert (alpha["turns"], alpha["searches"]) == (2.0, 1.0)
    assert (beta["turns"], beta["searches"]) == (pytest.approx(5 / 3), pytest.approx(2 / 3))
    assert (avg["n"], avg["em"], avg["f1"], avg["acc"]) == (5, 0.25, pytest.approx((5 / 6 + 2 / 9) / 2), pytest.approx(2 / 3))
    assert avg["context_tokens_per_turn"]["n"] == [5, 3, 1] and avg["end_reasons"] == {"answer": 5}
    records = read_jsonl(tmp_path / "memsearcher" / "predictions.jsonl")
    assert [r["id"] for r in records] == ["alpha0", "alpha1", "beta0", "beta1", "beta2"]
    second = [r["context_tokens"][1] for r in records if r["num_turns"] > 1]
    assert avg["context_tokens_per_turn"]["mean"][1] == pytest.approx(sum(second) / 3)
    assert avg["context_tokens_per_turn"]["max"][1] == max(second)
    assert records[1]["turns"][0]["queries"] == [ALPHA[1][0]] and records[1]["turns"][0]["memory"] == "searched 1"
    documents = records[1]["turns"][0]["documents"][0]  # the release's form by default: raw contents, literal "\\n\\n"
    assert documents.startswith('"') and documents.endswith("\\n\\n") and "Doc 1(Title:" not in documents
    mem, react = (runs[n]["average"]["context_tokens_per_turn"]["mean"] for n in ("memsearcher", "react"))
    assert react[2] > react[1] > react[0] and mem[2] < react[2]  # ReAct's context grows, MemSearcher's does not
    assert without_timing(runs["react"]["datasets"])["alpha"]["em"] == 0.5
    capsys.readouterr()
    evaluate.main(["--compare", str(tmp_path / "memsearcher" / "results.json"), str(tmp_path / "react" / "results.json"),
                   "--output_dir", str(tmp_path / "compared")])  # a folder not there yet
    printed = capsys.readouterr().out
    assert (tmp_path / "compared" / "context_tokens_compare.png").is_file() or "matplotlib" in printed
    alpha = "0.500 [{:.3f}, {:.3f}]".format(*evaluate.bootstrap_interval([1.0, 0.0]))  # with its 95% interval
    assert f"| MemSearcher (tiny-llama) [memsearcher] | EM | {alpha} | 0.000 [0.000, 0.000] | 0.250 |" in printed
    assert f"| ReAct (tiny-llama) [react] | EM | {alpha} | 0.000 [0.000, 0.000] | 0.250 |" in printed and "turn 3" in printed
    assert ("Paired difference, ReAct (tiny-llama) [react] minus MemSearcher (tiny-llama) [memsearcher], over the 5 "
            "questions both answered") in printed


def test_a_react_checkpoint_is_evaluated_as_react_unless_told(tiny_lm_dir, small_corpus, tiny_encoder_dir, two_datasets,
                                                               tmp_path, capsys):
    """--agent defaults to what the train.py checkpoint was trained as (its trainer_state.json);
    given the other one, it is used and the mismatch is said."""
    import json
    import shutil

    checkpoint = tmp_path / "react_run" / "checkpoint-2"
    shutil.copytree(tiny_lm_dir, checkpoint)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"step": 2, "args": {"agent": "react"}}))
    common = ["--corpus", small_corpus, "--encoder", tiny_encoder_dir, "--max_new_tokens", "8", "--data", two_datasets, "--limit", "1"]
    got = evaluate.main(["--model", str(tmp_path / "react_run"), "--output_dir", str(tmp_path / "a"), *common], generate_fn=scripted())
    assert got["run"]["agent"] == "react"
    record = read_jsonl(tmp_path / "a" / "predictions.jsonl")[0]
    assert "<memory>" not in record["turns"][0]["context"]  # ReAct's prompt
    got = evaluate.main(["--model", str(checkpoint), "--agent", "memsearcher", "--output_dir", str(tmp_path / "b"), *common],
                        generate_fn=scripted())
    assert got["run"]["agent"] == "memsearcher" and "was trained as react, evaluated here as --agent memsearcher" in capsys.readouterr().out


def test_paired_difference_by_hand():
    """B - A on the questions both runs answered; question "z" is only in B and does not count."""
    a = [{"dataset": "x", "id": "1", "em": 0.0, "f1": 0.5, "acc": 1.0}, {"dataset": "x", "id": "2", "em": 1.0, "f1": 1.0, "acc": 1.0},
         {"dataset": "y", "id": "1", "em": 0.0, "f1": 0.0, "acc": 1.0}]
    b = [{"dataset": "y", "id": "1", "em": 1.0, "f1": 1.0, "acc": 1.0}, {"dataset": "x", "id": "1", "em": 1.0, "f1": 1.0, "acc": 1.0},
         {"dataset": "x", "id": "2", "em": 1.0, "f1": 0.5, "acc": 1.0}, {"dataset": "x", "id": "z", "em": 1.0, "f1": 1.0, "acc": 1.0}]
    diff = evaluate.paired_difference(a, b)
    assert diff["n"] == 3
    assert diff["em"] == (pytest.approx(2 / 3), evaluate.bootstrap_interval([1.0, 1.0, 0.0]))  # in b's order
    assert diff["f1"][0] == pytest.approx((1.0 + 0.5 - 0.5) / 3) and diff["acc"][0] == 0.0
    assert diff["acc"][1] == [0.0, 0.0]


# --- resume ----------------------------------------------------------------------------------------
def test_resume_skips_finished_questions(tiny_lm_dir, small_corpus, tiny_encoder_dir, two_datasets, tmp_path, capsys):
    argv = lambda out, *extra: args_for(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, "--data", two_datasets,  # noqa: E731
                                        "--batch_size", 2, *extra)
    full = evaluate.main(argv(tmp_path / "full"), generate_fn=scripted())
    lines = open(tmp_path / "full" / "predictions.jsonl").read().splitlines(keepends=True)
    (tmp_path / "cut").mkdir()  # as left by a crash: two chunks written, the third half-written
    (tmp_path / "cut" / "predictions.rank0-0000.jsonl").write_text("".join(lines[:2]) + lines[2][:40])
    seen = []
    resumed = evaluate.main(argv(tmp_path / "cut"), generate_fn=scripted(seen))
    assert sorted(seen) == sorted(q for q, *_ in BETA)  # only the unfinished questions were rolled out
    assert "truncated last line ignored" in capsys.readouterr().out
    assert without_timing(resumed["datasets"]) == without_timing(full["datasets"])
    assert os.listdir(tmp_path / "cut").count("predictions.jsonl") == 1
    assert not [p for p in os.listdir(tmp_path / "cut") if p.startswith("predictions.rank")]
    again = []
    evaluate.main(argv(tmp_path / "cut"), generate_fn=scripted(again))
    assert again == [] and len(read_jsonl(tmp_path / "cut" / "predictions.jsonl")) == 5
    with pytest.raises(SystemExit, match="holds predictions of another run"):
        evaluate.main(argv(tmp_path / "cut", "--agent", "react"), generate_fn=scripted())
    with pytest.raises(SystemExit, match="holds predictions of another run"):  # other weights' precision
        evaluate.main(argv(tmp_path / "cut", "--dtype", "bfloat16"), generate_fn=scripted())


def test_dtype_reaches_the_model_and_the_record(tiny_lm_dir, small_corpus, tiny_encoder_dir, two_datasets, tmp_path):
    seen = []

    def generate_fn(model, tokenizer, prompts, **sampling):
        seen.append(next(model.parameters()).dtype)
        return scripted()(model, tokenizer, prompts, **sampling)

    for dtype, expected in (("auto", torch.float32), ("bfloat16", torch.bfloat16)):  # auto on CPU: float32
        seen.clear()
        out = tmp_path / dtype
        results = evaluate.main(args_for(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, "--data", two_datasets,
                                         "--dtype", dtype), generate_fn=generate_fn)
        assert set(seen) == {expected}
        assert results["run"]["dtype"] == str(expected).split(".")[1]
        assert {r["run"]["dtype"] for r in read_jsonl(out / "predictions.jsonl")} == {results["run"]["dtype"]}
        assert results["average"]["em"] == 0.25  # the scripted answers score the same either way


# --- two processes (torchrun, gloo) give one process's results; resume works sharded -------------
def launch(nproc, argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           os.path.join(ROOT, "evaluate.py"), *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_two_processes_equal_one_and_resume_sharded(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path):
    argv = lambda out: args_for(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, "--limit", 5, "--batch_size", 2)  # noqa: E731
    launch(1, argv(tmp_path / "one"))
    launch(2, argv(tmp_path / "two"))
    one, two = (read_jsonl(tmp_path / d / "predictions.jsonl") for d in ("one", "two"))
    assert [without_timing(r) for r in one] == [without_timing(r) for r in two] and len(one) == 5
    results = [json.load(open(tmp_path / d / "results.json")) for d in ("one", "two")]
    assert without_timing(results[0]["datasets"]) == without_timing(results[1]["datasets"])
    assert results[1]["config"]["world_size"] == 2
    # an interrupted two-process run: each rank left a file, rank 1's ends mid-line
    (tmp_path / "cut").mkdir()
    marked = [json.dumps({**r, "marker": True}) + "\n" for r in one]
    (tmp_path / "cut" / "predictions.rank0-aaaa.jsonl").write_text(marked[0])
    (tmp_path / "cut" / "predictions.rank1-bbbb.jsonl").write_text(marked[1] + marked[3][:50])
    launch(2, argv(tmp_path / "cut"))
    cut = read_jsonl(tmp_path / "cut" / "predictions.jsonl")
    assert [r.pop("marker", False) for r in cut] == [True, True, False, False, False]  # finished ones kept as they were
    assert [without_timing(r) for r in cut] == [without_timing(r) for r in one]
    assert not [p for p in os.listdir(tmp_path / "cut") if p.startswith("predictions.rank")]


def test_an_output_folder_not_shared_by_two_machines_stops_every_rank(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path):
    """Two "machines" (torchrun --nnodes 2), each launched from its own folder with the same relative
    --output_dir: the first rank could never merge the other's predictions, so both stop at once."""
    from train_helpers import run_two_machines

    argv = args_for(tiny_lm_dir, small_corpus, tiny_encoder_dir, "runs/eval", "--limit", 2)
    for code, out in run_two_machines(os.path.join(ROOT, "evaluate.py"), argv, [tmp_path / "m0", tmp_path / "m1"]):
        assert code != 0 and "evaluate.py: --output_dir runs/eval is not one folder for every machine" in out, out[-2000:]
        assert "rank 1 on machine 1" in out and "Loading weights" not in out
    assert os.listdir(tmp_path / "m1" / "runs" / "eval") == []  # no prediction file on either machine
    assert os.listdir(tmp_path / "m0" / "runs" / "eval") == []

def test_bootstrap_interval_by_hand():
    assert evaluate.bootstrap_interval([0.5] * 7) == [0.5, 0.5]  # no spread, no width
    lo, hi = evaluate.bootstrap_interval([1.0] * 20 + [0.0] * 20)
    assert lo < 0.5 < hi and 0.25 < hi - lo < 0.4  # ±1.96 * sqrt(.25 / 40) = ±0.155
    lo4, hi4 = evaluate.bootstrap_interval([1.0] * 80 + [0.0] * 80)
    assert hi4 - lo4 < 0.6 * (hi - lo)  # 4x the questions: about half the width
    assert evaluate.bootstrap_interval([1.0, 0.0, 1.0]) == evaluate.bootstrap_interval([1.0, 0.0, 1.0])  # seeded


def test_evidence_share_by_hand():
    """E = |supporting ∩ retrieved| / |supporting|, over every turn's retrieved ids."""
    from evaluate import evidence_share

    t = agent.Trajectory(qid="q", question="?", golden_answers=["a"])
    t.turns = [{"document_ids": [["1", "2"], []]}, {"document_ids": [["7", "2"]]}, {"generation": "no search"}]
    assert evidence_share(t, ["2", "7", "9"]) == pytest.approx(2 / 3)
    assert evidence_share(t, [7]) == 1.0  # ids compare as strings
    assert evidence_share(t, []) == 0.0 and evidence_share(t, None) == 0.0
    assert evidence_share(agent.Trajectory(qid="q", question="?", golden_answers=["a"]), ["1"]) == 0.0


def test_evidence_recall_by_hand():
    """A record's evidence is the share of its question's supporting passages retrieved (None for a
    question without supporting ids); evidence_recall averages the questions that have one."""
    q = {"dataset": "toy", "id": "1", "index": 0, "question": "?", "golden_answers": ["a"],
         "metadata": {"supporting_ids": ["5", "9"]}}
    t = agent.Trajectory(qid="1", question="?", golden_answers=["a"], num_turns=1, context_tokens=[10])
    t.turns = [{"document_ids": [["9", "1"]]}]
    with_ids = evaluate.record(q, t, 1.0, None, {})
    without = evaluate.record({k: v for k, v in q.items() if k != "metadata"}, t, 1.0, None, {})
    assert with_ids["evidence"] == 0.5 and without["evidence"] is None
    assert evaluate.summarize([with_ids, without, dict(with_ids, evidence=1.0)])["evidence_recall"] == 0.75
    assert evaluate.summarize([without])["evidence_recall"] is None


def test_a_failing_report_leaves_the_results(tmp_path, capsys):
    """evaluate.html_report: a report that cannot be written is a warning, not a lost evaluation."""
    (tmp_path / "predictions.jsonl").write_text("not json\n{}\n")
    evaluate.html_report(str(tmp_path))
    assert "warning: no report.html" in capsys.readouterr().out and not os.path.exists(tmp_path / "report.html")


def test_release_prompts_are_read_from_a_clone_of_the_release(tmp_path):
    """--release_prompts CLONE parses the release's evaluation client (not run, not copied): the last
    system_prompt class MemSearcher assigns, and the instruction after each </tool_response>. A stand-in
    file of the same shape with made-up texts; a clone without it, or of another shape, is a clear error."""
    client = tmp_path / "clone" / "memsearcher" / "inference"
    client.mkdir(parents=True)
    (client / "memsearcher.py").write_text('''import os

class MemSearcher():
    system_prompt = """an older prompt"""

    system_prompt = """You answer with \\\\boxed{} after searching.
Second line."""

    def cat_tool_results(self, curr_prompt, tool_calls, results):
        text = ""
        for tool_call, result in zip(tool_calls, results):
            text += f"<tool_response>{tool_call}\\n{result}\\n</tool_response>\\nWrite the new memory in <memory> </memory>."
        return curr_prompt + text

    def run(self):
        raise RuntimeError("never run")
''')
    prompts = evaluate.release_prompts(str(tmp_path / "clone"))
    assert prompts == {"system_prompt": "You answer with \\boxed{} after searching.\nSecond line.",
                       "memory_instruction": "Write the new memory in <memory> </memory>."}
    turn = agent.tool_response_turn([{"body": "{}"}], ["doc"], prompts["memory_instruction"])
    assert "</tool_response>\nWrite the new memory in <memory> </memory>.<|im_end|>" in turn  # as the release writes it
    with pytest.raises(SystemExit, match="cannot read .*memsearcher.py"):
        evaluate.release_prompts(str(tmp_path / "nothing"))
    (client / "memsearcher.py").write_text("class Other:\n    pass\n")
    with pytest.raises(SystemExit, match="no MemSearcher.system_prompt"):
        evaluate.release_prompts(str(tmp_path / "clone"))
    with pytest.raises(SystemExit, match="without --system_prompt"):
        evaluate.main(["--release_prompts", str(tmp_path / "clone"), "--system_prompt", str(client / "memsearcher.py"),
                       "--output_dir", str(tmp_path / "out")])



def test_the_releases_tool_errors_call_by_call():
    """--release_prompts: each malformed call reads as the release's client writes it, and a blank
    query goes to the server as it is (not stripped); without it, our texts."""
    cases = [("not json", "Parse tool call failed"), ('{"name": "wikipedia_search"}', "Parse tool call failed"),
             ('["arguments"]', "Parse tool call failed"), ('{"arguments": "x"}', "Parse query failed"),
             ('{"arguments": null}', "Parse query failed"), ('{"arguments": {}}', "invalid query"),
             ('{"arguments": {"query": ""}}', "invalid query"), ('{"arguments": {"query": 5}}', "error: 400"),
             ('{"arguments": {"query": "x", "top_n": 0}}', "error: 400"),
             ('{"arguments": {"query": "x", "top_n": true}}', "error: 400"), ('{"arguments": {"query": "  "}}', None)]
    for body, expected in cases:
        (call,) = agent.parse_tool_calls(f"<tool_call>{body}</tool_call>", 10, None, evaluate.release_tool_error)
        assert call["error"] == expected, body
    (blank,) = agent.parse_tool_calls('<tool_call>{"arguments": {"query": "  ", "top_n": 20}}</tool_call>', 10, None,
                                      evaluate.release_tool_error)
    assert (blank["query"], blank["top_n"]) == ("  ", 20)
    (ours,) = agent.parse_tool_calls('<tool_call>{"arguments": {"query": "  "}}</tool_call>')
    assert ours["error"] == "Error: invalid query."


def test_reference_row_and_difference_by_hand(tmp_path, capsys):
    """--reference: the published EM beside ours and ours minus it, per dataset; the Avg pair only
    when the reference covers the same datasets; a malformed file is a clear error."""
    ours = {"datasets": {"alpha": {"em": 0.5}, "beta": {"em": 0.0}}, "config": {"memory_kind": "cpu_peak_rss"},
            "average": {"em": 0.25, "context_tokens_per_turn": {"mean": [], "max": [], "n": []}}}
    path = tmp_path / "paper.json"
    path.write_text(json.dumps({"method": "Paper 3B", "source": "its Table 1", "em": {"alpha": 0.4, "BETA": 0.3}}))
    table = evaluate.report([("Ours", ours)], evaluate.read_reference(str(path)))
    assert "| Paper 3B | EM | 0.400 | 0.300 | 0.350 |" in table
    assert "| Ours minus it | EM | +0.100 | -0.300 | -0.100 |" in table and "Paper 3B: its Table 1." in table
    path.write_text(json.dumps({"method": "Paper 3B", "source": "s", "em": {"alpha": 0.4, "gamma": 0.1}}))
    table = evaluate.report([("Ours", ours)], evaluate.read_reference(str(path)))
    assert "| Paper 3B | EM | 0.400 | – | – |" in table and "| Ours minus it | EM | +0.100 | – | – |" in table
    path.write_text(json.dumps({"method": "Paper 3B", "source": "s", "em": {"alpha": 40.1}}))  # percent, not a share
    with pytest.raises(SystemExit, match="EM in \\[0, 1\\]"):
        evaluate.main(["--reference", str(path), "--compare", "x.json"])
