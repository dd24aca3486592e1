"""toy/: the embedded default's small-budget recipe and its worlds. The committed toy worlds
(data/toy/, and data/toy_seed1/ for transfer; toy/make_toy.py): formats, answerability, reasoning
chains, splits, reproducibility; the oracle's demonstrations (toy/oracle.py); what a policy did by
question type (toy/rl_worlds.py, toy/chain_funnel.py); and the recipe's steps inside train.py
(toy/recipe.py): the warm start, the oracle in unsolved groups, evidence credit, tied groups skipped."""
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import agent
import train
from train_helpers import answering, base_args, recording_advantages, run_two_processes, state

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


@pytest.fixture(scope="module")
def react_demos(toy, tokenizer):
    import agent
    from toy import oracle

    rows = some_rows(toy["train"])
    settings = agent.RolloutSettings(agent="react")
    trajectories, stats = oracle.make_demonstrations(rows, fake_search(toy["corpus"]), tokenizer, settings, seed=0)
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


def test_react_oracle_acts_the_chain_out_in_one_growing_conversation(react_demos):
    """ReAct's demonstrations: one conversation, a search per hop, and the same thought skeleton
    after quoting what the latest results give, naming (not restating) what it found before."""
    from toy import oracle

    rows, trajectories, stats = react_demos
    assert stats["offered"] == stats["kept"] == len(rows) and not stats["dropped"]
    assert stats["conversations"] == len(rows)
    for r, t in zip(rows, trajectories):
        chain, comparison = r["metadata"]["chain"], r["metadata"]["type"] == "comparison"
        assert t.reward == 1.0 and t.end_reason == "answer" and t.prediction == r["golden_answers"][0]
        assert len(t.conversations) == 1 and t.num_searches == len(chain) and t.memory == ""
        asks = "The question compares two things." if comparison else f"The question asks for the {oracle.KIND[chain[-1]['relation']]}."
        searched = []
        for k, turn in enumerate(t.turns):
            assert turn["generation"].startswith("<think> ") == (k > 0)  # the first turn's <think> is prefilled
            thought = " ".join(turn["generation"].replace("<think>", "").split("</think>")[0].split())
            held = [h for h in chain if h["search"] in searched]
            new = [h for h in held if h["search"] in (t.turns[k - 1].get("queries", []) if k else [])]
            read, _, acted = thought.partition(asks)
            assert acted and all(f"{oracle.KIND[h['relation']]}" in read and h["fact"] in read for h in new), thought
            assert bool(read) == bool(new)
            if not held:
                skeleton = " Nothing is found yet, so I must search. "
            else:  # the facts are quoted in the context already: those found before this turn are named only
                gives = ["one of two", "two of two"][len(held) - 1] if comparison else oracle.KIND[held[-1]["relation"]]
                before = " and ".join(f"the {oracle.KIND[h['relation']]} of {h['search']}" for h in held if h not in new)
                choice = "can answer" if len(held) == len(chain) else "must search"
                skeleton = (f" {f'Before that I found {before}. ' if before else ''}"
                            f"That {'is' if comparison else 'gives the'} {gives}, so I {choice}. ")
            assert acted.startswith(skeleton), (acted, skeleton)
            assert ("\\boxed{" in turn["generation"]) == (len(held) == len(chain))
            searched += turn.get("queries", [])


@pytest.mark.parametrize("which", ["memsearcher", "react"])
def test_oracle_solves_at_least_95_percent_of_a_worlds_training_questions(which, toy, tokenizer):
    """Every training question of the toy world, acted out by the oracle for either agent, with a
    search tool that finds the passage titled as the query (retrieval's own misses aside:
    `python toy/oracle.py --agent react --n 2000` measures them with the real retriever)."""
    import agent
    from toy import oracle

    settings = agent.RolloutSettings(agent=which)
    kept, stats = oracle.make_demonstrations(toy["train"], fake_search(toy["corpus"]), tokenizer, settings, seed=0, batch_size=500)
    assert stats["offered"] == 2000 and stats["kept"] >= 0.95 * 2000, stats
    assert all(v["kept"] >= 0.95 * v["offered"] for v in stats["by_type"].values()), stats["by_type"]
    # and their generations fit the toy preset's --max_new_tokens 128, but for a few double searches
    # (ReAct's turns once restated every fact found: 8% ran past 128, and its warm start's answers were cut)
    lengths = [len(list(g)) for t in kept for c in t.conversations for m, g in itertools.groupby(c.loss_mask) if m]
    over = sum(n > 128 for n in lengths)
    assert over <= 0.002 * len(lengths), f"{over} of {len(lengths)} generations over 128 tokens"


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


@pytest.mark.parametrize("which", ["memsearcher", "react"])
def test_oracle_loss_masks_match_a_replayed_rollout(which, demos, react_demos, toy, tokenizer):
    """Replaying the demonstration's sampled tokens through agent.rollout gives the same prompts,
    responses and loss masks: the oracle's samples are exactly what RL would record, and every
    tool response (with the assistant header after it) is hidden from the loss, for either agent."""
    import agent

    rows, trajectories, _ = demos if which == "memsearcher" else react_demos
    settings = agent.RolloutSettings(agent=which)
    end = tokenizer.convert_tokens_to_ids(agent.END_OF_TURN)
    for r, demo in zip(rows, trajectories):
        queue = [span for c in demo.conversations for span in sampled_spans(c)]
        assert all(span[-1] == end for span in queue)

        def replay(model, tok, prompts, **sampling):
            outs = [queue.pop(0) for _ in prompts]
            return [agent.Generation(ids=ids, logprobs=[0.0] * len(ids), finished=True) for ids in outs]

        (t,) = agent.rollout(None, tokenizer, [r], fake_search(toy["corpus"]), settings, generate_fn=replay)
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
            trained = tokenizer.decode([i for i, m in zip(d.response_ids, d.loss_mask) if m], skip_special_tokens=False)
            assert "<tool_response>" not in trained and "Doc 1(Title:" not in trained
        shown = sum(tokenizer.decode(d.response_ids, skip_special_tokens=False).count("<tool_response>") for d in demo.conversations)
        assert shown == demo.num_searches >= 1  # every search's response is in a conversation, masked
    assert any(len(d.conversations) == 1 and d.num_searches >= 2 for d in trajectories) == (which == "react")


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


