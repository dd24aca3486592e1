"""Benchmark agent.rollout on the embedded default (SmolLM2-135M) and the default toy retriever.

    python bench/rollout.py                              # 16 questions, 128 new tokens per generation
    python bench/rollout.py --questions 8 --max_new_tokens 64

Prints, from one run (best with a warm-started `--model`: an untrained one never searches):
1. rollouts: one batched `rollout` over N questions (MemSearcher, greedy, memory reset on an
   invalid update) with the default agent.CachedGenerate, against N rollouts of one question and
   against the stateless agent.generate (every prompt prefilled whole); per run: generated
   tokens/s, tokens prefilled (and per conversation), seconds of prefill (until the first logits)
   and of decoding, the share of row-steps that made a kept token, and the decoding seconds spent
   on rows that had already stopped (stragglers); whether the runs sampled the same tokens;
2. agent-loop overhead: one raw left-padded `model.generate` over the same first-turn prompts
   (KV cache on, exactly as many new tokens per row as the batched rollout generated on average)
   against the batched rollout, in tokens/s, with the ratio rollout / raw;
3. context tokens per turn (the paper's Figure 3): MemSearcher vs ReAct on the same questions over
   10 turns, with a scripted policy that searches every turn and the real retriever's documents;
   a plot `docs/figures/context_tokens.png` when matplotlib is installed;
4. precision (`--sections 4`, best with a trained `--model`): the batched rollout in float32 against
   bfloat16 weights (evaluate.py --dtype), in tokens/s with the ratio, and how many greedy
   predictions and answers agree;
5. ReAct's prefill at 2, 4 and 8 turns, stateless against cached: the real model is forced token
   by token to emit section 3's scripted searches, so only the prefill differs;
6. continuous batching: transformers' `generate_batch` against one static `generate` on the
   first-turn prompts (greedy), in tokens/s, and whether the greedy tokens agree.

    python bench/rollout.py --sections 4 --model runs/memsearcher
"""
import argparse
import json
import os
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import agent  # noqa: E402
import retriever  # noqa: E402
from tools import models  # noqa: E402
from data.questions import load_questions as question_rows  # noqa: E402


def load_questions(n):
    """The first n rows of the toy test set (a fixed selection)."""
    return question_rows(os.path.join(ROOT, "data", "toy", "test.jsonl"))[:n]


class Timed:
    """A rollout's generate_fn that counts what its calls cost: calls, seconds in generate, seconds
    until the first logits (the prefill), tokens prefilled, and row-steps (rows x decoding steps).
    `cached`: a fresh agent.CachedGenerate per rollout (what rollout(generate_fn=None) makes), whose
    `.prefilled` counts the token positions it prefills, padding included; else the stateless
    agent.generate, which counts nothing: it prefills every prompt whole, left-padded to the longest,
    so a call costs len(prompts) x the longest prompt. `script(prompt_text) -> text` forces what the
    model emits (through the real model and cache)."""

    def __init__(self, stats, cached=True, script=None):
        self.stats, self.inner, self.script = stats, agent.CachedGenerate() if cached else agent.generate, script

    def __call__(self, model, tokenizer, prompts, **sampling):
        if not prompts:
            return []
        original, first, stats = agent.make_recorder, [], self.stats
        forced = [agent.encode(tokenizer, self.script(tokenizer.decode(p))) + [tokenizer.convert_tokens_to_ids(agent.END_OF_TURN)]
                  for p in prompts] if self.script else None

        def make_recorder(temperature):
            recorder, steps = original(temperature), [0]

            def timed(input_ids, scores):
                if not first:
                    first.append(time.perf_counter())
                if forced:  # one possible token per row: the script's next one
                    step, steps[0] = steps[0], steps[0] + 1
                    scores = torch.full_like(scores, -1e4)
                    for i, f in enumerate(forced):
                        scores[i, f[min(step, len(f) - 1)]] = 0.0
                return recorder(input_ids, scores)
            timed.score, timed.logprobs = recorder.score, recorder.logprobs
            return timed

        agent.make_recorder = make_recorder
        cached = isinstance(self.inner, agent.CachedGenerate)
        before, t = self.inner.prefilled if cached else 0, time.perf_counter()
        try:
            out = self.inner(model, tokenizer, prompts, **sampling)
        finally:
            agent.make_recorder = original
        end = time.perf_counter()
        stats["calls"] += 1
        stats["seconds"] += end - t
        stats["prefill_seconds"] += (first[0] if first else end) - t
        stats["prefilled"] += self.inner.prefilled - before if cached else len(prompts) * max(map(len, prompts))
        stats["slots"] += len(prompts) * max((len(g.ids) for g in out), default=0)
        return out


