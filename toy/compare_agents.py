"""MemSearcher against ReAct, trained alike on the same worlds: the runs, the table, the figures.

The paper's claim at small scale. For each world (toy = data/toy; seeds 2 and 3, made here by
toy/make_toy.py) and each agent, the toy preset unchanged but for `--agent`:
1. the oracle acts out every training question in the agent's own format (how many it solves);
2. the agent's own warm start on those demonstrations, then 8 GRPO steps (train.py);
3. the warm start and the GRPO policy answer all 200 of the world's test questions, greedy, with
   `make run`'s evaluation settings (evaluate.py in one process per core).
Nothing is tuned on test questions, for either agent.

    python toy/compare_agents.py run    --out runs/agents                       # resumable: run it again after a stop
    python toy/compare_agents.py report --out runs/agents                       # report.md and the figures
    python toy/compare_agents.py run    --out runs/agents --results docs/agents # keep the small files in the repository

`run` does one (world, agent) after another, each part skipped once done, so what is finished when
a long run stops is whole. Beside the run folders it writes, under --results (default
OUT/results), what the report reads: each run's metrics.jsonl, each evaluation's predictions cut
to their scores, turns' queries and context sizes (a few hundred kB in all), and the oracle's
counts. `report` needs only that folder. On a 2-core CPU one (world, agent) takes about two hours.
"""
import argparse
import json
import math
import os
import statistics
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
import evaluate  # noqa: E402
from rl_worlds import EVAL_ARGS, WORLDS, fmt, sh, train, world_data  # noqa: E402

AGENTS = ("memsearcher", "react")
NAMES = {"memsearcher": "MemSearcher", "react": "ReAct"}
TYPES = ("single", "bridge", "comparison")
STEPS = 8  # GRPO steps of every run: the toy preset's --max_steps
KEPT = ("dataset", "id", "prediction", "em", "f1", "acc", "reward", "end_reason", "num_turns", "num_searches", "context_tokens")


# ---------------------------------------------------------------------------------------------
# 1. The runs
# ---------------------------------------------------------------------------------------------
def oracle_counts(world: str, agent_name: str, data: str, path: str):
    """How many of the world's training questions the oracle solves in the agent's format, with the
    real retriever (toy/oracle.py's demonstrations: reward 1 and every hop's passage retrieved)."""
    if os.path.isfile(path):
        return
    import agent
    import retriever
    from toy.oracle import load_rows, make_demonstrations
    from tools import models
    from transformers import AutoTokenizer

    folder, name = os.path.split(models.default_model_file())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    search = retriever.open_retriever(corpus=os.path.join(data, "corpus.jsonl"))
    rows = load_rows(os.path.join(data, "train.jsonl"))
    _, stats = make_demonstrations(rows, search, tokenizer, agent.RolloutSettings(agent=agent_name), batch_size=200)
    write_json(path, {"world": world, "agent": agent_name, **stats})


def slim(prediction: dict, row: dict) -> dict:
    """A prediction cut to what the report reads: scores, ends, context sizes, each turn's queries,
    and the question's type and chain entities (so the report needs no world files). For
    MemSearcher on a bridge, also whether any of its memories held hop 1's answer (the entity its
    second search needs)."""
    chain, turns = row["metadata"]["chain"], prediction.get("turns") or []
    out = {**{k: prediction[k] for k in KEPT}, "type": row["metadata"]["type"], "chain": [h["search"] for h in chain],
           "queries": [t.get("queries", []) for t in turns]}
    if out["type"] == "bridge" and prediction["run"]["agent"] == "memsearcher":
        out["hop1_in_memory"] = any(chain[0]["answer"].lower() in (t.get("memory") or "").lower() for t in turns)
    return out


def evaluate_policy(model: str, data: str, out_dir: str, kept: str, threads: int):
    """evaluate.py on the world's 200 test questions (agent: as the checkpoint was trained), then
    the slim copy of its predictions (made again each time: cheap, and a change to `slim` reaches it)."""
    if not os.path.isfile(os.path.join(out_dir, "results.json")):
        sh([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(threads), os.path.join(ROOT, "evaluate.py"),
            "--model", model, "--data", os.path.join(data, "test.jsonl"), "--corpus", os.path.join(data, "corpus.jsonl"),
            "--output_dir", out_dir, *EVAL_ARGS])
    rows = {str(r["id"]): r for r in read_jsonl(os.path.join(data, "test.jsonl"))}
    write_jsonl(kept, [slim(p, rows[str(p["id"])]) for p in read_jsonl(os.path.join(out_dir, "predictions.jsonl"))])


