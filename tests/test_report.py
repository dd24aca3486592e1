"""tools/report.py: the HTML it writes, parsed (cards, turns, filters, escaping), its pieces by
hand, the training view of samples.jsonl, bad input, and (marked `browser`) the page in headless
Chromium."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("report", os.path.join(ROOT, "tools", "report.py"))
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)

ATTACK = "<script>alert('x')</script>"
CORPUS = {"0": ("Nothing", "Line 0: ids are line numbers."), "1": ("Mabeland", "Mabeland has its capital in Ithstad."), "2": ("Ithstad", "It has 38,206 people. " + ATTACK),
          "3": ("Osk", "Osk was built in 1911."), "4": ("Oske", "Oske is a village.")}
ROWS = [{"id": "b", "question": "How many people live in the capital of Mabeland?", "golden_answers": ["38,206"],
         "metadata": {"type": "bridge", "supporting_ids": ["1", "2"],
                      "chain": [{"search": "Mabeland", "fact": "Its capital is Ithstad.", "passage_id": "1", "answer": "Ithstad"},
                                {"search": "Ithstad", "fact": "It has 38,206 people.", "passage_id": "2", "answer": "38,206"}]}},
        {"id": "s", "question": "When was Osk built? " + ATTACK, "golden_answers": ["1911"],
         "metadata": {"type": "single", "supporting_ids": ["3"],
                      "chain": [{"search": "Osk", "fact": "Osk was built in 1911.", "passage_id": "3", "answer": "1911"}]}}]


def search_turn(k, query, ids, memory):
    return {"turn": k, "context": "...", "generation": f" I must search. </think>\n<tool_call>{query}</tool_call><|im_end|>",
            "queries": [query], "documents": ["raw text of the results"], "document_ids": [ids],
            "memory_generation": f"<memory> {memory} </memory>", "memory": memory}


def answer_turn(k, answer):
    return {"turn": k, "context": "...", "generation": f" I can answer. </think>\n\\boxed{{{answer}}}<|im_end|>"}


RECORDS = [  # b: right, searched both hops; s: wrong, the memory kept nothing useful, hit the turn limit
    {"dataset": "toy", "id": "b", "question": ROWS[0]["question"], "golden_answers": ["38,206"], "prediction": "38,206",
     "em": 1.0, "f1": 1.0, "end_reason": "answer", "num_searches": 2, "context_tokens": [900, 950, 400],
     "turns": [search_turn(1, "Mabeland", ["1", "4"], "Capital of Mabeland: Ithstad."),
               search_turn(2, "Ithstad", ["2"], "Capital of Mabeland: Ithstad. Ithstad has 38,206 people."),
               answer_turn(3, "38,206")]},
    {"dataset": "toy", "id": "s", "question": ROWS[1]["question"], "golden_answers": ["1911"], "prediction": None,
     "em": 0.0, "f1": 0.0, "end_reason": "max_turns", "num_searches": 2, "context_tokens": [900, 920],
     "turns": [search_turn(1, "Osk", ["4"], "Osk: unknown."), search_turn(2, "Osk built", ["4"], "Osk: unknown.")]}]


@pytest.fixture
def eval_folder(tmp_path):
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"id": i, "contents": f'"{t}"\n{x}'}) + "\n" for i, (t, x) in CORPUS.items()))
    (tmp_path / "toy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    summary = {"n": 2, "em": 0.5, "f1": 0.5, "format_valid": 0.5, "searches": 2.0, "turns": 2.5,
               "interval": {"em": [0.0, 1.0], "f1": [0.0, 1.0]}, "end_reasons": {"answer": 1, "max_turns": 1}}
    (folder / "results.json").write_text(json.dumps({
        "run": {"agent": "memsearcher", "model": "runs/x", "dtype": "float32", "max_turns": 5, "max_new_tokens": 128},
        "config": {"data": [str(tmp_path / "toy.jsonl")], "corpus": str(tmp_path / "corpus.jsonl")},
        "datasets": {"toy": summary}, "average": summary}))
    return folder


class Page(HTMLParser):
    """Cards with their attributes and turn rows, the filters, the scripts, and all text."""

    def __init__(self, text):
        super().__init__()
        self.cards, self.filters, self.scripts, self.text, self.members = [], [], 0, [], 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "article" and "card" in classes:
            self.cards.append({**{k[5:]: v for k, v in a.items() if k.startswith("data-")}, "turns": 0, "support": 0})
        if tag == "tr" and "turn" in classes and self.cards:
            self.cards[-1]["turns"] += 1
        if tag == "details" and "support" in classes and self.cards:
            self.cards[-1]["support"] += 1
        if tag == "select" and "data-filter" in a:
            self.filters.append(a["data-filter"])
        if tag == "div" and "member" in classes:
            self.members += 1
        self.scripts += tag == "script"

    def handle_data(self, data):
        self.text.append(data)


def test_evaluation_page_cards_turns_filters_and_figures(eval_folder, tmp_path):
    out = report.main([str(eval_folder), "-o", str(tmp_path / "r.html")])
    page = Page(open(out, encoding="utf-8").read())
    assert [(c["type"], c["outcome"], c["end"], c["hop2"], c["turns"]) for c in page.cards] == \
        [("bridge", "right", "answer", "yes", 3), ("single", "wrong", "max_turns", "n/a", 2)]
    assert [c["support"] for c in page.cards] == [2, 0]  # passages 1 and 2 are b's supporting ones; s only saw 4
    assert page.filters == ["type", "outcome", "end", "hop2"]
    text = "".join(page.text)
    assert "0.500 [0.00, 1.00]" in text and "answer 1, max_turns 1" in text  # the header's figures, from results.json
    assert "Its capital is Ithstad." in text and "38,206" in text  # the gold chain


def test_question_and_passage_text_is_escaped(eval_folder, tmp_path):
    """A question or passage holding <script> stays text: the page has only its own script."""
    text = open(report.main([str(eval_folder), "-o", str(tmp_path / "r.html")]), encoding="utf-8").read()
    page = Page(text)
    assert page.scripts == 1 and ATTACK not in text and html_escaped(ATTACK) in text
    assert sum(ATTACK in t for t in page.text) >= 2  # the question, and passage 2 among b's documents


def html_escaped(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("'", "&#x27;")


def test_memory_diff_and_tokens_by_hand():
    assert report.memory_diff("a b c", "a c d") == "a <del>b</del> c <ins>d</ins>"
    assert report.memory_diff("", "<b>") == "<ins>&lt;b&gt;</ins>"
    assert "no valid memory" in report.memory_diff("a", None)
    conversation = {"tokens": ["A", "B", "<x>", "C"], "loss_mask": [1, 0, 0, 1], "logprobs": [math.log(0.9), 0.0, 0.0, math.log(0.1)]}
    assert report.tokens_html(conversation) == ('<pre class="tokens"><span class="p4" title="-0.105">A</span>'
                                                '<span class="m">B&lt;x&gt;</span><span class="p0" title="-2.303">C</span></pre>')
    assert report.thought_and_action(" I can answer. </think>\n\\boxed{1911}<|im_end|>") == ("I can answer.", "\\boxed{1911}")


def test_training_page_groups_side_by_side_and_older_samples(tmp_path):
    """samples.jsonl: a group of 3 (the oracle marked, advantages signed) and a line written before
    groups were recorded (today's keys only), which still renders, as its own group."""
    conversation = {"prompt_tokens": 300, "tokens": ["x", "y"], "loss_mask": [1, 0], "logprobs": [-0.1, 0.0]}
    base = {"step": 1, "question": ROWS[0]["question"], "golden_answers": ["38,206"], "end_reason": "answer",
            "turns": RECORDS[0]["turns"], "group": "b", "trained": True, "conversations": [conversation]}
    samples = [{**base, "member": 0, "oracle": False, "reward": 0.0, "advantage": -0.58, "prediction": "3"},
               {**base, "member": 1, "oracle": False, "reward": 0.0, "advantage": -0.58, "prediction": "4"},
               {**base, "member": 2, "oracle": True, "reward": 1.0, "advantage": 1.15, "prediction": "38,206"},
               {"step": 2, "question": "Old?", "golden_answers": ["a"], "prediction": "a", "reward": 1.0, "end_reason": "answer",
                "turns": [answer_turn(1, "a")]}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    text = open(report.main([str(tmp_path), "--corpus", str(tmp_path / "none.jsonl")]), encoding="utf-8").read()
    page = Page(text)
    assert page.members == 4 and text.count('class="member is-oracle"') == 1
    assert text.count('class="neg">-0.58') == 2 and 'class="pos">+1.15' in text
    assert "step 1" in page.text and "step 2" in page.text and "Old?" in page.text


def test_bad_input_is_named(tmp_path):
    with pytest.raises(SystemExit, match="neither predictions.jsonl"):
        report.main([str(tmp_path)])
    (tmp_path / "predictions.jsonl").write_text('{"id": 1, "turns": []}\nnot json\n{"id": 2}\n')
    with pytest.raises(SystemExit, match=r"predictions.jsonl:2: not JSON"):
        report.main([str(tmp_path)])
    (tmp_path / "predictions.jsonl").write_text('{"id": 1, "turns": []}\n{"id": 2, "tur')  # cut mid-write: skipped
    assert len(Page(open(report.main([str(tmp_path)]), encoding="utf-8").read()).cards) == 1


def test_two_hundred_questions_stay_under_5_mb(eval_folder, tmp_path):
    """The scale the page is meant for: 200 questions of 5 turns, each with 5 passages and a memory
    of several facts, in under 5 MB (its opening time is measured in headless Chromium, docs/)."""
    long_turns = [search_turn(k, f"query {k}", ["1", "2", "3", "4", "1"], "fact " * 60) for k in range(1, 6)]
    records = [{**RECORDS[0], "id": f"q{k}", "turns": long_turns, "context_tokens": [1000] * 5} for k in range(200)]
    (eval_folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = report.main([str(eval_folder), "-o", str(tmp_path / "big.html")])
    assert len(Page(open(out, encoding="utf-8").read()).cards) == 200 and os.path.getsize(out) < 5e6


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.browser
@pytest.mark.skipif(chromium() is None, reason="no Chromium (Debian: apt-get install chromium)")
def test_page_in_headless_chromium(eval_folder, tmp_path):
    """The DOM after the page's script ran: every card and turn there, and a filter given in the
    URL (#outcome=wrong) hides the cards it should."""
    out = report.main([str(eval_folder), "-o", str(tmp_path / "r.html")])

    def dom(fragment):
        run = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
                              f"file://{out}{fragment}"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout

    everything, wrong = dom(""), dom("#outcome=wrong")
    page = Page(everything)
    assert len(page.cards) == 2 and [c["turns"] for c in page.cards] == [3, 2] and len(page.filters) == 4
    assert 'data-loaded-ms="' in everything  # the script ran to the end
    assert wrong.count("<article") == 2 and wrong.count("hidden") >= 1
    shown = [chunk for chunk in wrong.split("<article")[1:] if "hidden" not in chunk.split(">", 1)[0]]
    assert len(shown) == 1 and 'data-outcome="wrong"' in shown[0]
    assert '<b id="shown">1</b>' in wrong