def new_stats():
    return {"calls": 0, "seconds": 0.0, "prefill_seconds": 0.0, "prefilled": 0, "slots": 0}


def sampled_tokens(trajectories):
    return sum(sum(c.loss_mask) for t in trajectories for c in t.conversations)


def sampled_ids(t):
    """The tokens a trajectory's policy sampled, conversation by conversation."""
    return [[i for i, m in zip(c.response_ids, c.loss_mask) if m] for c in t.conversations]


# ---------------------------------------------------------------------------------------------
# 1 + 2. Throughput: batched rollout, one at a time, raw generate
# ---------------------------------------------------------------------------------------------
def run_rollouts(model, tokenizer, questions, search, batches, args, cached=True, agent_name="memsearcher", script=None,
                 max_turns=None, max_new_tokens=None):
    """Roll out `questions` in the given batches -> (trajectories, wall seconds, generate stats)."""
    stats = new_stats()
    trajectories = []
    start = time.perf_counter()
    for batch in batches:
        settings = agent.RolloutSettings(agent=agent_name, greedy=True, max_turns=max_turns or args.max_turns,
                                         max_new_tokens=max_new_tokens or args.max_new_tokens, evaluation=True,
                                         max_memory_tokens=None, max_response_tokens=10**9)
        trajectories += agent.rollout(model, tokenizer, batch, search, settings, generate_fn=Timed(stats, cached, script))
    return trajectories, time.perf_counter() - start, stats


def raw_generate(model, tokenizer, prompts, new_tokens):
    """One left-padded `model.generate`, greedy, exactly `new_tokens` per row -> (tokens, seconds)."""
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(min_new_tokens=new_tokens, max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                              use_cache=True, eos_token_id=agent.stop_token_ids(tokenizer), pad_token_id=pad)
    model.eval()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    return (out.shape[1] - width) * len(prompts), time.perf_counter() - start


def describe(trajectories):
    turns = [t.num_turns for t in trajectories]
    reasons = {}
    for t in trajectories:
        reasons[t.end_reason] = reasons.get(t.end_reason, 0) + 1
    ends = ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
    return f"turns mean {sum(turns) / len(turns):.2f} max {max(turns)}; searches {sum(t.num_searches for t in trajectories)}; ends: {ends}"