def finished(kept: str, steps: int) -> bool:
    """A (world, agent) whose small files are all kept is done: a clone that has them, and none of
    the run folders, resumes after it."""
    return all(os.path.isfile(os.path.join(kept, f)) for f in ("oracle.json", "metrics.jsonl", "test-0.jsonl", f"test-{steps}.jsonl"))


def run(args):
    threads = args.threads or os.cpu_count() or 1
    for world in WORLDS:
        todo = [name for name in args.agents if not finished(os.path.join(args.results, name, world), args.steps)]
        data = world_data(args.out, world) if todo else None
        for name in todo:
            kept = os.path.join(args.results, name, world)
            oracle_counts(world, name, data, os.path.join(kept, "oracle.json"))
            train(args.out, world, args.steps, threads, run=os.path.join(name, world), extra=("--agent", name))
            metrics = read_jsonl(os.path.join(args.out, name, world, "metrics.jsonl"))
            write_jsonl(os.path.join(kept, "metrics.jsonl"), metrics)
            for step in (0, args.steps):
                model = os.path.join(args.out, name, world, "warm_start" if step == 0 else f"checkpoint-{step}")
                evaluate_policy(model, data, os.path.join(args.out, "eval", name, world, f"test-{step}"),
                                os.path.join(kept, f"test-{step}.jsonl"), threads)


# ---------------------------------------------------------------------------------------------
# 2. What each policy did, and the paired differences
# ---------------------------------------------------------------------------------------------
def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def behaviour(predictions: list[dict]) -> dict:
    """n; EM, F1, format-valid and searches (mean, 95% interval); per type F1 and searches; for
    bridges the share that searched the second hop's entity."""
    out = {"n": len(predictions)}
    for m, values in (("em", [p["em"] for p in predictions]), ("f1", [p["f1"] for p in predictions]),
                      ("format_valid", [float(p["reward"] > 0) for p in predictions]),
                      ("searches", [p["num_searches"] for p in predictions])):
        out[m] = (mean(values), evaluate.bootstrap_interval(values))
    out["types"] = {k: {"n": sum(p["type"] == k for p in predictions),
                        "f1": mean(p["f1"] for p in predictions if p["type"] == k),
                        "searches": mean(p["num_searches"] for p in predictions if p["type"] == k)} for k in TYPES}
    bridges = [p for p in predictions if p["type"] == "bridge"]
    out["types"]["bridge"]["hop2_searched"] = mean(
        float(any(p["chain"][1].lower() in q.lower() for turn in p["queries"] for q in turn)) for p in bridges)
    out["types"]["bridge"]["hop1_in_memory"] = mean(float(p["hop1_in_memory"]) for p in bridges if "hop1_in_memory" in p)
    return out


def share(value: float) -> str:
    """A share as a percentage; – where there is none (ReAct has no memory)."""
    return "–" if math.isnan(value) else f"{value:.0%}"


def paired(a: list[dict], b: list[dict], metric: str = "f1"):
    """B − A over the questions both answered, with its paired 95% interval."""
    return evaluate.paired_difference(a, b)[metric]


def context_by_turn(predictions: list[dict]) -> dict[int, float]:
    """Mean context tokens at the end of turn k (1-based), over the questions that reached it."""
    by_turn = defaultdict(list)
    for p in predictions:
        for k, n in enumerate(p["context_tokens"], 1):
            by_turn[k].append(n)
    return {k: mean(v) for k, v in sorted(by_turn.items())}


def load_results(results: str, steps: int) -> dict:
    """{(agent, world, step): slim predictions} for every evaluation on file; the pool is added
    for a (agent, step) only when every world has it, so it always holds the same 600 questions."""
    got = {}
    for name in AGENTS:
        for world in WORLDS:
            for step in (0, steps):
                path = os.path.join(results, name, world, f"test-{step}.jsonl")
                if os.path.isfile(path):
                    got[name, world, step] = read_jsonl(path)
            if all((name, w, step) in got for w in WORLDS for step in (0, steps)):
                for step in (0, steps):
                    got[name, "pool", step] = [dict(p, dataset=f"{w}/{p['dataset']}") for w in WORLDS for p in got[name, w, step]]
    return got


def step_costs(results: str, name: str, world: str) -> list[dict]:
    """Each GRPO step's wall seconds (rollout + reference + update) and peak memory (VmHWM, GB)."""
    path = os.path.join(results, name, world, "metrics.jsonl")
    rows = [r for r in (read_jsonl(path) if os.path.isfile(path) else []) if r.get("phase") == "grpo"]
    return [{"step": r["step"], "seconds": r["seconds_rollout"] + r["seconds_reference"] + r["seconds_update"],
             "peak_gb": r["peak_memory_gb"], "update_gb": r["peak_update_gb"], "context": r["context_tokens_mean"]} for r in rows]


