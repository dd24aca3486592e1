"""Oracle demonstrations for the embedded default's warm start (docs/design.md, "The warm start").

The toy world records each question's reasoning chain (toy/make_toy.py: per hop, the entity to
search, the fact sentence and its passage, the hop's answer). The oracle is a scripted policy that
acts that chain out through `agent.rollout` itself, with the real search tool, for either agent:
- MemSearcher: each turn it reads the question and the memory from the prompt, searches the next
  hop's entity, writes the hop's fact (labelled with its kind) into the memory, keeping every
  earlier fact, and answers in \\boxed{} once the memory holds the whole chain;
- ReAct: in its one growing conversation it reads which hops it has searched so far from its own
  earlier tool calls, quotes the fact each new result gives, and searches the next hop or answers
  with the same thought skeleton (what it has found stands where the memory stood).
Its demonstrations are therefore `agent.Conversation`s with exactly the prompts, tool-response
turns and loss masks that RL trains on.

A demonstration is kept only if it earns reward 1.0 and every hop's supporting passage was among
the documents the search tool actually returned in that trajectory (so no memory states a fact the
agent never saw).

    import agent, retriever
    from toy import oracle
    rows = oracle.load_rows("data/toy/train.jsonl")
    trajectories, stats = oracle.make_demonstrations(rows[:300], retriever.open_retriever(), tokenizer)

    python toy/oracle.py --n 300                  # measure: how many demonstrations survive, and how fast
    python toy/oracle.py --n 300 --agent react    # the same, acted out in ReAct's one growing conversation
"""
from __future__ import annotations

import json
import os
import random
import re
import sys
import time
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import agent  # noqa: E402

# ---------------------------------------------------------------------------------------------
# 1. Wording: a few templates per move, so the model learns the format rather than one sentence
# ---------------------------------------------------------------------------------------------
# Every thought opens with a fixed skeleton that spells the choice out, then varies its wording.
# It names what the question asks for (`The question asks for the year.`: the kind of the last hop's
# relation, read off the question's wording), reads the memory, says what the memory's latest fact
# gives, and decides: `That gives the founder, so I must search.` / `That gives the year, so I can
# answer.` A comparison counts instead (`That is one of two, so I must search.`). Each search names
# the fact it seeks (`Next I need the year of Ada Mole.`), the memory update names it again as it
# quotes the passage, and the memory keeps each fact under that name (`labelled`), so the kind in
# `That gives the ...` is copied from the memory rather than inferred from a sentence. What a 135M
# model did and did not learn from each earlier wording: docs/learning.md, "The log of tries".
KIND = {  # relation (toy/make_toy.py SPEC) -> what its fact gives; person roles stay apart
    "capital": "capital", "language": "language", "independence": "year", "country": "country",
    "height": "height", "climber": "first climber", "climb_year": "year", "length": "length",
    "source": "mountain", "river": "river", "population": "population", "founded": "year",
    "birth_year": "year", "birthplace": "town", "occupation": "occupation", "employer": "company",
    "spouse": "spouse", "notable_work": "work", "founder": "founder", "hq": "town", "industry": "industry",
    "creator": "creator", "year": "year", "genre": "genre", "location": "town", "organizer": "organiser",
}
COUNT = {1: "one", 2: "two"}
FIRST_SEARCH = [  # after "... The memory is empty, so I must search."; every search names the fact it
    "I will look up the {kind} of {search}.",  # seeks, and the memory update below names it again, so the
    "First I need the {kind} of {search}.",  # update can pick that fact out of the passages
    "I do not know the {kind} of {search} yet, so let me search for it.",
    "I should search for the {kind} of {search} first.",
]
NEXT_SEARCH = [  # after "... That gives the founder, so I must search."
    "Next I need the {kind} of {search}.",
    "I still need the {kind} of {search}.",
    "The missing fact is the {kind} of {search}, so I will search for it.",
]
BOTH_SEARCH = [
    "I need the {kind} of both {a} and {b}, so I will search for each of them.",
    "To compare them I must look up the {kind} of {a} and of {b}.",
]
ANSWER = [  # after "... That gives the year, so I can answer."
    "The answer is {answer}.",
    "It answers the question: {answer}.",
    "Therefore the answer is {answer}.",
]
COMPARE = [
    "Comparing the two: {reason}, so the answer is {answer}.",
    "{Reason}, so the answer is {answer}.",
]
REASON = {  # how two hop answers decide a comparison (metadata "compare")
    "larger": "{win} is more than {other}",
    "smaller": "{win} is earlier than {other}",
    "yes": "both are {win}",
    "no": "{win} and {other} differ",
}
MEMORY_THOUGHT = [  # before the memory: name the fact sought, quote the passage sentence that gives it
    "The passage on {search} gives the {kind}: {fact}",
    "The results for {search} give the {kind}: {fact}",
    "Found the {kind} in the passage on {search}: {fact}",
]
MEMORY_LAYOUT = [  # the memory text, from the list of facts kept so far
    lambda notes: " ".join(notes),
    lambda notes: "\n".join("- " + n for n in notes),
    lambda notes: "Known facts: " + " ".join(notes),
    lambda notes: " ".join(f"({k}) {n}" for k, n in enumerate(notes, 1)),
]