def bench_throughput(model, tokenizer, questions, search, args):
    n = len(questions)
    agent.generate(model, tokenizer, [agent.encode(tokenizer, "Hello")] * 2, max_new_tokens=4, greedy=True)  # warm-up
    runs = {f"one rollout over {n}": run_rollouts(model, tokenizer, questions, search, [questions], args),
            f"{n} rollouts of 1": run_rollouts(model, tokenizer, questions, search, [[q] for q in questions], args),
            f"over {n}, stateless": run_rollouts(model, tokenizer, questions, search, [questions], args, cached=False)}
    print(f"\n== 1. Rollouts: {n} questions, MemSearcher, greedy, max_turns {args.max_turns}, max_new_tokens "
          f"{args.max_new_tokens}; CachedGenerate (KV cache kept across tool responses, shared prefix once) unless "
          f"'stateless' (every prompt prefilled whole)")
    print(f"{'run':>24} | {'wall s':>7} | {'gen tokens':>10} | {'tokens/s':>8} | {'calls':>5} | {'prefilled':>9} | "
          f"{'per conv.':>9} | {'prefill s':>9} | {'decode s':>8} | {'useful slots':>12} | {'stragglers s':>12}")
    rows = {}
    for name, (trajectories, secs, st) in runs.items():
        tokens, conversations = sampled_tokens(trajectories), sum(len(t.conversations) for t in trajectories)
        decode = st["seconds"] - st["prefill_seconds"]
        useful = tokens / max(st["slots"], 1)
        rows[name] = dict(tokens=tokens, secs=secs, per_conv=st["prefilled"] / conversations, prefill=st["prefill_seconds"])
        print(f"{name:>24} | {secs:>7.1f} | {tokens:>10} | {tokens / secs:>8.1f} | {st['calls']:>5} | {st['prefilled']:>9} | "
              f"{st['prefilled'] / conversations:>9.0f} | {st['prefill_seconds']:>9.1f} | {decode:>8.1f} | {useful:>12.0%} | "
              f"{decode * (1 - useful):>12.1f}")
    batched, single, stateless = rows.values()
    print(f"batched / one at a time: {batched['tokens'] / batched['secs'] / (single['tokens'] / single['secs']):.2f}x tokens/s")
    print(f"cached / stateless: prefilled tokens per conversation {batched['per_conv'] / stateless['per_conv']:.2f}x, "
          f"prefill seconds {batched['prefill'] / max(stateless['prefill'], 1e-9):.2f}x, wall {batched['secs'] / stateless['secs']:.2f}x")
    (a, _, _), (b, _, _), (c, _, _) = runs.values()
    print(f"identical sampled tokens: batched vs one at a time {sum(sampled_ids(x) == sampled_ids(y) for x, y in zip(a, b))}/{n}, "
          f"cached vs stateless {sum(sampled_ids(x) == sampled_ids(y) for x, y in zip(a, c))}/{n}")
    print(f"batched: {describe(a)}")
    print("(stragglers s: decode seconds x the share of row-steps spent on rows that had already stopped)")

    prompts = [agent.encode(tokenizer, agent.memsearcher_prompt(q["question"], "")) for q in questions]
    per_row = max(1, round(batched["tokens"] / n))
    tok_r, t_raw = raw_generate(model, tokenizer, prompts, per_row)
    rate_b, rate_r = batched["tokens"] / batched["secs"], tok_r / t_raw
    print(f"\n== 2. Agent-loop overhead: batched rollout vs one raw model.generate (batch {n}, left-padded, "
          f"first-turn prompts, {per_row} new tokens per row, KV cache)")
    print(f"{'run':>24} | {'wall s':>7} | {'gen tokens':>10} | {'tokens/s':>8}")
    print(f"{'raw model.generate':>24} | {t_raw:>7.1f} | {tok_r:>10} | {rate_r:>8.1f}")
    print(f"{'batched rollout':>24} | {batched['secs']:>7.1f} | {batched['tokens']:>10} | {rate_b:>8.1f}")
    print(f"rollout / raw: {rate_b / rate_r:.2f}x tokens/s")


def bench_react_prefill(model, tokenizer, questions, search, args):
    """ReAct's prefill against its turns: the real model emits the scripted policy's searches (forced
    token by token through the real generate and cache), so only the prefill differs between runs."""
    print(f"\n== 5. ReAct prefill vs turns: {len(questions)} questions, the real model forced to search every turn "
          f"(section 3's scripted policy), stateless generate vs CachedGenerate")
    print(f"{'turns':>5} | {'stateless prefilled':>19} | {'prefill s':>9} | {'cached prefilled':>16} | {'prefill s':>9} | {'ratio':>6}")
    for turns in (2, 4, 8):
        found = {}
        for cached in (False, True):
            script = scripted_policy("react", args.memory_words)
            policy = lambda text, s=script: tokenizer.decode(s(None, tokenizer, [agent.encode(tokenizer, text)])[0].ids[:-1])  # noqa: E731
            _, _, st = run_rollouts(model, tokenizer, questions, search, [questions], args, cached=cached, agent_name="react",
                                    script=policy, max_turns=turns, max_new_tokens=128)  # room for a whole call
            found[cached] = st
        a, b = found[False], found[True]
        print(f"{turns:>5} | {a['prefilled']:>19} | {a['prefill_seconds']:>9.1f} | {b['prefilled']:>16} | "
              f"{b['prefill_seconds']:>9.1f} | {b['prefilled'] / a['prefilled']:>5.2f}x")


# ---------------------------------------------------------------------------------------------
# 3. Context tokens per turn, scripted policy that searches every turn
# ---------------------------------------------------------------------------------------------
QUESTION_WORDS = {"what", "which", "where", "when", "does", "with", "from", "that", "this", "first", "born"}