# ---------------------------------------------------------------------------------------------
# 3. The report: the table, the goals, the figures
# ---------------------------------------------------------------------------------------------
def table(got: dict, steps: int) -> list[str]:
    lines = ["| world | agent | policy | format-valid | EM | F1 | searches | F1 single / bridge / comparison | "
             "paired F1 − own warm start | bridges: hop 1's answer in memory / hop 2 searched |", "|" + " --- |" * 10]
    for world in [*WORLDS, "pool"]:
        for name in AGENTS:
            for step in (0, steps):
                if (name, world, step) not in got:
                    continue
                b, warm = behaviour(got[name, world, step]), got.get((name, world, 0))
                diff = fmt(paired(warm, got[name, world, step]), 3, signed=True) if step and warm else "–"
                lines.append(f"| {world} ({b['n']} q) | {NAMES[name]} | {'warm start' if step == 0 else f'GRPO {steps} steps'} | "
                             f"{b['format_valid'][0]:.2f} | {fmt(b['em'])} | {fmt(b['f1'])} | {b['searches'][0]:.2f} | "
                             + " / ".join(f"{b['types'][k]['f1']:.2f}" for k in TYPES)
                             + f" | {diff} | {share(b['types']['bridge']['hop1_in_memory'])} / {b['types']['bridge']['hop2_searched']:.0%} |")
    lines += ["", "MemSearcher − ReAct, paired over the same questions: the warm starts, the policies after "
              f"GRPO ({steps} steps), and what GRPO added to each (MemSearcher's gain − ReAct's):", "",
              "| world | F1, warm starts | EM after GRPO | F1 after GRPO | F1 gain, MemSearcher's − ReAct's |", "|" + " --- |" * 5]
    for world in [*WORLDS, "pool"]:
        if all((n, world, s) in got for n in AGENTS for s in (0, steps)):
            (r0, r1), (m0, m1) = ((got[n, world, 0], got[n, world, steps]) for n in AGENTS[::-1])
            lines.append(f"| {world} | {fmt(paired(r0, m0), 3, signed=True)} | {fmt(paired(r1, m1, 'em'), 3, signed=True)} | "
                         f"{fmt(paired(r1, m1), 3, signed=True)} | {fmt(paired(gains(r0, r1), gains(m0, m1)), 3, signed=True)} |")
    return lines


def gains(warm: list[dict], trained: list[dict]) -> list[dict]:
    """Per question, the trained policy's score minus its warm start's (so that two agents' gains
    can be paired like two runs' scores)."""
    before = {(p["dataset"], p["id"]): p for p in warm}
    return [{"dataset": p["dataset"], "id": p["id"], **{m: p[m] - before[p["dataset"], p["id"]][m] for m in ("em", "f1", "acc")}}
            for p in trained if (p["dataset"], p["id"]) in before]


README_HEADER = "| world | agent | EM / F1, warm start | EM / F1 after GRPO | F1 gain over warm start | F1, MemSearcher − ReAct |"


def readme_table(got: dict, steps: int) -> list[str]:
    """The README's results table (six columns): per world and pooled, each agent's warm start and
    GRPO policy, its paired gain, and on MemSearcher's row the paired difference with ReAct."""
    lines = [README_HEADER, "|" + " --- |" * 6]
    for world in [*WORLDS, "pool"]:
        for name in AGENTS:
            if (name, world, 0) not in got or (name, world, steps) not in got:
                continue
            warm, trained = got[name, world, 0], got[name, world, steps]
            b0, b1 = behaviour(warm), behaviour(trained)
            other = got.get(("react", world, steps)) if name == "memsearcher" else None
            versus = fmt(paired(other, trained), 3, signed=True) if other else "–"
            lines.append(f"| {world} ({b1['n']} q) | {NAMES[name]} | {b0['em'][0]:.2f} / {b0['f1'][0]:.2f} | "
                         f"{b1['em'][0]:.2f} / {fmt(b1['f1'])} | {fmt(paired(warm, trained), 3, signed=True)} | {versus} |")
    return lines