# --- what a policy did, by question type (toy/rl_worlds.py), by hand ---------------------------
def rl_worlds():
    """toy/rl_worlds.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("rl_worlds", os.path.join(ROOT, "toy", "rl_worlds.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare_agents():
    """toy/compare_agents.py as a module (it imports toy/rl_worlds.py by its bare name)."""
    spec = importlib.util.spec_from_file_location("compare_agents", os.path.join(ROOT, "toy", "compare_agents.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agents_compared_by_hand(tmp_path):
    """toy/compare_agents.py's report from a results folder written by hand: in every world a bridge
    (chain A -> B) and a single-hop question (C). MemSearcher goes from a malformed bridge to a right
    one (F1 0 -> 1); ReAct from 0 to 0.5; single-hop questions are right throughout. Paired
    MemSearcher - ReAct after GRPO: bridge +0.5, single 0, so +0.25 pooled over 6 questions. The
    context at turn 3 is 310 tokens against ReAct's 1,300 (ratio 0.24); peak memory 2.0 vs 2.5 GB."""
    cmp = compare_agents()

    def q(qid, kind, f1, reward, queries, context):
        return {"dataset": "test", "id": qid, "prediction": "x", "em": float(f1 == 1), "f1": f1, "acc": float(f1 == 1),
                "reward": reward, "end_reason": "answer", "num_turns": len(context), "num_searches": sum(map(len, queries)),
                "context_tokens": context, "type": kind, "chain": ["A", "B"] if kind == "bridge" else ["C"], "queries": queries}
    single = q("s", "single", 1.0, 1.0, [["C"], []], [300, 310])
    policies = {("memsearcher", 0): [dict(q("b", "bridge", 0.0, 0.0, [["A"]], [300, 320]), hop1_in_memory=False), single],
                ("memsearcher", 8): [dict(q("b", "bridge", 1.0, 1.0, [["A"], ["B"], []], [300, 320, 310]), hop1_in_memory=True), single],
                ("react", 0): [q("b", "bridge", 0.0, 0.1, [["A"], []], [300, 800]), single],
                ("react", 8): [q("b", "bridge", 0.5, 0.5, [["A"], ["b"], []], [300, 800, 1300]), single]}
    for world in cmp.WORLDS:
        for (name, step), rows in policies.items():
            cmp.write_jsonl(str(tmp_path / name / world / f"test-{step}.jsonl"), rows)
        for name, peak in (("memsearcher", 2.0), ("react", 2.5)):
            cmp.write_jsonl(str(tmp_path / name / world / "metrics.jsonl"), [{"phase": "warm_start", "step": 1}] + [
                {"phase": "grpo", "step": s, "seconds_rollout": 60.0, "seconds_reference": 10.0, "seconds_update": 50.0,
                 "peak_memory_gb": peak, "peak_update_gb": 1.0, "context_tokens_mean": 500} for s in (1, 2)])
            cmp.write_json(str(tmp_path / name / world / "oracle.json"), {"offered": 2000, "kept": 1990 if name == "react" else 2000})
    got = cmp.load_results(str(tmp_path), 8)
    assert len(got["memsearcher", "pool", 8]) == 6 and ("react", "pool", 0) in got
    d, (lo, hi) = cmp.paired(got["react", "pool", 8], got["memsearcher", "pool", 8])
    assert d == pytest.approx(0.25) and 0 <= lo <= 0.25 <= hi <= 0.5
    b = cmp.behaviour(got["react", "toy", 8])
    assert b["format_valid"][0] == 1.0 and b["searches"][0] == 1.5 and b["types"]["bridge"]["hop2_searched"] == 1.0  # "b" names B
    assert cmp.behaviour(got["memsearcher", "toy", 0])["format_valid"][0] == 0.5
    assert cmp.context_by_turn(got["react", "pool", 8]) == {1: 300, 2: 555, 3: 1300}
    goals = "\n".join(cmp.goals(got, str(tmp_path), 8))
    assert "ReAct toy 1990/2000" in goals and "2000: **met**" in goals  # 99.5% >= 95%
    assert "warm starts format-valid ≥ 0.8 on test" in goals and "MemSearcher toy 0.50" in goals and "ReAct seed3 1.00: **not met**" in goals
    assert "+0.250 [+0.083, +0.417]" in goals and "(upper end ≥ 0): **met**" in goals  # the bootstrap over 3 x (0.5, 0)
    assert "MemSearcher 310, ReAct 1300 tokens, ratio 0.24 (goal ≤ 0.5): **met**" in goals
    assert "MemSearcher 2.00 GB, ReAct 2.50 GB: lower for MemSearcher: **met**" in goals and "120 s vs 120 s" in goals
    assert goals.count("bridges search hop 2 0% → 100%, single-hop searches 1.00 → 1.00: yes") == 2  # both agents
    table = "\n".join(cmp.table(got, 8))
    assert "| pool (6 q) | MemSearcher | GRPO 8 steps | 1.00 |" in table
    assert table.count("| – | 0% / 0% |") == 4 and table.count("| 100% / 100% |") == 4  # MemSearcher, each world and the pool
    assert table.count("| – | – / 0% |") == 4 and table.count("| – / 100% |") == 4  # ReAct: no memory; its "b" names B
    # warm starts alike (F1 0 and 1 for both); after GRPO EM: the bridge 1 - 0, F1: 1 - 0.5; gains 1 - 0.5 on the bridge
    assert "| pool | +0.000 [+0.000, +0.000] | +0.500 [+0.167, +0.833] | +0.250 [+0.083, +0.417] | +0.250 [+0.083, +0.417] |" in table
    assert [g["f1"] for g in cmp.gains(got["react", "toy", 0], got["react", "toy", 8])] == [0.5, 0.0]
    readme = cmp.readme_table(got, 8)
    assert readme[0] == cmp.README_HEADER and len(readme) == 2 + 8  # 3 worlds and the pool, 2 agents
    assert "| pool (6 q) | MemSearcher | 0.50 / 0.50 | 1.00 / 1.00 [1.00, 1.00] | +0.500 [+0.167, +0.833] | +0.250 [+0.083, +0.417] |" in readme
    assert "| toy (2 q) | ReAct | 0.50 / 0.50 | 0.50 / 0.75 [0.50, 1.00] | +0.250 [+0.000, +0.500] | – |" in readme
    cmp.plot(got, str(tmp_path), 8, str(tmp_path / "figures"))
    assert {p.name for p in (tmp_path / "figures").iterdir()} == {"agents_context_per_turn.png", "agents_step_cost.png", "agents_f1.png"}
    # while ReAct has only toy: no pool for ReAct, the agents compared on toy alone, every verdict "so far"
    for world in ("seed2", "seed3"):
        for step in (0, 8):
            (tmp_path / "react" / world / f"test-{step}.jsonl").unlink()
    cmp.write_jsonl(str(tmp_path / "react" / "toy" / "test-8.jsonl"), policies["react", 8][:1])  # the bridge alone
    goals = "\n".join(cmp.goals(cmp.load_results(str(tmp_path), 8), str(tmp_path), 8))
    assert "pooled F1, MemSearcher − ReAct" not in goals and "ReAct's pooled gain" not in goals
    assert "ReAct seed2" not in goals.split("\n")[1].split(":")[1]  # the warm starts on file: no ReAct seed2
    assert ("after GRPO (toy): MemSearcher 310, ReAct 1300 tokens, ratio 0.24 (goal ≤ 0.5): **met** so far "
            "(waiting on ReAct seed2, ReAct seed3)") in goals
    assert "lower for MemSearcher: **met** so far (waiting on ReAct seed2, ReAct seed3)" in goals
    with pytest.raises(SystemExit, match="no results folder"):
        cmp.main(["report", "--results", str(tmp_path / "nowhere")])