def scripted_policy(agent_name, memory_words, answers=None, answer_turn=None):
    """A generate_fn: every turn a short thought and one search; MemSearcher's memory update keeps
    the first `memory_words` words of the latest documents (so its length stays about constant).
    With `answers` ({question: gold}), turn `answer_turn` answers \\boxed{gold} instead."""
    turns = {}  # question -> first generations so far

    def first_generation(prompt_text):
        question = re.search(r"<question> (.*?) </question>", prompt_text, re.S).group(1)
        k = turns[question] = turns.get(question, 0) + 1
        think = "" if prompt_text.endswith("<think>") else "<think>"  # ReAct turns 2+ have no prefill
        if answers is not None and k == answer_turn:
            return f"{think} My notes hold the answer.</think>\n\\boxed{{{answers[question]}}}"
        words = [w for w in re.findall(r"\w+", question) if len(w) > 3 and w.lower() not in QUESTION_WORDS] or [question]
        query = question if k == 1 else " ".join(words[(k - 2) % len(words):][:3])  # then 3 of its words
        call = json.dumps({"name": agent.TOOL_NAME, "arguments": {"query": query, "top_n": 5}})
        return f"{think} Search {k}: I still need facts about {query}.</think>\n<tool_call>\n{call}\n</tool_call>"

    def memory_update(prompt_text):
        response = prompt_text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]
        documents = response.split("\n", 1)[1]  # drop the call's JSON line
        return "<memory>" + " ".join(documents.split()[:memory_words]) + "</memory>"

    def generate_fn(model, tokenizer, prompts, **sampling):
        end = tokenizer.convert_tokens_to_ids(agent.END_OF_TURN)
        outs = []
        for p in prompts:
            text = tokenizer.decode(p)
            phase_one = agent_name == "react" or text.endswith("<think>")
            ids = agent.encode(tokenizer, first_generation(text) if phase_one else memory_update(text)) + [end]
            outs.append(agent.Generation(ids=ids, logprobs=[0.0] * len(ids), finished=True))
        return outs

    return generate_fn


def bench_context(tokenizer, questions, search, args):
    turns = 10
    per_agent = {}
    for name in ("memsearcher", "react"):
        settings = agent.RolloutSettings(agent=name, max_turns=turns, max_response_tokens=10**9)
        trajectories = agent.rollout(None, tokenizer, questions, search, settings,
                                     generate_fn=scripted_policy(name, args.memory_words))
        per_agent[name] = trajectories
    print(f"\n== 3. Context tokens per turn (paper Figure 3): {len(questions)} questions, scripted policy that "
          f"searches every turn (real retriever, top_n 5), memory = first {args.memory_words} words of the latest documents")
    for name, trajectories in per_agent.items():
        print(f"{name}: {describe(trajectories)}")
    print(f"{'turn':>4} | {'MemSearcher mean':>16} | {'max':>6} | {'ReAct mean':>10} | {'max':>6} | {'ReAct/MemSearcher':>17}")
    means = {name: [] for name in per_agent}
    for k in range(turns):
        row = {}
        for name, trajectories in per_agent.items():
            values = [t.context_tokens[k] for t in trajectories if len(t.context_tokens) > k]
            row[name] = (sum(values) / len(values), max(values)) if values else (float("nan"), 0)
            means[name].append(row[name][0])
        (m_mean, m_max), (r_mean, r_max) = row["memsearcher"], row["react"]
        print(f"{k + 1:>4} | {m_mean:>16.0f} | {m_max:>6} | {r_mean:>10.0f} | {r_max:>6} | {r_mean / m_mean:>16.2f}x")
    total_m, total_r = sum(means["memsearcher"]), sum(means["react"])
    print(f"sum over {turns} turns of the mean context: MemSearcher {total_m:.0f}, ReAct {total_r:.0f} "
          f"({total_r / total_m:.2f}x)")
    plot(means, os.path.join(ROOT, "docs", "figures", "context_tokens.png"))