def goals(got: dict, results: str, steps: int) -> list[str]:
    """Each goal of the comparison, met or not, from the figures on file. While runs are missing, a
    verdict says "so far" and names what it waits on; the agents are compared on the worlds both have."""
    def say(ok: bool, missing: list[str]) -> str:
        verdict = "**met**" if ok else "**not met**"
        return verdict + (f" so far (waiting on {', '.join(missing)})" if missing else "")

    def waiting(have) -> list[str]:
        return [f"{NAMES[n]} {w}" for n in AGENTS for w in WORLDS if not have(n, w)]

    lines = []
    oracle = {(n, w): read_json(os.path.join(results, n, w, "oracle.json")) for n in AGENTS for w in WORLDS
              if os.path.isfile(os.path.join(results, n, w, "oracle.json"))}
    if oracle:
        shares = ", ".join(f"{NAMES[n]} {w} {o['kept']}/{o['offered']}" for (n, w), o in oracle.items())
        lines.append(f"- the oracle solves ≥ 95% of the training questions: {shares}: "
                     f"{say(all(o['kept'] >= 0.95 * o['offered'] for o in oracle.values()), waiting(lambda n, w: (n, w) in oracle))}")
    warm = {(n, w): behaviour(got[n, w, 0])["format_valid"][0] for n in AGENTS for w in WORLDS if (n, w, 0) in got}
    if warm:
        lines.append("- warm starts format-valid ≥ 0.8 on test: " + ", ".join(f"{NAMES[n]} {w} {v:.2f}" for (n, w), v in warm.items())
                     + f": {say(min(warm.values()) >= 0.8, waiting(lambda n, w: (n, w) in warm))}")
    if ("memsearcher", "pool", steps) in got and ("react", "pool", steps) in got:
        d, (lo, hi) = paired(got["react", "pool", steps], got["memsearcher", "pool", steps])
        lines.append(f"- pooled F1, MemSearcher − ReAct after GRPO: {d:+.3f} [{lo:+.3f}, {hi:+.3f}]; not below ReAct beyond "
                     f"the interval (upper end ≥ 0): {say(hi >= 0, [])}; above it beyond the interval: {say(lo > 0, [])}")
    both = [w for w in WORLDS if all((n, w, steps) in got for n in AGENTS)]
    missing = waiting(lambda n, w: (n, w, steps) in got)
    if both:
        late = {n: mean(k for w in both for p in got[n, w, steps] for k in p["context_tokens"][2:]) for n in AGENTS}
        ratio = late["memsearcher"] / late["react"]
        lines.append(f"- mean context at turns ≥ 3 after GRPO ({', '.join(both)}): MemSearcher {late['memsearcher']:.0f}, "
                     f"ReAct {late['react']:.0f} tokens, ratio {ratio:.2f} (goal ≤ 0.5): {say(ratio <= 0.5, missing)}")
    costs = {n: [c for w in both for c in step_costs(results, n, w)] for n in AGENTS}
    if all(costs.values()):
        peak = {n: statistics.median(c["peak_gb"] for c in costs[n]) for n in AGENTS}
        wall = {n: statistics.median(c["seconds"] for c in costs[n]) for n in AGENTS}
        lines.append(f"- peak memory of a GRPO step (median over steps, VmHWM; {', '.join(both)}): MemSearcher "
                     f"{peak['memsearcher']:.2f} GB, ReAct {peak['react']:.2f} GB: lower for MemSearcher: "
                     f"{say(peak['memsearcher'] < peak['react'], missing)}; "
                     f"wall time a step (median): {wall['memsearcher']:.0f} s vs {wall['react']:.0f} s")
    for name in AGENTS:
        if (name, "pool", steps) in got:
            lines.append(f"- {NAMES[name]}'s pooled gain over its warm start: "
                         f"F1 {fmt(paired(got[name, 'pool', 0], got[name, 'pool', steps]), 3, signed=True)}, "
                         f"EM {fmt(paired(got[name, 'pool', 0], got[name, 'pool', steps], 'em'), 3, signed=True)}")
            before, after = (behaviour(got[name, "pool", s])["types"] for s in (0, steps))
            conditional = (after["bridge"]["hop2_searched"] > before["bridge"]["hop2_searched"]
                           and after["single"]["searches"] <= before["single"]["searches"])
            lines.append(f"  - conditional searching: bridges search hop 2 {before['bridge']['hop2_searched']:.0%} → "
                         f"{after['bridge']['hop2_searched']:.0%}, single-hop searches {before['single']['searches']:.2f} → "
                         f"{after['single']['searches']:.2f}: {'yes' if conditional else 'no'}")
    return lines