def norm(text: str) -> str:
    """Whitespace-collapsed text, so decoding quirks do not matter when comparing."""
    return " ".join(text.split())


def labelled(hop: dict) -> str:
    """A hop's fact as the memory keeps it, led by the kind of fact it is, e.g. "The capital of
    Casrusavar: Casrusavar has its capital in Yorova." The next turn's "That gives the capital" then
    copies the label of the memory's latest fact instead of inferring its kind from the sentence."""
    return f"The {KIND[hop['relation']]} of {hop['search']}: {hop['note']}"


def load_rows(path: str) -> list[dict]:
    """The question rows of a toy jsonl file as written (id, question, golden_answers, metadata):
    they can go to `agent.rollout` directly, and carry the chains the oracle needs."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------------
# 2. The oracle: a stateless `generate_fn` that reads (question, memory) from each prompt
# ---------------------------------------------------------------------------------------------
def compare_reason(row: dict) -> str:
    """Why a comparison's answer follows from its two hops, e.g. "1,151 is more than 381"."""
    (a, b), answer = row["metadata"]["chain"], row["golden_answers"][0]
    op = row["metadata"].get("compare", "same")
    if op == "same":
        return REASON[answer].format(win=a["answer"], other=b["answer"])
    win, other = (b, a) if norm(b["search"]) == norm(answer) else (a, b)
    return REASON[op].format(win=win["answer"], other=other["answer"])