def test_world_behaviour_by_type_by_hand():
    """F1 and searches per type, end reasons, and a bridge's second hop counted only once the first
    hop's answer reached the memory; a prediction of another world's question is refused."""
    worlds = rl_worlds()
    hop = lambda name, pid, answer: {"search": name, "passage_id": pid, "answer": answer}  # noqa: E731
    chain = [hop("Mabeland", "7", "Ithstad"), hop("Ithstad", "8", "38,206")]
    rows = {"s": {"metadata": {"type": "single", "chain": [hop("Osk", "9", "1911")]}},
            "b1": {"metadata": {"type": "bridge", "chain": chain}}, "b2": {"metadata": {"type": "bridge", "chain": chain}}}
    passages = {"7": "Mabeland has its capital in Ithstad.", "8": "It has 38,206 people.", "9": "Osk was built in 1911."}
    first = {"queries": ["Mabeland"], "documents": ["Mabeland has its capital in Ithstad."], "memory": "Capital: Ithstad."}
    p = lambda qid, f1, searches, end, turns: {"id": qid, "f1": f1, "em": float(f1 == 1), "reward": 1.0 if end == "answer" else 0.0,  # noqa: E731
                                              "num_searches": searches, "end_reason": end, "turns": turns}
    predictions = [p("s", 1.0, 1, "answer", []),
                   p("b1", 0.5, 2, "answer", [first, {"queries": ["ithstad population"], "documents": [], "memory": ""}]),
                   p("b2", 0.0, 5, "max_turns", [{**first, "memory": "nothing kept"}, {"queries": ["Ithstad"]}])]
    b = worlds.behaviour(predictions, rows, passages)
    assert b["n"] == 3 and b["ends"] == {"answer": 2, "max_turns": 1} and b["turn_limit"] == pytest.approx(1 / 3)
    assert b["f1"][0] == pytest.approx(0.5) and b["format_valid"][0] == pytest.approx(2 / 3)
    assert b["types"]["single"] == {"n": 1, "f1": 1.0, "searches": 1.0}
    # b2 searched Ithstad too, but hop 1's answer never reached its memory: only b1 counts
    assert b["types"]["bridge"] == {"n": 2, "f1": 0.25, "searches": 3.5, "hop2_searched": 0.5}
    assert b["types"]["comparison"]["n"] == 0
    with pytest.raises(SystemExit, match="not a question of this world"):
        worlds.behaviour([p("other", 0.0, 0, "answer", [])], rows, passages)


