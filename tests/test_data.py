"""The committed toy worlds (data/toy/, and data/toy_seed1/ for transfer): formats, answerability,
reasoning chains, splits, reproducibility; the oracle's demonstrations (toy/oracle.py); question
rows for training and evaluation (data/questions.py)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
WORLDS = {"toy": 0, "toy_seed1": 1}  # folder: seed
FILES = ("corpus.jsonl", "train.jsonl", "test.jsonl")
KINDS = ("single", "bridge", "comparison")


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").split("\n")[:-1]]


def title(row):
    return row["contents"].split("\n")[0].strip('"')


@pytest.fixture(scope="module", params=list(WORLDS))
def world(request):
    """One world: its folder name, corpus rows and question rows per split."""
    folder = DATA / request.param
    return {"name": request.param, "corpus": read_jsonl(folder / "corpus.jsonl"),
            "qa": {split: read_jsonl(folder / f"{split}.jsonl") for split in ("train", "test")}}


# ---------------------------------------------------------------------------------------------
# The data files
# ---------------------------------------------------------------------------------------------
def test_files_are_newline_terminated_jsonl_and_small(world):
    folder = DATA / world["name"]
    for name in FILES:
        data = (folder / name).read_bytes()
        assert data.endswith(b"\n") and b"\r" not in data and b"\n\n" not in data
    assert (folder / "corpus.jsonl").stat().st_size < 2_000_000
    assert sum((folder / name).stat().st_size for name in FILES) < 2_500_000


def test_corpus_ids_and_contents(world):
    corpus = world["corpus"]
    assert len(corpus) >= 1000
    for i, row in enumerate(corpus):
        assert list(row) == ["id", "contents"]
        assert row["id"] == str(i)
        m = re.fullmatch(r'"([^"\n]+)"\n([^\n]+)', row["contents"])
        assert m, row
        assert 30 <= len(m.group(2).split()) <= 120


def test_qa_rows_are_well_formed(world):
    corpus = world["corpus"]
    for split, rows in world["qa"].items():
        assert rows
        assert len({r["id"] for r in rows}) == len(rows)
        for r in rows:
            assert list(r) == ["id", "question", "golden_answers", "metadata"]
            assert isinstance(r["id"], str) and r["id"].startswith(split + "_")
            assert isinstance(r["question"], str) and r["question"].strip()
            answers = r["golden_answers"]
            assert isinstance(answers, list) and answers
            assert all(isinstance(a, str) and a.strip() for a in answers)
            meta = r["metadata"]
            assert meta["type"] in KINDS
            assert list(meta) == ["type", "supporting_ids", "chain"] + (["compare"] if meta["type"] == "comparison" else [])
            sup = meta["supporting_ids"]
            assert sup and all(isinstance(s, str) and s.isdigit() and int(s) < len(corpus) for s in sup)
            for hop in meta["chain"]:
                assert list(hop) == ["search", "fact", "note", "passage_id", "answer", "relation"]
                assert all(isinstance(v, str) and v.strip() for v in hop.values())


def test_all_question_types_present(world):
    for rows in world["qa"].values():
        counts = {k: sum(r["metadata"]["type"] == k for r in rows) for k in KINDS}
        assert counts["single"] > counts["bridge"] > counts["comparison"] > 0, counts


def test_answers_are_stated_in_supporting_passages(world):
    corpus = world["corpus"]
    for rows in world["qa"].values():
        for r in rows:
            passages = [corpus[int(s)]["contents"].lower() for s in r["metadata"]["supporting_ids"]]
            answers = [a.lower() for a in r["golden_answers"]]
            if r["metadata"]["type"] == "comparison":
                # the answer is yes/no or one of the two entities the question compares
                assert answers in (["yes"], ["no"]) or answers[0] in r["question"].lower(), r
                assert len(r["metadata"]["supporting_ids"]) == 2
            else:
                assert any(a in p for a in answers for p in passages), r


def test_train_and_test_questions_are_disjoint(world):
    train = {r["question"] for r in world["qa"]["train"]}
    test = {r["question"] for r in world["qa"]["test"]}
    assert len(train) == len(world["qa"]["train"]) and len(test) == len(world["qa"]["test"])
    assert not train & test


@pytest.mark.parametrize("folder", list(WORLDS))
def test_script_reproduces_committed_files(tmp_path, folder):
    subprocess.run([sys.executable, str(ROOT / "toy" / "make_toy.py"), "--seed", str(WORLDS[folder]), "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=300)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (DATA / folder / name).read_bytes(), name


def test_a_name_without_a_vowel_gets_a_fresh_one_not_a_crash():
    """Seed 2 once crashed: a `like` name with no vowel to vary. Now unique() makes a fresh name."""
    import random

    from toy import make_toy

    world = make_toy.World(random.Random(0))
    assert world.variant("Ystryn River") is None
    name = world.unique(lambda: "Kessa", like="Ystryn")
    assert name == "Kessa" and "kessa" in world.used


# ---------------------------------------------------------------------------------------------
# Reasoning chains
# ---------------------------------------------------------------------------------------------
def number(text):
    return int(text.split()[0].replace(",", ""))


def test_chain_facts_occur_in_named_passages(world):
    corpus = world["corpus"]
    for rows in world["qa"].values():
        for r in rows:
            chain = r["metadata"]["chain"]
            assert [h["passage_id"] for h in chain] == r["metadata"]["supporting_ids"]
            for h in chain:
                passage = corpus[int(h["passage_id"])]
                assert title(passage) == h["search"], (r, h)  # searching the entity names its passage
                assert h["fact"] in passage["contents"].split("\n")[1], (r, h)  # the sentence, verbatim
                assert h["answer"] in h["fact"] and h["answer"] in h["note"], (r, h)
                assert h["search"] in h["note"], (r, h)  # the note names its subject


def test_chain_ends_at_the_gold_answer(world):
    for rows in world["qa"].values():
        for r in rows:
            meta, gold = r["metadata"], r["golden_answers"]
            chain = meta["chain"]
            if meta["type"] == "single":
                assert len(chain) == 1 and chain[0]["answer"] == gold[0], r
            elif meta["type"] == "bridge":
                assert len(chain) == 2 and chain[-1]["answer"] == gold[0], r
                assert chain[1]["search"] == chain[0]["answer"], r  # the first hop names the second's entity
            else:
                a, b = chain
                assert len(chain) == 2 and a["search"] != b["search"], r
                if meta["compare"] == "same":
                    assert gold == ["yes" if a["answer"] == b["answer"] else "no"], r
                else:
                    best = (max if meta["compare"] == "larger" else min)(chain, key=lambda h: number(h["answer"]))
                    assert number(a["answer"]) != number(b["answer"]) and gold[0] == best["search"], r


def test_second_world_shares_no_entity_names_with_the_first():
    titles = {name: {title(row) for row in read_jsonl(DATA / name / "corpus.jsonl")} for name in WORLDS}
    assert not titles["toy"] & titles["toy_seed1"]
    for r in read_jsonl(DATA / "toy_seed1" / "test.jsonl"):
        assert not {h["search"] for h in r["metadata"]["chain"]} & titles["toy"]
        assert not set(r["golden_answers"]) & titles["toy"]


# ---------------------------------------------------------------------------------------------
# The oracle: demonstrations through agent.rollout, with a search tool that needs no encoder
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy():
    return {"corpus": read_jsonl(DATA / "toy" / "corpus.jsonl"), "train": read_jsonl(DATA / "toy" / "train.jsonl")}


def fake_search(corpus, withhold=()):
    """A search tool that ranks the passages titled exactly as the query first (minus `withhold`),
    then fills up with unrelated passages; rendered as the real retriever renders them."""
    import retriever

    by_title = {}
    for row in corpus:
        by_title.setdefault(title(row), []).append(row)
    others = [row for row in corpus[:20] if row["id"] not in withhold]

    def search(queries, topk):
        hits = [[row for row in by_title.get(q, []) if row["id"] not in withhold] + others for q in queries]
        return [retriever.format_docs(h[:k]) for h, k in zip(hits, topk)]
    return search


def some_rows(train, per_type=6):
    return [r for kind in KINDS for r in [r for r in train if r["metadata"]["type"] == kind][:per_type]]


@pytest.fixture(scope="module")
def demos(toy, tokenizer):
    from toy import oracle

    rows = some_rows(toy["train"])
    trajectories, stats = oracle.make_demonstrations(rows, fake_search(toy["corpus"]), tokenizer, seed=0)
    return rows, trajectories, stats


def test_oracle_demonstrations_earn_reward_one(demos, tokenizer):
    import agent
    from toy import oracle

    rows, trajectories, stats = demos
    assert stats["offered"] == stats["kept"] == len(rows) == len(trajectories) and not stats["dropped"]
    assert stats["by_type"] == {k: {"offered": 6, "kept": 6} for k in KINDS}
    for r, t in zip(rows, trajectories):
        chain = r["metadata"]["chain"]
        assert t.reward == 1.0 and t.end_reason == "answer" and t.prediction == r["golden_answers"][0]
        assert 1 <= t.num_searches == len(chain) and len(t.conversations) <= len(chain) + 1
        assert all(h["note"] in t.memory for h in chain)  # the memory kept every hop's fact
        for c in t.conversations:
            text = tokenizer.decode(c.prompt_ids + c.response_ids, skip_special_tokens=False)
            assert all(m.count("<think>") == m.count("</think>") for m in agent.assistant_messages(text))
    # every thought opens with the same skeleton: what the question asks for (a comparison: that it
    # compares two things), the memory, what its latest fact gives, and the choice spelled out
    # ("..., so I can answer." / "..., so I must search."); the wording varies after it
    after = set()
    for r, t in zip(rows, trajectories):
        chain, comparison = r["metadata"]["chain"], r["metadata"]["type"] == "comparison"
        asks = "The question compares two things." if comparison else f"The question asks for the {oracle.KIND[chain[-1]['relation']]}."
        for k, turn in enumerate(t.turns):
            thought = " ".join(turn["generation"].split("</think>")[0].split())
            held = [h for h in chain if h["note"] in (t.turns[k - 1]["memory"] if k else "")]
            if not held:
                skeleton = asks + " The memory is empty, so I must search. "
            else:
                gives = ["one of two", "two of two"][len(held) - 1] if comparison else oracle.KIND[held[-1]["relation"]]
                choice = "can answer" if len(held) == len(chain) else "must search"
                notes = " ".join(f"The {oracle.KIND[h['relation']]} of {h['search']}: {h['note']}" for h in held)
                skeleton = (f"{asks} The memory says: {notes} "
                            f"That {'is' if comparison else 'gives the'} {gives}, so I {choice}. ")
            assert thought.startswith(skeleton), (thought, skeleton)
            assert ("\\boxed{" in turn["generation"]) == (len(held) == len(chain))
            if len(held) < len(chain):  # a search names the fact it seeks: the kind of the next hop
                assert f"the {oracle.KIND[chain[len(held)]['relation']]} of " in thought[len(skeleton):]
            after.add(tuple(thought[len(skeleton):].split()[:2]))
    assert len(after) > 4  # the wording after the skeleton varies
    memory_thoughts = [turn["memory_generation"] for t in trajectories for turn in t.turns if "memory_generation" in turn]
    assert memory_thoughts and all(m.startswith("<think> ") and "</think>\n<memory> " in m for m in memory_thoughts)
    for r, t in zip(rows, trajectories):  # the memory thought quotes the passage sentence of each hop it finds,
        quoted = " ".join(m["memory_generation"] for m in t.turns if "memory_generation" in m)
        assert all(re.search(rf"the {oracle.KIND[h['relation']]}\b[^:]*: {re.escape(h['fact'])}", quoted)
                   for h in r["metadata"]["chain"])  # ... naming the kind of fact it is


def test_oracle_kinds_tell_every_hop_of_a_bridge_apart(toy):
    """The oracle's choice "That gives the <kind>" = "asks for the <kind>" is right only if a bridge's
    first hop never gives what its last hop gives: true of every relation pair the worlds use."""
    from toy import oracle

    for world in WORLDS:
        for r in read_jsonl(DATA / world / "train.jsonl") + read_jsonl(DATA / world / "test.jsonl"):
            kinds = [oracle.KIND[h["relation"]] for h in r["metadata"]["chain"]]
            if r["metadata"]["type"] == "bridge":
                assert kinds[0] != kinds[1], r["question"]
            if r["metadata"]["type"] == "comparison":
                assert kinds[0] == kinds[1], r["question"]


def sampled_spans(conversation):
    """The conversation's sampled generations: its runs of trained tokens, in order."""
    spans, start = [], None
    for i, m in enumerate(conversation.loss_mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append(conversation.response_ids[start:i])
            start = None
    return spans


def test_oracle_loss_masks_match_a_replayed_rollout(demos, toy, tokenizer):
    """Replaying the demonstration's sampled tokens through agent.rollout gives the same prompts,
    responses and loss masks: the oracle's samples are exactly what RL would record."""
    import agent

    rows, trajectories, _ = demos
    end = tokenizer.convert_tokens_to_ids(agent.END_OF_TURN)
    for r, demo in zip(rows, trajectories):
        queue = [span for c in demo.conversations for span in sampled_spans(c)]
        assert all(span[-1] == end for span in queue)

        def replay(model, tok, prompts, **sampling):
            outs = [queue.pop(0) for _ in prompts]
            return [agent.Generation(ids=ids, logprobs=[0.0] * len(ids), finished=True) for ids in outs]

        (t,) = agent.rollout(None, tokenizer, [r], fake_search(toy["corpus"]), generate_fn=replay)
        assert not queue and t.reward == demo.reward == 1.0
        assert len(t.conversations) == len(demo.conversations)
        for c, d in zip(t.conversations, demo.conversations):
            assert (c.prompt_ids, c.response_ids, c.loss_mask) == (d.prompt_ids, d.response_ids, d.loss_mask)
            # untrained: the prompt, then exactly the tool-response turn with the next assistant header
            for k in range(1, len(d.loss_mask)):
                if d.loss_mask[k] == 0 and d.loss_mask[k - 1] == 1:
                    stop = d.loss_mask.index(1, k)
                    turn = tokenizer.decode(d.response_ids[k:stop], skip_special_tokens=False)
                    assert turn.startswith("\n<|im_start|>user\n<tool_response>"), turn
                    assert turn.endswith("<|im_start|>assistant\n"), turn


def test_oracle_drops_a_trajectory_whose_support_was_not_retrieved(toy, tokenizer):
    from toy import oracle

    row = next(r for r in toy["train"] if r["metadata"]["type"] == "bridge")
    hidden = row["metadata"]["chain"][1]["passage_id"]
    kept, stats = oracle.make_demonstrations([row], fake_search(toy["corpus"], withhold={hidden}), tokenizer)
    assert kept == [] and stats["kept"] == 0
    assert stats["dropped"] == {"support not retrieved": 1}
    assert stats["by_type"] == {"bridge": {"offered": 1, "kept": 0}}


def test_oracle_reads_hop_from_memory_and_tolerates_both_prompt_endings(toy):
    """Stateless: the next hop follows from the memory in the prompt; "<think>" and "<think>\\n" both work."""
    import agent
    from toy import oracle

    row = next(r for r in toy["train"] if r["metadata"]["type"] == "bridge")
    first, second = row["metadata"]["chain"]
    policy = oracle.Oracle([row], seed=0)
    prompt = agent.memsearcher_prompt(row["question"], first["note"])
    for text in (prompt, prompt + "\n"):
        out = policy.respond(text)
        assert (out.startswith(" ") == (text == prompt)) and "</think>" in out and "<think>" not in out
        call = json.loads(re.search(r"<tool_call>(.*?)</tool_call>", out, re.S).group(1))
        assert call["name"] == "wikipedia_search" and call["arguments"]["query"] == second["search"]
    done = policy.respond(agent.memsearcher_prompt(row["question"], first["note"] + " " + second["note"]))
    assert done.rstrip().endswith("\\boxed{%s}" % row["golden_answers"][0]) and "<tool_call>" not in done


def test_pick_questions_takes_the_first_of_each_type_in_the_shares_given():
    from toy import oracle

    rows = [{"id": str(k), "metadata": {"type": t}} for k, t in enumerate("sbsscsbccsbs")]
    rows = [dict(r, metadata={"type": {"s": "single", "b": "bridge", "c": "comparison"}[r["metadata"]["type"]]})
            for r in rows]
    # 6 of 1:1:1 -> 2 single (ids 0, 2), 2 bridge (1, 6), 2 comparison (4, 7), in file order
    assert [r["id"] for r in oracle.pick_questions(rows, 6, {"single": 1, "bridge": 1, "comparison": 1})] == \
        ["0", "1", "2", "4", "6", "7"]
    # 4 of 1:2:1 -> 1 single, 2 bridge, 1 comparison; a share of 0 takes none of that type
    assert [r["id"] for r in oracle.pick_questions(rows, 4, {"single": 1, "bridge": 2, "comparison": 1})] == \
        ["0", "1", "4", "6"]
    assert [r["id"] for r in oracle.pick_questions(rows, 3, {"single": 0, "bridge": 1, "comparison": 0})] == \
        ["1", "6", "10"]
    with pytest.raises(ValueError, match=r"too few .*'bridge': '3 of 4'"):
        oracle.pick_questions(rows, 8, {"single": 1, "bridge": 1})
    with pytest.raises(ValueError, match="not all 0"):
        oracle.pick_questions(rows, 4, {"single": 0, "bridge": 0})


# --- question rows ---------------------------------------------------------------------------------
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


# --- where a chain breaks (toy/chain_funnel.py), by hand ----------------------------------------
def test_chain_funnel_counts_each_stage_only_after_the_ones_before():
    import importlib.util
    spec = importlib.util.spec_from_file_location("chain_funnel", ROOT / "toy" / "chain_funnel.py")
    funnel = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(funnel)
    chain = [{"search": "Mabeland", "passage_id": "7", "answer": "Ithstad"},
             {"search": "Ithstad", "passage_id": "8", "answer": "38,206"}]
    passages = {"7": "Mabeland has its capital in Ithstad.", "8": "The town has a population of 38,206."}
    turns = [{"queries": ["mabeland"], "documents": ["Mabeland has its capital in Ithstad. Other text."],
              "memory": "The capital of Mabeland: Ithstad."},
             {"queries": ["Ithstad town"], "documents": ["Unrelated passage."], "memory": "It has 38,206 people."}]
    # hop 2's passage never came back, so its memory fact does not count; a lucky answer counts only last
    assert funnel.funnel({"turns": turns, "em": 1.0}, chain, passages) == [True, True, True, True, False, False, False, True]
    assert funnel.funnel({"turns": turns[:1], "em": 0.0}, chain, passages) == [True, True, True, False, False, False, False, False]
    assert not funnel.contains("Ithstadt", "Ithstad") and funnel.contains("in the ithstad.", "Ithstad")


def test_group_experts_join_their_questions_groups_as_replayable_samples(toy, tokenizer):
    """oracle.group_experts (train.py --oracle_per_group K): K trajectories per row with a chain, keyed
    by the row's id (its GRPO group), none for a row without one; each replays through agent.rollout
    to the same ids and masks, as a policy's sample would."""
    import agent
    from toy import oracle

    rows = some_rows(toy["train"], per_type=1)
    plain = {"id": "no-chain", "question": "Is it?", "golden_answers": ["yes"]}
    experts = oracle.group_experts(rows + [plain], fake_search(toy["corpus"]), tokenizer, 2, agent.RolloutSettings(max_turns=3),
                                   seed=0)
    assert [t.qid for t in experts] == [str(r["id"]) for r in rows for _ in range(2)]
    assert all(t.reward == 1.0 for t in experts)
    for k, expert in enumerate(experts):
        queue = [span for c in expert.conversations for span in sampled_spans(c)]

        def replay(model, tok, prompts, **sampling):
            return [agent.Generation(ids=ids, logprobs=[0.0] * len(ids), finished=True) for ids in (queue.pop(0) for _ in prompts)]
        (again,) = agent.rollout(None, tokenizer, [rows[k // 2]], fake_search(toy["corpus"]), agent.RolloutSettings(max_turns=3),
                                 generate_fn=replay)
        assert not queue and again.reward == 1.0
        assert [(c.prompt_ids, c.response_ids, c.loss_mask) for c in again.conversations] == \
               [(c.prompt_ids, c.response_ids, c.loss_mask) for c in expert.conversations]

def test_evidence_share_by_hand():
    """E = |supporting ∩ retrieved| / |supporting|, over every turn's retrieved ids."""
    import agent
    from toy.oracle import evidence_share

    t = agent.Trajectory(qid="q", question="?", golden_answers=["a"])
    t.turns = [{"document_ids": [["1", "2"], []]}, {"document_ids": [["7", "2"]]}, {"generation": "no search"}]
    assert evidence_share(t, ["2", "7", "9"]) == pytest.approx(2 / 3)
    assert evidence_share(t, [7]) == 1.0  # ids compare as strings
    assert evidence_share(t, []) == 0.0 and evidence_share(t, None) == 0.0
    assert evidence_share(agent.Trajectory(qid="q", question="?", golden_answers=["a"]), ["1"]) == 0.0
