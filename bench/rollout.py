"""Benchmark agent.rollout on the embedded default (SmolLM2-135M) and the default toy retriever.

    python bench/rollout.py                              # 16 questions, 128 new tokens per generation
    python bench/rollout.py --questions 8 --max_new_tokens 64

Prints, from one run:
1. batched rollout vs one question at a time: one `rollout` call over N questions against N calls
   of one question each (MemSearcher, greedy, memory reset on an invalid update), in generated
   tokens/s (tokens the policy sampled, loss_mask == 1), with the ratio and whether both runs
   generated the same tokens;
2. agent-loop overhead: one raw left-padded `model.generate` over the same first-turn prompts
   (KV cache on, exactly as many new tokens per row as the batched rollout generated on average)
   against the batched rollout, in tokens/s, with the ratio rollout / raw;
3. context tokens per turn (the paper's Figure 3): MemSearcher vs ReAct on the same questions over
   10 turns, with a scripted policy that searches every turn and the real retriever's documents;
   a plot `bench/context_tokens.png` when matplotlib is installed;
4. precision (`--sections 4`, best with a trained `--model`): the batched rollout in float32 against
   bfloat16 weights (evaluate.py --dtype), in tokens/s with the ratio, and how many greedy
   predictions and answers agree.

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
from data.questions import load_questions as question_rows  # noqa: E402


def load_questions(n):
    """The first n rows of the toy test set (a fixed selection)."""
    return question_rows(os.path.join(ROOT, "data", "toy", "test.jsonl"))[:n]


def timed_generate(stats):
    """agent.generate, counting its calls and the seconds spent inside it."""
    def generate_fn(model, tokenizer, prompts, **sampling):
        t = time.perf_counter()
        out = agent.generate(model, tokenizer, prompts, **sampling)
        stats["calls"] += bool(prompts)  # rollout also calls it with no prompts (nobody updating memory)
        stats["seconds"] += time.perf_counter() - t
        stats["slots"] += len(prompts) * max((len(g.ids) for g in out), default=0)  # rows x decoding steps
        return out
    return generate_fn


def sampled_tokens(trajectories):
    return sum(sum(c.loss_mask) for t in trajectories for c in t.conversations)


def sampled_ids(t):
    """The tokens a trajectory's policy sampled, conversation by conversation."""
    return [[i for i, m in zip(c.response_ids, c.loss_mask) if m] for c in t.conversations]


# ---------------------------------------------------------------------------------------------
# 1 + 2. Throughput: batched rollout, one at a time, raw generate
# ---------------------------------------------------------------------------------------------
def run_rollouts(model, tokenizer, questions, search, batches, args):
    """Roll out `questions` in the given batches -> (trajectories, wall seconds, generate stats)."""
    stats = {"calls": 0, "seconds": 0.0, "slots": 0}
    trajectories = []
    start = time.perf_counter()
    for batch in batches:
        trajectories += agent.rollout(model, tokenizer, batch, search, agent="memsearcher", greedy=True,
                                      max_turns=args.max_turns, max_new_tokens=args.max_new_tokens,
                                      evaluation=True, max_memory_tokens=None, generate_fn=timed_generate(stats))
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
    batched, t_batched, s_batched = run_rollouts(model, tokenizer, questions, search, [questions], args)
    single, t_single, s_single = run_rollouts(model, tokenizer, questions, search, [[q] for q in questions], args)
    tok_b, tok_s = sampled_tokens(batched), sampled_tokens(single)

    print(f"\n== 1. Batched rollout vs one at a time: {n} questions, MemSearcher, greedy, "
          f"max_turns {args.max_turns}, max_new_tokens {args.max_new_tokens}")
    print(f"{'run':>24} | {'wall s':>7} | {'gen tokens':>10} | {'tokens/s':>8} | {'generate calls':>14} | {'in generate':>11}")
    for name, toks, secs, st in [(f"one rollout over {n}", tok_b, t_batched, s_batched),
                                 (f"{n} rollouts of 1", tok_s, t_single, s_single)]:
        print(f"{name:>24} | {secs:>7.1f} | {toks:>10} | {toks / secs:>8.1f} | {st['calls']:>14} | {st['seconds'] / secs:>10.0%}")
    print(f"batched / one at a time: {tok_b / t_batched / (tok_s / t_single):.2f}x tokens/s")
    same = sum(sampled_ids(a) == sampled_ids(b) for a, b in zip(batched, single))
    print(f"same number of generated tokens: {'yes' if tok_b == tok_s else 'no'} ({tok_b} vs {tok_s}); "
          f"trajectories with identical sampled tokens: {same}/{n}")
    print(f"batched:       {describe(batched)}")
    print(f"one at a time: {describe(single)}")

    prompts = [agent.encode(tokenizer, agent.memsearcher_prompt(q["question"], "")) for q in questions]
    per_row = max(1, round(tok_b / n))
    tok_r, t_raw = raw_generate(model, tokenizer, prompts, per_row)
    rate_b, rate_r = tok_b / t_batched, tok_r / t_raw
    print(f"\n== 2. Agent-loop overhead: batched rollout vs one raw model.generate (batch {n}, left-padded, "
          f"first-turn prompts, {per_row} new tokens per row, KV cache)")
    print(f"{'run':>24} | {'wall s':>7} | {'gen tokens':>10} | {'tokens/s':>8}")
    print(f"{'raw model.generate':>24} | {t_raw:>7.1f} | {tok_r:>10} | {rate_r:>8.1f}")
    print(f"{'batched rollout':>24} | {t_batched:>7.1f} | {tok_b:>10} | {rate_b:>8.1f}")
    print(f"rollout / raw: {rate_b / rate_r:.2f}x tokens/s")
    print(f"the rollout's generate calls run until their longest row stops: {s_batched['slots']} row-steps for "
          f"{tok_b} tokens ({tok_b / max(s_batched['slots'], 1):.0%} of the batch slots did useful work; raw: 100%)")


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
        trajectories = agent.rollout(None, tokenizer, questions, search, agent=name, max_turns=turns,
                                     max_response_tokens=10**9, generate_fn=scripted_policy(name, args.memory_words))
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
    plot(means, os.path.join(ROOT, "bench", "context_tokens.png"))


def plot(means, path):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib to get bench/context_tokens.png)")
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=16, help="questions (= batch size) from data/toy/test.jsonl")
    ap.add_argument("--max_new_tokens", type=int, default=128, help="per generation, in sections 1 and 2")
    ap.add_argument("--max_turns", type=int, default=5, help="turn limit in sections 1 and 2")
    ap.add_argument("--memory_words", type=int, default=60, help="words the scripted memory keeps (section 3)")
    ap.add_argument("--model", default="default", help="policy: `default` (embedded SmolLM2) or a checkpoint / train.py output folder")
    ap.add_argument("--sections", default="1,2,3", help="which sections to run, e.g. 4 or 1,2,3,4")
    args = ap.parse_args()
    import transformers

    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"transformers {transformers.__version__}; load average {os.getloadavg()[0]:.2f}")
    start = time.perf_counter()
    sections = set(args.sections.split(","))
    model, tokenizer = agent.load_model(args.model)
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
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