class Oracle:
    """`agent.rollout`'s `generate_fn` for questions whose rows carry a reasoning chain.

    Which hop comes next is read from the prompt (how many of the chain's facts the memory holds;
    ReAct: which hops its earlier tool calls searched),
    so one oracle serves any number of trajectories in any order. Only the wording is random.
    """

    def __init__(self, rows: list[dict], seed: int = 0, top_n_rate: float = 0.3, together_rate: float = 0.3):
        self.rows = {norm(r["question"]): r for r in rows}
        self.rng = random.Random(seed)
        self.top_n_rate = top_n_rate  # how often a call spells out "top_n": 5
        self.together_rate = together_rate  # how often a comparison searches both entities in one turn

    def __call__(self, model, tokenizer, prompts: list[list[int]], **sampling) -> list[agent.Generation]:
        end = tokenizer.convert_tokens_to_ids(agent.END_OF_TURN)
        outs = []
        for prompt in prompts:
            ids = agent.encode(tokenizer, self.respond(tokenizer.decode(prompt, skip_special_tokens=False))) + [end]
            outs.append(agent.Generation(ids=ids, logprobs=[0.0] * len(ids), finished=True))
        return outs

    def respond(self, text: str) -> str:
        """The oracle's output for one decoded prompt: a first generation or a memory update
        (MemSearcher, whose first user message holds a memory), or ReAct's next turn."""
        user = text.split(agent.START_OF_TURN + "user\n", 1)[1].split(agent.END_OF_TURN)[0]
        question = re.search(r"<question>(.*?)</question>", user, re.S).group(1)
        row = self.rows.get(norm(question))
        if row is None:
            raise KeyError(f"the oracle has no chain for question {question.strip()!r}")
        memory = re.search(r"<memory>(.*?)</memory>", user, re.S)
        if memory is None:
            return self.react_turn(row, text)
        chain = row["metadata"]["chain"]
        held = [h for h in chain if norm(h["note"]) in norm(memory.group(1))]
        if text.rstrip().endswith(agent.THINK):  # first generation: reason, then search or answer
            lead = " " if text.endswith(agent.THINK) else ""  # "<think>" as released; tolerate "<think>\n"
            return lead + self.act(row, held)
        generation = text.split(agent.ASSISTANT_HEADER)[1].split(agent.END_OF_TURN)[0]  # this turn's calls
        queries = [json.loads(body)["arguments"]["query"]
                   for body in re.findall(r"<tool_call>(.*?)</tool_call>", generation, re.S)]
        return self.update_memory(chain, held, queries)

    def react_turn(self, row: dict, text: str) -> str:
        """ReAct's turn: the hops searched so far are those its earlier tool calls named; it quotes
        what the latest results give (as MemSearcher's memory update does), then acts on all of it."""
        chain = row["metadata"]["chain"]
        earlier = [re.findall(r"<tool_call>(.*?)</tool_call>", m, re.S) for m in text.split(agent.ASSISTANT_HEADER)[1:-1]]
        queries = [[json.loads(body)["arguments"]["query"] for body in bodies] for bodies in earlier]
        held = [h for h in chain if any(h["search"] in q for q in queries)]
        found = [h for h in held if queries and h["search"] in queries[-1]]
        read = "".join(self.rng.choice(MEMORY_THOUGHT).format(**h, kind=KIND[h["relation"]]) + " " for h in found)
        lead = " " if text.endswith(agent.THINK) else "<think> "  # the first turn's <think> is prefilled
        return lead + read + self.act(row, held, quoted=found)

    def act(self, row: dict, held: list[dict], quoted: list[dict] | None = None) -> str:
        """Generation 1: search the next hop's entity, or answer once the memory holds every hop.
        ReAct (`quoted`: the facts this turn has just quoted) has no memory: its facts are quoted in
        its turns, so it names those found before this turn instead of restating them, keeping each
        turn within the 128 tokens of the toy preset's --max_new_tokens."""
        react = quoted is not None
        chain, pick = row["metadata"]["chain"], self.rng.choice
        missing = [h for h in chain if h not in held]
        comparison = row["metadata"]["type"] == "comparison"
        thought = "The question compares two things. " if comparison else f"The question asks for the {KIND[chain[-1]['relation']]}. "
        if not held:
            thought += "Nothing is found yet, so " if react else "The memory is empty, so "
        else:
            if react:
                before = [h for h in held if h not in quoted]
                named = " and ".join(f"the {KIND[h['relation']]} of {h['search']}" for h in before)
                thought += f"Before that I found {named}. " if before else ""
            else:
                thought += f"The memory says: {' '.join(labelled(h) for h in held)} "
            gives = f"is {COUNT[len(held)]} of two" if comparison else f"gives the {KIND[held[-1]['relation']]}"
            thought += f"That {gives}, so "
        if not missing:
            answer = row["golden_answers"][0]
            if row["metadata"]["type"] == "comparison":
                reason = compare_reason(row)
                then = pick(COMPARE).format(answer=answer, reason=reason, Reason=reason[:1].upper() + reason[1:])
            else:
                then = pick(ANSWER).format(answer=answer)
            return thought + "I can answer. " + then + " </think>\n" + pick(["\n", ""]) + f"\\boxed{{{answer}}}"
        if len(missing) > 1 and row["metadata"]["type"] == "comparison" and self.rng.random() < self.together_rate:
            then = pick(BOTH_SEARCH).format(a=missing[0]["search"], b=missing[1]["search"], kind=KIND[missing[0]["relation"]])
            searches = [h["search"] for h in missing[:2]]
        else:
            then = pick(NEXT_SEARCH if held else FIRST_SEARCH).format(search=missing[0]["search"],
                                                                      kind=KIND[missing[0]["relation"]])
            searches = [missing[0]["search"]]
        return thought + "I must search. " + then + " </think>\n" + "\n".join(self.call(q) for q in searches)

    def call(self, query: str) -> str:
        arguments = {"query": query}
        if self.rng.random() < self.top_n_rate:
            arguments["top_n"] = agent.DEFAULT_TOP_N
        return "<tool_call>\n" + json.dumps({"name": agent.TOOL_NAME, "arguments": arguments}) + "\n</tool_call>"

    def update_memory(self, chain: list[dict], held: list[dict], queries: list[str]) -> str:
        """Generation 2: the memory with every fact it held, plus the facts of the hops just searched."""
        found = [h for h in chain if h not in held and h["search"] in queries]
        notes = [labelled(h) for h in chain if h in held or h in found]
        thought = " ".join(self.rng.choice(MEMORY_THOUGHT).format(**h, kind=KIND[h["relation"]]) for h in found)
        thought = f"<think> {thought} </think>\n" if found else ""
        return thought + "<memory> " + self.rng.choice(MEMORY_LAYOUT)(notes) + " </memory>"