def test_world_goals_read_by_hand():
    """toy/rl_worlds.goals: each of the issue's goals from the table's figures, met or not."""
    worlds = rl_worlds()

    def policy(em, limit, valid, hop2, single_searches, f1s):
        types = {k: {"f1": f, "searches": single_searches if k == "single" else 2.0} for k, f in zip(worlds.TYPES, f1s)}
        types["bridge"]["hop2_searched"] = hop2
        return {"em": (em, [0, 1]), "turn_limit": limit, "format_valid": (valid, [0, 1]), "types": types}
    stats = {("toy", 0): policy(0.28, 0.05, 0.95, 0.23, 1.2, (0.5, 0.1, 0.2)), ("toy", 8): policy(0.33, 0.0, 0.97, 0.30, 1.1, (0.5, 0.2, 0.3)),
             ("seed2", 0): policy(0.25, 0.0, 0.99, 0.0, 1.0, (0.5, 0.0, 0.1)), ("seed2", 8): policy(0.30, 0.0, 0.96, 0.2, 1.0, (0.6, 0.1, 0.1)),
             ("seed3", 0): policy(0.09, 0.78, 0.21, 0.52, 4.0, (0.2, 0.0, 0.0)), ("seed3", 8): policy(0.20, 0.40, 0.60, 0.60, 3.0, (0.3, 0.0, 0.1)),
             ("pool", "diff"): (0.05, [0.01, 0.09])}
    lines = worlds.goals(stats, 8)
    assert "lower bound +0.010: **met**" in lines[0]
    assert "spread 0.13): **not met**" in lines[1]  # 0.33, 0.30, 0.20
    assert "0.78 → 0.40: **not met**" in lines[2]  # 0.40 > 0.39
    assert lines[3].endswith("**met**") and "0.97, 0.96, 0.60: **not met**" in lines[4]
    stats["seed2", 8]["types"]["single"]["searches"] = 1.5  # single-hop questions now search more in one world
    assert worlds.goals(stats, 8)[3].endswith("**not met**")
    # the curve's checkpoints, evaluated coarse to fine: every even step once
    assert worlds.coarse_to_fine(16) == [0, 16, 8, 4, 12, 2, 6, 10, 14] and worlds.coarse_to_fine(0) == [0]
    assert sorted(worlds.coarse_to_fine(6)) == [0, 2, 4, 6]


def test_world_table_pairs_each_world_and_pools_only_whole_worlds(tmp_path, monkeypatch):
    """toy/rl_worlds.world_table: a world with both policies evaluated gets its paired difference
    and joins the pool; one with only its warm start evaluated shows that row alone, outside the pool."""
    worlds = rl_worlds()
    monkeypatch.setattr(worlds, "WORLDS", {"toy": 0, "seed2": 2})
    monkeypatch.setattr(worlds, "world_data", lambda out, world: os.path.join(ROOT, "data", "toy"))
    first, second = [json.loads(line) for line in open(os.path.join(ROOT, "data", "toy", "test.jsonl"))][:2]
    p = lambda world, row, f1: {"dataset": world, "id": row["id"], "f1": f1, "em": f1, "acc": f1, "reward": 1.0,  # noqa: E731
                                "num_searches": 1, "end_reason": "answer", "turns": []}
    for world, step, f1s in (("toy", 0, (0.0, 1.0)), ("toy", 8, (1.0, 1.0)), ("seed2", 0, (0.5, 0.5))):
        folder = tmp_path / "eval" / world / f"test-{step}"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text("{}")
        (folder / "predictions.jsonl").write_text("".join(json.dumps(p(world, r, f)) + "\n" for r, f in zip((first, second), f1s)))
    lines, stats = worlds.world_table(str(tmp_path), 8)
    toy_warm, toy_grpo, seed2_warm, seed2_grpo, pool = lines[2:]
    assert toy_warm.split(" | ")[5] == "–" and toy_grpo.split(" | ")[5].startswith("+0.500 [")  # mean of (1 - 0, 1 - 1)
    assert seed2_warm.startswith("| seed2 | warm start | 1.00 |") and seed2_warm.split(" | ")[5] == "–"
    assert seed2_grpo.startswith("| seed2 | GRPO 8 steps: not evaluated yet |") and ("seed2", 8) not in stats
    assert pool.startswith("| pool of 2 (1 of 2 worlds) |") and "0.50 [" in pool and "→ 1.00 [" in pool
    assert stats["pool", "diff"][0] == pytest.approx(0.5)