def plot(means, path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib to get docs/figures/context_tokens.png)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, label in [("react", "ReAct"), ("memsearcher", "MemSearcher")]:
        ax.plot(range(1, len(means[name]) + 1), means[name], marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("tokens in context (mean)")
    ax.set_title("Context tokens per turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ---------------------------------------------------------------------------------------------
# 4. Precision: float32 vs bfloat16 weights, same questions, greedy
# ---------------------------------------------------------------------------------------------
def bench_precision(model, tokenizer, questions, search, args):
    n = len(questions)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        agent.generate(model, tokenizer, [agent.encode(tokenizer, "Hello")] * 2, max_new_tokens=4, greedy=True)  # warm-up
        trajectories, seconds, _ = run_rollouts(model, tokenizer, questions, search, [questions], args)
        runs[str(dtype).split(".")[1]] = (trajectories, seconds, sampled_tokens(trajectories))
    model.to(torch.float32)
    print(f"\n== 4. Precision: one batched rollout over {n} questions (greedy, max_turns {args.max_turns}, max_new_tokens "
          f"{args.max_new_tokens}), CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'weights':>10} | {'wall s':>7} | {'gen tokens':>10} | {'tokens/s':>8} | {'F1':>5} | ends")
    for name, (ts, secs, toks) in runs.items():
        f1 = sum(agent.f1_score(t.prediction, t.golden_answers) for t in ts) / n
        print(f"{name:>10} | {secs:>7.1f} | {toks:>10} | {toks / secs:>8.1f} | {f1:>5.2f} | {describe(ts)}")
    (a, ta, _), (b, tb, _) = runs.values()
    print(f"bfloat16 speed-up (float32 wall / bfloat16 wall): {ta / tb:.2f}x; same prediction {sum(x.prediction == y.prediction for x, y in zip(a, b))}/{n}, "
          f"identical sampled tokens {sum(sampled_ids(x) == sampled_ids(y) for x, y in zip(a, b))}/{n}")


# ---------------------------------------------------------------------------------------------
# 6. Continuous batching (transformers' generate_batch) vs one static batch
# ---------------------------------------------------------------------------------------------
def bench_continuous(model, tokenizer, questions, args):
    """First-turn prompts, greedy, the same stops: one static left-padded generate against
    transformers' continuous batching, which refills a finished row's slot instead of stepping it."""
    from transformers import GenerationConfig

    prompts = [agent.encode(tokenizer, agent.memsearcher_prompt(q["question"], "")) for q in questions]
    agent.generate(model, tokenizer, prompts[:2], max_new_tokens=4, greedy=True)  # warm-up
    t = time.perf_counter()
    static = agent.generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens, greedy=True)
    t_static = time.perf_counter() - t
    stop = agent.stop_token_ids(tokenizer)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=stop,
                              pad_token_id=tokenizer.pad_token_id)
    print(f"\n== 6. Continuous batching: {len(prompts)} first-turn prompts, greedy, max_new_tokens {args.max_new_tokens}")
    try:
        t = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=config, warmup=False)
        t_cb = time.perf_counter() - t
    except Exception as e:  # not every transformers version or attention backend has it
        print(f"generate_batch failed: {type(e).__name__}: {str(e)[:200]}")
        return
    continuous = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.rsplit("_", 1)[-1]))]
    tok_s, tok_c = sum(len(g.ids) for g in static), sum(map(len, continuous))
    print(f"{'run':>24} | {'wall s':>7} | {'gen tokens':>10} | {'tokens/s':>8}")
    print(f"{'static generate':>24} | {t_static:>7.1f} | {tok_s:>10} | {tok_s / t_static:>8.1f}")
    print(f"{'generate_batch':>24} | {t_cb:>7.1f} | {tok_c:>10} | {tok_c / t_cb:>8.1f}")
    same = sum(g.ids == c[:len(g.ids)] for g, c in zip(static, continuous))
    print(f"continuous / static: {tok_c / t_cb / (tok_s / t_static):.2f}x tokens/s; same greedy tokens {same}/{len(prompts)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=16, help="questions (= batch size) from data/toy/test.jsonl")
    ap.add_argument("--max_new_tokens", type=int, default=128, help="per generation, in sections 1 and 2")
    ap.add_argument("--max_turns", type=int, default=5, help="turn limit in sections 1 and 2")
    ap.add_argument("--memory_words", type=int, default=60, help="words the scripted memory keeps (section 3)")
    ap.add_argument("--model", default="default", help="policy: `default` (embedded SmolLM2) or a checkpoint / train.py output folder")
    ap.add_argument("--sections", default="1,2,3,5,6", help="which sections to run, e.g. 4 or 1,2,3,4,5,6")
    ap.add_argument("--react_questions", type=int, default=4, help="questions in section 5")
    args = ap.parse_args()
    import transformers

    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"transformers {transformers.__version__}; load average {os.getloadavg()[0]:.2f}")
    start = time.perf_counter()
    sections = set(args.sections.split(","))
    model, tokenizer = models.load(args.model)
    search = retriever.open_retriever()
    questions = load_questions(args.questions)
    print(f"loaded {args.model} and the toy retriever in {time.perf_counter() - start:.1f} s; "
          f"{len(questions)} questions: {questions[0]['id']} .. {questions[-1]['id']}")
    if sections & {"1", "2"}:
        bench_throughput(model, tokenizer, questions, search, args)
    if "3" in sections:
        bench_context(tokenizer, questions, search, args)
    if "4" in sections:
        bench_precision(model, tokenizer, questions, search, args)
    if "6" in sections:
        bench_continuous(model, tokenizer, questions, args)
    if "5" in sections:
        bench_react_prefill(model, tokenizer, questions[:args.react_questions], search, args)
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