# ---------------------------------------------------------------------------------------------
# 3. Demonstrations: roll out with the oracle, keep only the ones that are right for the right reason
# ---------------------------------------------------------------------------------------------
def retrieved(hop: dict, documents: list[str]) -> bool:
    """Whether the search results show the hop's passage: one passage titled "<entity>" holding the
    hop's fact sentence (titles are unique names, and a fact sits in one passage). Passages are
    split in either rendering: `Doc k(Title: ...)` lines, or the release's raw contents each
    followed by a literal backslash-n pair."""
    title = f'"{hop["search"]}"'
    passages = (p for doc in documents for p in re.split(r"\\n\\n|\n(?=Doc \d+\(Title: )", doc))
    return any(title in p and hop["fact"] in p for p in passages)


def drop_reason(trajectory: agent.Trajectory, chain: list[dict]) -> str | None:
    """Why a demonstration is not kept, or None to keep it."""
    if trajectory.reward != 1.0:
        return f"reward<1 ({trajectory.end_reason})"
    documents = [d for turn in trajectory.turns for d in turn.get("documents", [])]
    if not all(retrieved(h, documents) for h in chain):
        return "support not retrieved"
    return None


def pick_questions(rows: list[dict], n: int, mix: dict[str, float]) -> list[dict]:
    """The first rows of each question type, in file order, `n` in all in the shares `mix` gives,
    e.g. {"single": 1, "bridge": 2, "comparison": 1}: 25 single-hop, 50 bridge and 25 comparison
    questions of n = 100. A type left out of `mix` (or given 0) is not taken. Raises ValueError
    when the rows hold too few questions of a type. The result keeps the rows' order."""
    if any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"question-type shares must be >= 0 and not all 0, got {mix}")
    total, quota, given = sum(mix.values()), {}, 0
    for k, (kind, w) in enumerate(mix.items()):  # rounded shares; the last type takes what is left
        quota[kind] = n - given if k == len(mix) - 1 else round(n * w / total)
        given += quota[kind]
    taken, picked = Counter(), []
    for row in rows:
        kind = row["metadata"]["type"]
        if taken[kind] < quota.get(kind, 0):
            taken[kind] += 1
            picked.append(row)
    short = {kind: f"{taken[kind]} of {q}" for kind, q in quota.items() if taken[kind] < q}
    if short:
        raise ValueError(f"too few questions of a type for the warm-start mix {mix}: {short}")
    return picked