def test_world_training_rewards_read_only_grpo_rows(tmp_path):
    """toy/rl_worlds.training_rewards: the curve figure's right panel, (step, reward) of GRPO rows;
    a last line still being written is skipped."""
    worlds = rl_worlds()
    rows = [{"phase": "warm_start", "step": 1, "loss": 1.6}, {"phase": "grpo", "step": 1, "reward": 0.25},
            {"phase": "grpo", "step": 2, "reward": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"phase": "grpo", "st')  # being written
    assert worlds.training_rewards(str(tmp_path / "metrics.jsonl")) == [(1, 0.25), (2, 0.5)]
    assert worlds.training_rewards(str(tmp_path / "missing.jsonl")) == []


def test_a_try_is_reported_paired_against_the_plain_run(tmp_path):
    """toy/rl_worlds.tries: a try's validation row, F1 paired against the plain run's policy at
    the same step on the same questions, its flags and training rewards; one not yet evaluated says so."""
    worlds = rl_worlds()
    first, second = [json.loads(line) for line in open(os.path.join(ROOT, "data", "toy", "train.jsonl"))][1900:1902]
    p = lambda row, f1: {"dataset": "validation", "id": row["id"], "f1": f1, "em": f1, "acc": f1, "reward": 1.0, "num_searches": 1,  # noqa: E731
                         "end_reason": "answer", "turns": []}
    for folder, f1s in (("validation-8", (0.0, 1.0)), ("try-warm-8", (1.0, 1.0))):
        (tmp_path / "eval" / "toy" / folder).mkdir(parents=True)
        (tmp_path / "eval" / "toy" / folder / "results.json").write_text("{}")
        (tmp_path / "eval" / "toy" / folder / "predictions.jsonl").write_text(
            "".join(json.dumps(p(row, f1)) + "\n" for row, f1 in zip((first, second), f1s)))
    for name in ("try-warm", "try-later"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "flags.txt").write_text("--kl_coef 0.001\n")
    (tmp_path / "try-warm" / "metrics.jsonl").write_text(json.dumps({"phase": "grpo", "step": 1, "reward": 0.25}) + "\n")
    (tmp_path / "try-warm.log").write_text("a try's log, kept beside its folder, is not a try\n")
    header, _, later, warm = worlds.tries(str(tmp_path), 8)
    assert "paired F1 − plain GRPO" in header and later.startswith("| try-later | not evaluated yet |")
    cells = [c.strip() for c in warm.split("|")[1:-1]]
    assert cells[0] == "try-warm (`--kl_coef 0.001`)" and cells[1] == "1.00" and cells[2].startswith("1.00 [")
    assert cells[3].startswith("+0.500 [") and cells[-1] == "0.25"  # mean of (1 - 0, 1 - 1)
    assert worlds.tries(str(tmp_path / "nothing"), 8) == []


# --- the warm start on oracle demonstrations (docs/design.md) -----------------------------------
def warm_args(tiny_lm_dir, world, out, **extra):
    """The tiny model on the demo world with the embedded encoder: warm start only, unless told."""
    args = dict(corpus=world / "corpus.jsonl", encoder="default", train_data=world / "train.jsonl", max_steps=0,
                warm_start_steps=24, warm_start_batch=4, warm_start_lr=1e-2, warm_start_questions=8,
                warm_start_mix="7:1:0")  # all 8 train rows of demo_world: 7 single-hop, 1 bridge
    args.update(extra)
    return base_args(tiny_lm_dir, None, None, out, **args)


def demonstration_fit(model, conversations, pad_id):
    """(token-mean NLL, top-1 accuracy) over the loss masks, teacher-forced: what the warm start
    minimises, and how often the model's greedy next token is the demonstrated one."""
    ids, attn, _, f = train.grpo.pad_batch(conversations, pad_id, "cpu", ("loss_mask",))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    target, mask = ids[:, 1:], f["loss_mask"][:, 1:]
    nll = -torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
    hits = (logits.argmax(-1) == target).float()
    return float((nll * mask).sum() / mask.sum()), float((hits * mask).sum() / mask.sum())


def test_warm_start_lowers_heldout_nll_and_teaches_the_format(tiny_lm_dir, tokenizer, demo_world, tmp_path):
    import retriever
    from toy import oracle

    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["phase"] for r in rows] == ["warm_start"] * 24 and [r["step"] for r in rows] == list(range(1, 25))
    assert sum(r["loss"] for r in rows[-4:]) < 0.5 * sum(r["loss"] for r in rows[:4])
    assert not any(p.startswith("checkpoint-") for p in os.listdir(tmp_path))  # --max_steps 0: warm start only
    warm = AutoModelForCausalLM.from_pretrained(tmp_path / "warm_start").eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dir).eval()
    search = retriever.open_retriever(str(demo_world / "corpus.jsonl"), doc_format="release")
    heldout, stats = oracle.make_demonstrations(oracle.load_rows(demo_world / "heldout.jsonl"), search, tokenizer,
                                                agent.RolloutSettings(max_turns=3))
    assert stats["kept"] == 4  # questions never trained on
    conversations = [c for t in heldout for c in t.conversations]
    (nll_before, acc_before), (nll_after, acc_after) = (demonstration_fit(m, conversations, tokenizer.pad_token_id)
                                                        for m in (base, warm))
    assert nll_after < 0.8 * nll_before
    assert acc_before < 0.01 and acc_after > 0.3  # the demonstrated format, token by token, on unseen questions


def test_react_runs_the_toy_recipe_warm_start_then_grpo(tiny_lm_dir, demo_world, tmp_path):
    """train.py --agent react with the toy recipe: ReAct demonstrations (one conversation each) for
    the warm start, the oracle in unsolved groups, then 2 GRPO steps, metrics and a checkpoint."""
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path, agent="react", warm_start_steps=2, max_steps=2, batch_size=2,
                         group_size=2, mini_batch_size=2, max_turns=3, max_new_tokens=24, oracle_per_group=1))
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["phase"] for r in rows] == ["warm_start"] * 2 + ["grpo"] * 2
    for r in rows[2:]:  # a tiny random model solves nothing: the oracle's ReAct trajectory joins each group;
        # one conversation each: (4 sampled + 2 oracle) trained conversations per 4 sampled trajectories
        assert r["oracle_trajectories"] == 2 and r["oracle_reward"] == 1.0 and r["conversations_per_trajectory"] == 1.5
    assert (tmp_path / "checkpoint-2" / "model.safetensors").exists()
    assert json.load(open(tmp_path / "checkpoint-2" / "trainer_state.json"))["args"]["agent"] == "react"
    oracle = [json.loads(line) for line in open(tmp_path / "samples.jsonl") if json.loads(line)["oracle"]]
    assert oracle and all(len(s["conversations"]) == 1 and s["reward"] == 1.0 for s in oracle)
    (c,) = oracle[0]["conversations"]  # one growing conversation: sampled turns trained, tool responses not
    assert 0 < sum(c["loss_mask"]) < len(c["tokens"])


def test_a_warm_start_mix_the_data_cannot_fill_fails_clearly(tiny_lm_dir, demo_world, tmp_path):
    """demo_world's 8 train rows hold 7 single-hop questions, 1 bridge and no comparison."""
    with pytest.raises(SystemExit, match=r"--warm_start_mix 1:1:1: too few .*'bridge': '1 of 3', 'comparison': '0 of 2'"):
        train.main(warm_args(tiny_lm_dir, demo_world, tmp_path, warm_start_mix="1:1:1"))
    assert not (tmp_path / "warm_start").exists()