def plot(got: dict, results: str, steps: int, figures: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    os.makedirs(figures, exist_ok=True)
    colour = {"memsearcher": "tab:blue", "react": "tab:orange"}
    both = [w for w in WORLDS if all((n, w, steps) in got for n in AGENTS)] or list(WORLDS)  # the same questions
    fig, ax = plt.subplots(figsize=(5.6, 3.6))  # the paper's Figure 3: context per turn
    for name in AGENTS:
        preds = [p for w in both for p in got.get((name, w, steps), [])]
        if preds:
            turns = context_by_turn(preds)
            ax.plot(list(turns), list(turns.values()), "o-", color=colour[name], label=f"{NAMES[name]} ({len(preds)} q)")
            for k, value in turns.items():  # how many questions each mean is over: the late turns' are few
                reached = sum(len(p["context_tokens"]) >= k for p in preds)
                ax.annotate(f"{reached}", (k, value), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize=7, color=colour[name])
    ax.set_xlabel("turn (beside each point: the questions that reached it)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(y=0.15)
    ax.set_ylabel("context tokens at the turn's end (mean)")
    ax.set_title(f"test questions, policies after GRPO ({steps} steps)", fontsize=9)
    ax.legend(frameon=False)
    fig.tight_layout()
    fig.savefig(os.path.join(figures, "agents_context_per_turn.png"), dpi=120)

    fig, (mem, wall) = plt.subplots(1, 2, figsize=(10, 3.6))  # the paper's Figure 4: memory (and time) of a step
    for name in AGENTS:
        for world, marker in zip(WORLDS, "os^"):
            costs = step_costs(results, name, world)
            if costs:
                x = [c["step"] for c in costs]
                mem.plot(x, [c["peak_gb"] for c in costs], marker + "-", color=colour[name], label=f"{NAMES[name]} {world}")
                wall.plot(x, [c["seconds"] / 60 for c in costs], marker + "-", color=colour[name])
    mem.set_ylabel("peak memory of the step (VmHWM, GB)")
    wall.set_ylabel("wall time of the step (min)")
    for a in (mem, wall):
        a.set_xlabel("GRPO step")
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
    mem.legend(frameon=False, fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(figures, "agents_step_cost.png"), dpi=120)

    names = [w for w in [*WORLDS, "pool"] if all((n, w, s) in got for n in AGENTS for s in (0, steps))]
    if names:
        fig, ax = plt.subplots(figsize=(7.2, 3.6))  # test F1 per world
        bars = [(n, s) for n in AGENTS for s in (0, steps)]
        for k, (name, step) in enumerate(bars):
            values = [behaviour(got[name, w, step])["f1"] for w in names]
            ax.bar([i + (k - 1.5) * 0.2 for i in range(len(names))], [v for v, _ in values], width=0.19, color=colour[name],
                   alpha=0.45 if step == 0 else 1.0, label=f"{NAMES[name]}, {'warm start' if step == 0 else f'GRPO {steps}'}",
                   yerr=[[v - lo for v, (lo, _) in values], [hi - v for v, (_, hi) in values]], capsize=2)
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("test F1 (95% interval)")
        ax.legend(frameon=False, fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(figures, "agents_f1.png"), dpi=120)


def report(args):
    if not os.path.isdir(args.results):
        raise SystemExit(f"no results folder {args.results}: `compare_agents.py run --results {args.results}` writes it")
    got = load_results(args.results, args.steps)
    text = "\n".join(["## Test: each agent's warm start and GRPO policy", "", *table(got, args.steps), "",
                      "## Goals", "", *goals(got, args.results, args.steps), "",
                      "## The README's table", "", *readme_table(got, args.steps), ""])
    print(text)
    with open(os.path.join(args.results, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    plot(got, args.results, args.steps, args.figures)


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_jsonl(path: str, rows: list[dict]):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(path + ".tmp", path)


def write_json(path: str, value: dict):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run", "report"])
    ap.add_argument("--out", default=os.path.join("runs", "agents"), help="run folders, evaluations, the new worlds' data")
    ap.add_argument("--results", default=None, help="the small files the report reads (default: OUT/results)")
    ap.add_argument("--agents", nargs="+", default=list(AGENTS), choices=AGENTS)
    ap.add_argument("--steps", type=int, default=STEPS, help="GRPO steps (the toy preset's --max_steps)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for training, and evaluation processes (0: all cores)")
    ap.add_argument("--figures", default=None, help="default: RESULTS")
    args = ap.parse_args(argv)
    args.results = args.results or os.path.join(args.out, "results")
    args.figures = args.figures or args.results
    {"run": run, "report": report}[args.what](args)


if __name__ == "__main__":
    main()