def make_demonstrations(questions: list[dict], search, tokenizer, settings: agent.RolloutSettings | None = None, *,
                        seed: int = 0, batch_size: int = 64) -> tuple[list[agent.Trajectory], dict]:
    """Oracle trajectories for `questions` (toy rows with `metadata.chain`, e.g. from `load_rows`),
    rolled out by `agent.rollout` with the given search tool and settings (turns, prompts; the
    sampling settings do not apply to the oracle). Returns (kept trajectories, stats): offered, kept, dropped by reason,
    offered/kept by question type, conversations and tokens of the kept ones, seconds."""
    start = time.time()
    oracle = Oracle(questions, seed=seed)
    kept, dropped, by_type = [], Counter(), {}
    for s in range(0, len(questions), batch_size):
        batch = questions[s:s + batch_size]
        trajectories = agent.rollout(None, tokenizer, batch, search, settings, generate_fn=oracle)
        for q, t in zip(batch, trajectories):
            counts = by_type.setdefault(q["metadata"]["type"], {"offered": 0, "kept": 0})
            counts["offered"] += 1
            reason = drop_reason(t, q["metadata"]["chain"])
            if reason:
                dropped[reason] += 1
            else:
                counts["kept"] += 1
                kept.append(t)
    conversations = [c for t in kept for c in t.conversations]
    stats = {"offered": len(questions), "kept": len(kept), "dropped": dict(dropped), "by_type": by_type,
             "conversations": len(conversations), "tokens": sum(len(c) for c in conversations),
             "trained_tokens": sum(sum(c.loss_mask) for c in conversations),
             "seconds": round(time.time() - start, 1)}
    return kept, stats


def group_experts(rows: list[dict], search, tokenizer, k: int, settings: agent.RolloutSettings, *,
                  seed: int) -> list[agent.Trajectory]:
    """Expert bootstrapping for GRPO (train.py --oracle_per_group K; David-GRPO's expert trajectories,
    LUFFY's off-policy guidance): K oracle trajectories for each row whose question has a reasoning
    chain, acted out through `agent.rollout` with the same prompts, tool turns and loss masks as the
    policy's samples. Their qid is the row's, so they join its group and advantages are normalised
    over all G + K rewards.

    The oracle has no log-probs of its own, so the trainer recomputes their old log-probs under the
    current policy: for an oracle token the update starts from

        r_t = pi_theta(x_t) / sg(pi_theta(x_t)) = 1,     grad = -A_i grad log pi_theta(x_t) / N,

    an advantage-weighted likelihood step, clipped like any other token in later mini-batches of
    the step. There is no importance correction for the oracle being the behaviour policy (LUFFY's
    policy shaping would reweight low-probability tokens instead)."""
    rows = [r for r in rows if (r.get("metadata") or {}).get("chain")]
    if not rows or k <= 0:
        return []
    return agent.rollout(None, tokenizer, rows, search, settings, group_size=k, generate_fn=Oracle(rows, seed=seed))


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description="Make oracle demonstrations and report how many survive.")
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "toy", "train.jsonl"))
    ap.add_argument("--corpus", default=None, help="default: the corpus.jsonl beside --data")
    ap.add_argument("--n", type=int, default=300, help="the first n questions")
    ap.add_argument("--max_turns", type=int, default=5)
    ap.add_argument("--agent", default="memsearcher", choices=["memsearcher", "react"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=1, help="print this many kept trajectories")
    args = ap.parse_args(argv)
    import retriever
    from tools import models, trajectory
    from transformers import AutoTokenizer

    folder, name = os.path.split(models.default_model_file())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    search = retriever.open_retriever(corpus=args.corpus or os.path.join(os.path.dirname(args.data), "corpus.jsonl"))
    rows = load_rows(args.data)[:args.n]
    trajectories, stats = make_demonstrations(rows, search, tokenizer, agent.RolloutSettings(max_turns=args.max_turns, agent=args.agent),
                                              seed=args.seed)
    for t in trajectories[:args.show]:
        for k, c in enumerate(t.conversations, 1):
            print(f"===== conversation {k} (⟦⟧ = not trained) =====")
            print(trajectory.render_conversation(c, tokenizer, color=False))
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