def test_resume_after_warm_start_continues_exactly(tiny_lm_dir, demo_world, tmp_path, monkeypatch):
    """A straight run (warm start, then 1 GRPO step) equals a warm-start-only run resumed for the
    GRPO step; the resumed run does not warm-start again, and its KL reference is the warm start."""
    common = dict(warm_start_steps=3, kl_coef=0.01, old_logprobs="recorded", batch_size=2, group_size=2, max_turns=2)
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "straight", max_steps=1, **common))
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "resumed", max_steps=0, **common))
    references = []  # with recorded old log-probs, response_logprobs runs for the KL reference only
    original = train.grpo.response_logprobs
    monkeypatch.setattr(train.grpo, "response_logprobs", lambda model, *a: references.append(
        {k: v.clone() for k, v in model.state_dict().items()}) or original(model, *a))
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "resumed", max_steps=1, resume=True, **common))
    a, b = state(tmp_path / "straight" / "checkpoint-1"), state(tmp_path / "resumed" / "checkpoint-1")
    assert all(torch.equal(a[k], b[k]) for k in a)
    warm = state(tmp_path / "resumed" / "warm_start")
    assert len(references) == 1 and all(torch.equal(references[0][k], warm[k]) for k in warm)
    phases = [json.loads(line)["phase"] for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert phases == ["warm_start"] * 3 + ["grpo"]


def test_warm_start_on_two_processes_equals_one(tiny_lm_dir, demo_world, tmp_path):
    """Two ranks split each step's demonstrations unequally in tokens; the pooled token-mean gives
    the same update as one process, and both ranks stay identical."""
    common = dict(warm_start_steps=2, warm_start_lr=1e-3)
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "one", **common))
    r0, r1 = run_two_processes(warm_args(tiny_lm_dir, demo_world, tmp_path / "two", **common))
    assert all(torch.equal(r0["params"][k], r1["params"][k]) for k in r0["params"])
    one = state(tmp_path / "one" / "warm_start")
    for k in one:  # AdamW divides each gradient by its own scale, so where a gradient is near zero the
        # order of a float32 sum shows as up to ~0.1% of one 1e-3 step: allow 1% of a step
        torch.testing.assert_close(r0["params"][k], one[k], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The small-budget recipe: oracle in the group, evidence credit, skipped groups, bf16, warm-start resume
# ---------------------------------------------------------------------------------------------
def test_oracle_trajectories_join_each_group(tiny_lm_dir, demo_world, tmp_path, monkeypatch):
    """G 2 sampled answers `yes` (well-formed, wrong: reward 0.1) + K 1 oracle (reward 1) per group:
    rewards [0.1, 0.1, 1] -> mean 0.4, unbiased std sqrt((0.09 + 0.09 + 0.36) / 2) = 0.5196
    -> advantages [-0.5774, -0.5774, 1.1547]. The metrics keep the samples apart from the oracle."""
    calls = recording_advantages(monkeypatch)
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path, warm_start_steps=0, max_steps=1, batch_size=2,
                         group_size=2, mini_batch_size=2, max_turns=3, oracle_per_group=1),
               generate_fn=answering(lambda question: "yes"))
    (rewards, ids, advantages), = calls
    assert len(set(ids)) == 2 and all(ids.count(q) == 3 for q in ids)
    for q in set(ids):
        members = [k for k, i in enumerate(ids) if i == q]
        assert [rewards[k] for k in members] == pytest.approx([0.1, 0.1, 1.0])
        assert advantages[members].tolist() == pytest.approx([-0.57735, -0.57735, 1.1547], abs=1e-4)
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["reward"] == pytest.approx(0.1) and row["oracle_trajectories"] == 2 and row["oracle_reward"] == 1.0
    assert row["equal_reward_groups"] == 0 and row["skipped_trajectories"] == 0
    # samples.jsonl (--sample_groups 1): the first group whole, the oracle marked, each with its advantage
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert [(s["member"], s["oracle"], s["trained"]) for s in samples] == [(0, False, True), (1, False, True), (2, True, True)]
    assert len({s["group"] for s in samples}) == 1 and {"step", "question", "reward", "end_reason", "turns"} <= set(samples[0])
    assert [s["advantage"] for s in samples] == pytest.approx([-0.57735, -0.57735, 1.1547], abs=1e-4)
    assert [s["shaped_reward"] for s in samples] == pytest.approx([0.1, 0.1, 1.0])
    for s in samples:
        *searching, final = s["conversations"]
        for c in s["conversations"]:
            assert len(c["tokens"]) == len(c["loss_mask"]) == len(c["logprobs"]) and c["prompt_tokens"] > 0
            assert all(lp <= 0 for lp in c["logprobs"]) and any(lp < 0 for lp in c["logprobs"])  # pi_old's, oracle included
        assert all(0 < sum(c["loss_mask"]) < len(c["tokens"]) for c in searching)  # the tool response is masked
        assert all(final["loss_mask"])  # the answer: sampled tokens only


def test_oracle_only_where_unsolved(tiny_lm_dir, demo_world, tmp_path, monkeypatch):
    """--oracle_when_unsolved: a group with a sampled reward of 1 gets no oracle trajectory."""
    rows = [json.loads(line) for line in open(demo_world / "train.jsonl")][:2]
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = rows[0]["question"]
    calls = recording_advantages(monkeypatch)
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path, warm_start_steps=0, max_steps=1, batch_size=2, group_size=2,
                         mini_batch_size=2, max_turns=3, oracle_per_group=2, oracle_when_unsolved=True,
                         train_data=tmp_path / "two.jsonl"),
               generate_fn=answering(lambda q: rows[0]["golden_answers"][0] if q == first else "nothing"))
    (rewards, ids, _), = calls
    assert sorted(ids.count(q) for q in set(ids)) == [2, 4]  # solved: G 2 only; unsolved: G 2 + K 2
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["oracle_trajectories"] == 2 and row["equal_reward_groups"] == 0.5  # the solved group: 1.0, 1.0


def test_evidence_credit_in_the_reward(tiny_lm_dir, demo_world, tmp_path, monkeypatch):
    """reward = (1 - lambda) released + lambda share of supporting passages retrieved, by hand from
    each trajectory's retrieved ids; lambda = 0 gives exactly the released reward."""
    import scripted_policy
    monkeypatch.setattr(scripted_policy, "RANK", 1)  # searches twice (the question text), then answers
    rows = {str(r["id"]): r for r in map(json.loads, open(demo_world / "train.jsonl"))}
    sampled = []
    rollout = train.agent.rollout
    monkeypatch.setattr(train.agent, "rollout", lambda *a, **k: sampled.append(rollout(*a, **k)) or sampled[-1])
    calls = recording_advantages(monkeypatch)
    for weight in (0.0, 0.5):
        sampled.clear()
        train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / str(weight), warm_start_steps=0, max_steps=1, batch_size=2,
                             group_size=2, mini_batch_size=2, max_turns=3, evidence_weight=weight),
                   generate_fn=scripted_policy.scripted_generate)
        (trajectories,) = sampled
        rewards = calls[-1][0]
        shares = []
        for t in trajectories:
            wanted = set(rows[t.qid]["metadata"]["supporting_ids"])
            seen = {i for turn in t.turns for ids in turn.get("document_ids", []) for i in ids}
            assert len(seen) >= 5  # the retriever's ids reached the trajectory
            shares.append(len(wanted & seen) / len(wanted))
        expected = [(1 - weight) * t.reward + weight * e if weight else t.reward for t, e in zip(trajectories, shares)]
        assert rewards == expected
        row = json.loads(open(tmp_path / str(weight) / "metrics.jsonl").readline())
        assert row["evidence"] == pytest.approx(sum(shares) / len(shares))
        assert row["reward"] == pytest.approx(sum(t.reward for t in trajectories) / len(trajectories))
    assert any(s > 0 for s in shares)  # searching the question's words finds some of its passages


def equal_and_mixed(question, calls=[0]):  # noqa: B006 -- a call counter
    """Questions 0 and 1 are answered `yes` by every trajectory (equal rewards); questions 2 and 3
    get `yes` and `no` in turn (rewards 1 and 0.1)."""
    calls[0] += 1
    return "yes" if int(re.search(r"fact number (\d+)", question).group(1)) < 2 or calls[0] % 2 else "no"


def test_skipping_equal_groups_only_changes_the_denominator(tiny_lm_dir, small_corpus, tiny_encoder_dir, tmp_path,
                                                           monkeypatch):
    """Without KL and entropy, a group of equal rewards has A = 0 and adds nothing to the gradient
    but its tokens to the token-mean's denominator: the gradient with it skipped equals the full
    one times (all trained tokens / kept trained tokens)."""
    path = tmp_path / "four.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": f"Is fact number {i} true?", "golden_answers": ["yes"]})
                            + "\n" for i in range(4)))
    grads, rows = [], []
    monkeypatch.setattr(train.torch.optim.AdamW, "step", lambda self, *a, **k: grads.append(
        [p.grad.clone() for g in self.param_groups for p in g["params"] if p.grad is not None]))
    for skip in (False, True):
        out = tmp_path / f"skip{skip}"
        flags = dict(skip_equal_groups=True) if skip else {}
        train.main(base_args(tiny_lm_dir, small_corpus, tiny_encoder_dir, out, max_steps=1, batch_size=4, group_size=2,
                             mini_batch_size=4, train_data=path, kl_coef=0.0, entropy_coef=0.0, grad_clip=1e9, **flags),
                   generate_fn=answering(equal_and_mixed))
        rows.append(json.loads(open(out / "metrics.jsonl").readline()))
    full, skipped = grads
    assert rows[1]["skipped_trajectories"] == 4 and rows[1]["equal_reward_groups"] == 0.5 and rows[0]["skipped_trajectories"] == 0
    scale = rows[0]["trained_tokens"] / rows[1]["trained_tokens"]
    assert scale > 1.5
    assert any(g.abs().sum() > 0 for g in skipped)
    for a, b in zip(full, skipped):
        torch.testing.assert_close(b, a * scale, rtol=1e-4, atol=1e-9)


def test_an_interrupted_warm_start_resumes_exactly(tiny_lm_dir, demo_world, tmp_path, monkeypatch):
    """Killed during warm-start step 4 of 5 (state saved every 2 steps): --resume continues from
    step 2, ends with the straight run's weights bit for bit, and logs each step once."""
    common = dict(warm_start_steps=5, warm_start_save_every=2)
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "straight", **common))
    update, calls = train.optimizer_update, []

    def dies_at_step_4(*a, **k):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return update(*a, **k)
    monkeypatch.setattr(train, "optimizer_update", dies_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "resumed", **common))
    monkeypatch.setattr(train, "optimizer_update", update)
    assert json.load(open(tmp_path / "resumed" / "warm_start_partial" / "trainer_state.json"))["step"] == 2
    train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / "resumed", resume=True, **common))
    a, b = state(tmp_path / "straight" / "warm_start"), state(tmp_path / "resumed" / "warm_start")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    straight = [json.loads(line) for line in open(tmp_path / "straight" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in rows] == [r["loss"] for r in straight]
    assert not (tmp_path / "resumed" / "warm_start_partial").exists()


def test_the_warm_start_stays_float32_under_bf16(tiny_lm_dir, demo_world, tmp_path):
    """--mixed_precision bf16 autocasts GRPO, not the warm start: its weights equal a float32 run's."""
    from accelerate.state import AcceleratorState

    for precision in ("no", "bf16"):
        AcceleratorState._reset_state(reset_partial_state=True)
        try:
            train.main(warm_args(tiny_lm_dir, demo_world, tmp_path / precision, warm_start_steps=2, mixed_precision=precision))
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
    a, b = state(tmp_path / "no" / "warm_start"), state(tmp_path / "bf16" / "warm_start")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_agents_slim_predictions_by_hand(tmp_path):
    """compare_agents keeps of each prediction what the report reads. On a bridge MemSearcher's
    also says whether a memory held hop 1's answer (any turn's, case aside); ReAct's, with no
    memory, and single-hop questions do not. The slim file is made again on every `run`, so a
    change to `slim` reaches the kept files."""
    cmp = compare_agents()
    chain = [{"search": "Mabeland", "answer": "Ithstad"}, {"search": "Ithstad", "answer": "38,206"}]
    rows = [{"id": "b", "metadata": {"type": "bridge", "chain": chain}},
            {"id": "s", "metadata": {"type": "single", "chain": chain[:1]}}]

    def p(qid, agent_name, memories):
        turns = [{"queries": ["Mabeland"], **({"memory": m} if agent_name == "memsearcher" else {})} for m in memories]
        return {"dataset": "toy", "id": qid, "prediction": "x", "em": 0.0, "f1": 0.0, "acc": 0.0, "reward": 0.1,
                "end_reason": "answer", "num_turns": len(turns), "num_searches": 1, "context_tokens": [9] * len(turns),
                "turns": turns, "run": {"agent": agent_name}, "question": "dropped"}
    kept = cmp.slim(p("b", "memsearcher", ["nothing yet", "Capital: ITHSTAD."]), rows[0])
    assert kept["hop1_in_memory"] is True and kept["chain"] == ["Mabeland", "Ithstad"] and kept["queries"] == [["Mabeland"]] * 2
    assert "question" not in kept and "turns" not in kept and kept["type"] == "bridge"
    assert cmp.slim(p("b", "memsearcher", ["Capital: unknown."]), rows[0])["hop1_in_memory"] is False
    assert "hop1_in_memory" not in cmp.slim(p("b", "react", ["", ""]), rows[0])
    assert "hop1_in_memory" not in cmp.slim(p("s", "memsearcher", ["Ithstad"]), rows[1])

    data, out_dir, kept_path = tmp_path / "world", tmp_path / "eval", tmp_path / "kept" / "test-0.jsonl"
    cmp.write_jsonl(str(data / "test.jsonl"), rows)
    cmp.write_json(str(out_dir / "results.json"), {})  # evaluated already: evaluate_policy only slims
    for memory, expected in (("Capital: Ithstad.", True), ("lost", False)):
        cmp.write_jsonl(str(out_dir / "predictions.jsonl"), [p("b", "memsearcher", [memory]), p("s", "memsearcher", [memory])])
        cmp.evaluate_policy("unused", str(data), str(out_dir), str(kept_path), 1)
        assert [r.get("hop1_in_memory") for r in cmp.read_jsonl(str(kept_path))] == [expected, None]


def test_agents_comparison_resumes_from_its_kept_files(tmp_path, monkeypatch):
    """toy/compare_agents.py run skips every (world, agent) whose small files are all kept, even
    with no run folder left (a fresh clone); the others go through oracle, training and the two
    evaluations, in order, and their metrics are kept."""
    cmp = compare_agents()
    results, out, calls = tmp_path / "results", tmp_path / "runs", []
    for name in cmp.AGENTS:  # toy is done for both agents, seed2 for MemSearcher; ReAct seed2 lacks its step-8 test
        for world in ("toy", "seed2"):
            for f in ("oracle.json", "metrics.jsonl", "test-0.jsonl", "test-8.jsonl"):
                if not (name == "react" and world == "seed2" and f == "test-8.jsonl"):
                    cmp.write_jsonl(str(results / name / world / f), [{"kept": True}])

    def train(out_dir, world, steps, threads, run, extra):
        calls.append(("train", run))
        cmp.write_jsonl(os.path.join(out_dir, run, "metrics.jsonl"), [{"phase": "grpo", "step": steps}])
    monkeypatch.setattr(cmp, "world_data", lambda out_dir, world: calls.append(("data", world)) or world)
    monkeypatch.setattr(cmp, "oracle_counts", lambda world, name, data, path: calls.append(("oracle", f"{name}/{world}")))
    monkeypatch.setattr(cmp, "train", train)
    monkeypatch.setattr(cmp, "evaluate_policy", lambda model, data, out_dir, kept, threads: calls.append(("eval", os.path.relpath(model, out))))
    cmp.main(["run", "--out", str(out), "--results", str(results), "--threads", "1"])
    assert [c for c in calls if c[1].startswith("seed2") or "/seed2" in c[1]] == [
        ("data", "seed2"), ("oracle", "react/seed2"), ("train", "react/seed2"),
        ("eval", "react/seed2/warm_start"), ("eval", "react/seed2/checkpoint-8")]
    assert not [c for c in calls if "toy" in c[1]]  # no world data, oracle, training or evaluation for toy
    assert [c[1] for c in calls if c[0] == "train"] == ["react/seed2", "memsearcher/seed3", "react/seed3"]
    assert cmp.read_jsonl(str(results / "react" / "seed2" / "metrics.jsonl")) == [{"phase": "grpo", "step": 8}]
    assert cmp.finished(str(results / "memsearcher" / "toy"), 8) and not cmp.finished(str(results / "react" / "seed3"), 8)
