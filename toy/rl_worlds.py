"""GRPO from each world's own warm start, and the toy world's learning curve: the runs and their report.

Three worlds (toy = data/toy, seed 0; seeds 2 and 3 made here with toy/make_toy.py), each trained
with the toy preset unchanged: its warm start on the world's own demonstrations, then GRPO. The
toy world runs --curve_steps steps with a checkpoint every 2 (the curve); the others --steps (the
toy world's policy for the table is its checkpoint at --steps: the step's questions and sampling
seeds do not depend on the run's length, and the learning rate is constant).

    python toy/rl_worlds.py run    --out runs/worlds   # resumable: run it again after a stop
    python toy/rl_worlds.py report --out runs/worlds   # tables (report.md) and figures
    python toy/rl_worlds.py try --out runs/worlds --name reroll1 --flags "--reroll_turn 1"
                                   # one try of an optional change: toy, same warm start, validation

`run` does, in order, each part skipped once done: train toy; evaluate the toy warm start and
every saved toy checkpoint on validation (train rows 1900-1999, never demonstrated); evaluate the
toy warm start and GRPO policy on all 200 of its test questions; then train seed 2 and evaluate it
on its test questions, and the same for seed 3. Greedy, 5 turns x 128 tokens, float32 on a CPU.
On a 2-core AMD EPYC (AVX2, no AMX: float32 throughout) a warm start takes 15 min, a GRPO step
4.6-8 min (the toy run's steps 9-16: 339 s on average), and evaluation 6-8 s a question (two processes): about 10 hours in all.
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE, os.path.join(ROOT, "tools")]
import evaluate  # noqa: E402
from chain_funnel import funnel  # noqa: E402
from plot_curve import read_rows  # noqa: E402

WORLDS = {"toy": 0, "seed2": 2, "seed3": 3}  # name -> toy/make_toy.py seed
TYPES = ("single", "bridge", "comparison")
EVAL_ARGS = ["--max_turns", "5", "--max_new_tokens", "128", "--default_top_n", "5", "--max_top_n", "10"]  # as `make run` evaluates
VALIDATION_ROWS = (1900, 2000)  # train rows never demonstrated (the warm start takes the first 100)


# ---------------------------------------------------------------------------------------------
# 1. The runs
# ---------------------------------------------------------------------------------------------
def world_data(out: str, world: str) -> str:
    """The world's folder (train.jsonl, test.jsonl, corpus.jsonl): made on first use."""
    if world == "toy":
        return os.path.join(ROOT, "data", "toy")
    folder = os.path.join(out, "data", world)
    if not os.path.isfile(os.path.join(folder, "corpus.jsonl")):
        sh([sys.executable, os.path.join(ROOT, "toy", "make_toy.py"), "--seed", str(WORLDS[world]), "--out", folder])
    return folder


def validation_file(out: str) -> str:
    """Toy train rows 1900-1999 as their own file (dataset name `validation`)."""
    path = os.path.join(out, "data", "validation", "validation.jsonl")
    if not os.path.isfile(path):
        with open(os.path.join(ROOT, "data", "toy", "train.jsonl"), encoding="utf-8") as f:
            rows = f.readlines()[slice(*VALIDATION_ROWS)]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(rows)
        os.replace(path + ".tmp", path)
    return path


def sh(cmd: list[str]):
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def train(out: str, world: str, steps: int, threads: int, run: str | None = None, extra: tuple[str, ...] = ()):
    """GRPO on the world with the toy preset (and `extra` train.py flags) into out/<run> (default: the world's name)."""
    run_dir = os.path.join(out, run or world)
    if os.path.isfile(os.path.join(run_dir, f"checkpoint-{steps}", "config.json")):
        return
    data = world_data(out, world)
    sh([sys.executable, "-m", "accelerate.commands.launch", "--num_cpu_threads_per_process", str(threads),
        os.path.join(ROOT, "train.py"), "--output_dir", run_dir, "--max_steps", str(steps), "--resume",
        "--train_data", os.path.join(data, "train.jsonl"), "--corpus", os.path.join(data, "corpus.jsonl"),
        "--keep_checkpoints", str(steps), *extra])  # keep every checkpoint (the curve's)


def evaluate_policy(model: str, data: str, corpus: str, out_dir: str, processes: int):
    """evaluate.py in `processes` single-threaded CPU processes (on 2 cores, 1.78x the questions an
    hour of one process with 2 threads); the same predictions, question for question."""
    if not os.path.isfile(os.path.join(out_dir, "results.json")):
        sh([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            os.path.join(ROOT, "evaluate.py"), "--model", model, "--data", data, "--corpus", corpus,
            "--output_dir", out_dir, *EVAL_ARGS])


def policy(out: str, world: str, step: int) -> str:
    return os.path.join(out, world, "warm_start" if step == 0 else f"checkpoint-{step}")


def coarse_to_fine(last: int) -> list[int]:
    """The curve's even steps 0..last, halving the stride: 16 -> [0, 16, 8, 4, 12, 2, 6, 10, 14]."""
    order, stride = [0] + [last] * (last > 0), last
    while stride > 2:
        stride //= 2
        order += [s for s in range(stride, last, stride) if s not in order and s % 2 == 0]
    return order + [s for s in range(0, last + 1, 2) if s not in order]


def run(args):
    """Toy first (training, its validation curve, its test), then each other world (training, test):
    what is finished when a long run stops is whole."""
    threads = args.threads or os.cpu_count() or 1
    for world in WORLDS:
        train(args.out, world, args.curve_steps if world == "toy" else args.steps, threads)
        if world == "toy":
            for step in coarse_to_fine(args.curve_steps):  # a stop part-way still leaves a curve over all steps
                evaluate_policy(policy(args.out, "toy", step), validation_file(args.out), os.path.join(ROOT, "data", "toy", "corpus.jsonl"),
                                os.path.join(args.out, "eval", "toy", f"validation-{step}"), threads)
        data = world_data(args.out, world)
        for step in (0, args.steps):
            evaluate_policy(policy(args.out, world, step), os.path.join(data, "test.jsonl"), os.path.join(data, "corpus.jsonl"),
                            os.path.join(args.out, "eval", world, f"test-{step}"), threads)


def try_change(args):
    """One try of an optional change: toy GRPO with extra train.py flags (--flags), from a copy of
    the toy run's warm start, its policy at --steps evaluated on validation. `report` sets it,
    paired, beside the plain run's policy at the same step. Resumable like `run`."""
    name = f"try-{args.name}"
    warm = os.path.join(args.out, name, "warm_start")
    if not os.path.isdir(warm):
        shutil.copytree(policy(args.out, "toy", 0), warm)
    with open(os.path.join(args.out, name, "flags.txt"), "w", encoding="utf-8") as f:
        f.write(args.flags + "\n")
    threads = args.threads or os.cpu_count() or 1
    train(args.out, "toy", args.steps, threads, run=name, extra=tuple(shlex.split(args.flags)))
    evaluate_policy(os.path.join(args.out, name, f"checkpoint-{args.steps}"), validation_file(args.out),
                    os.path.join(ROOT, "data", "toy", "corpus.jsonl"), os.path.join(args.out, "eval", "toy", f"{name}-{args.steps}"), threads)


# ---------------------------------------------------------------------------------------------
# 2. What each policy did: F1, end reasons, searches and the second hop, by question type
# ---------------------------------------------------------------------------------------------
def load_predictions(eval_dir: str) -> list[dict]:
    with open(os.path.join(eval_dir, "predictions.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_world(data_file: str, corpus: str | None = None) -> tuple[dict, dict]:
    """(rows by id, passage text by id) of a toy world's question file and its corpus (default: beside it)."""
    with open(data_file, encoding="utf-8") as f:
        rows = {str(r["id"]): r for r in map(json.loads, f)}
    with open(corpus or os.path.join(os.path.dirname(data_file), "corpus.jsonl"), encoding="utf-8") as f:
        passages = {str(r["id"]): r["contents"].split("\n", 1)[-1] for r in map(json.loads, f)}
    return rows, passages


def behaviour(predictions: list[dict], rows: dict, passages: dict) -> dict:
    """Per policy: n, F1 / EM / format-valid (mean, 95% interval), end reasons, turn-limit share,
    and per question type: n, F1, searches a question; for bridges, the share that searched the
    second hop after the first hop's answer reached the memory (chain_funnel's stage)."""
    mean = lambda v: sum(v) / len(v) if v else float("nan")  # noqa: E731
    out = {"n": len(predictions), "ends": dict(Counter(p["end_reason"] for p in predictions))}
    for m, values in (("f1", [p["f1"] for p in predictions]), ("em", [p["em"] for p in predictions]),
                      ("format_valid", [float(p["reward"] > 0) for p in predictions]),
                      ("searches", [p["num_searches"] for p in predictions])):
        out[m] = (mean(values), evaluate.bootstrap_interval(values))
    out["turn_limit"] = out["ends"].get("max_turns", 0) / max(len(predictions), 1)
    by_type = defaultdict(list)
    for p in predictions:
        row = rows.get(str(p["id"]))
        if row is None:
            raise SystemExit(f"rl_worlds.py: prediction {p['id']!r} is not a question of this world")
        by_type[row["metadata"]["type"]].append((p, row["metadata"]["chain"]))
    out["types"] = {}
    for kind in TYPES:
        pairs = by_type.get(kind, [])
        entry = {"n": len(pairs), "f1": mean([p["f1"] for p, _ in pairs]), "searches": mean([p["num_searches"] for p, _ in pairs])}
        if kind == "bridge":  # funnel: hop 1 searched, retrieved, in memory, then hop 2 searched (index 3)
            entry["hop2_searched"] = mean([float(funnel(p, chain, passages)[3]) for p, chain in pairs])
        out["types"][kind] = entry
    return out


def paired(a: list[dict], b: list[dict]) -> tuple[float, list[float]]:
    """B - A in F1 over the questions both answered, with its paired 95% interval."""
    return evaluate.paired_difference(a, b)["f1"]


# ---------------------------------------------------------------------------------------------
# 3. The report: the table of worlds, goals, the curve, figures
# ---------------------------------------------------------------------------------------------
def fmt(value_interval, digits=2, signed=False) -> str:
    """(value, (lo, hi)) as `0.34 [0.26, 0.43]`; a difference signed: `+0.205 [+0.105, +0.300]`."""
    value, (lo, hi) = value_interval
    spec = f"{'+' if signed else ''}.{digits}f"
    return f"{value:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def whole(stats: dict, world: str, steps: int) -> bool:
    """Both of the world's policies (warm start and GRPO) are evaluated: it is in the pool and the figure."""
    return (world, 0) in stats and (world, steps) in stats


def world_table(out: str, steps: int) -> tuple[list[str], dict]:
    lines = ["| world | policy | format-valid | EM | F1 | paired F1 − warm start | ends: answer / turn limit | "
             "F1 single / bridge / comparison | searches single / bridge / comparison | bridge: hop 2 searched |",
             "|" + " --- |" * 10]
    stats, pool = {}, {0: [], steps: []}
    for world in WORLDS:
        done = [s for s in (0, steps) if os.path.isfile(os.path.join(out, "eval", world, f"test-{s}", "results.json"))]
        if not done:
            lines.append(f"| {world} | not evaluated yet |" + " |" * 8)
            continue
        rows, passages = load_world(os.path.join(world_data(out, world), "test.jsonl"))
        predictions = {s: load_predictions(os.path.join(out, "eval", world, f"test-{s}")) for s in done}
        for s in (0, steps):
            if s not in done:  # one policy evaluated: its row stands alone, outside the pool
                lines.append(f"| {world} | {'warm start' if s == 0 else f'GRPO {s} steps'}: not evaluated yet |" + " |" * 8)
                continue
            if len(done) == 2:
                pool[s] += predictions[s]
            b = stats[world, s] = behaviour(predictions[s], rows, passages)
            t = b["types"]
            diff = fmt(paired(predictions[0], predictions[s]), 3, signed=True) if s and 0 in done else "–"
            lines.append(f"| {world} | {'warm start' if s == 0 else f'GRPO {s} steps'} | {b['format_valid'][0]:.2f} | "
                         f"{fmt(b['em'])} | {fmt(b['f1'])} | {diff} | {b['ends'].get('answer', 0)} / {b['ends'].get('max_turns', 0)} | "
                         + " / ".join(f"{t[k]['f1']:.2f}" for k in TYPES) + " | "
                         + " / ".join(f"{t[k]['searches']:.2f}" for k in TYPES) + f" | {t['bridge']['hop2_searched']:.0%} |")
    if not pool[0]:
        return lines, stats
    for s in (0, steps):
        f1 = [p["f1"] for p in pool[s]]
        stats["pool", s] = {"f1": (sum(f1) / len(f1), evaluate.bootstrap_interval(f1)), "n": len(f1)}
    stats["pool", "diff"] = paired(pool[0], pool[steps])
    worlds = sum(whole(stats, w, steps) for w in WORLDS)
    lines.append(f"| pool of {len(pool[0])} ({worlds} of {len(WORLDS)} worlds) | warm start → GRPO | | | {fmt(stats['pool', 0]['f1'])} → "
                 f"{fmt(stats['pool', steps]['f1'])} | {fmt(stats['pool', 'diff'], 3, signed=True)} | | | | |")
    return lines, stats


def goals(stats: dict, steps: int) -> list[str]:
    say = lambda ok: "**met**" if ok else "**not met**"  # noqa: E731
    diff, (lo, _) = stats["pool", "diff"]
    em = [stats[w, steps]["em"][0] for w in WORLDS]
    limit = (stats["seed3", 0]["turn_limit"], stats["seed3", steps]["turn_limit"])
    conditional = all(stats[w, steps]["types"]["bridge"]["hop2_searched"] > stats[w, 0]["types"]["bridge"]["hop2_searched"]
                      and stats[w, steps]["types"]["single"]["searches"] <= stats[w, 0]["types"]["single"]["searches"]
                      and all(stats[w, steps]["types"][k]["f1"] >= stats[w, 0]["types"][k]["f1"] for k in TYPES)
                      for w in WORLDS)
    valid = [stats[w, steps]["format_valid"][0] for w in WORLDS]
    return [f"- pooled paired F1 > 0 beyond its interval: {diff:+.3f}, lower bound {lo:+.3f}: {say(lo > 0)}",
            f"- test EM within 0.1 across worlds after GRPO: " + ", ".join(f"{e:.2f}" for e in em)
            + f" (spread {max(em) - min(em):.2f}): {say(max(em) - min(em) <= 0.1)}",
            f"- seed 3's turn-limit share at least halves: {limit[0]:.2f} → {limit[1]:.2f}: {say(limit[1] <= limit[0] / 2)}",
            f"- bridges search hop 2 more, single-hop not more, no type's F1 below the warm start's, every world: {say(conditional)}",
            f"- format-valid ≥ 0.95 in every world: " + ", ".join(f"{v:.2f}" for v in valid) + f": {say(min(valid) >= 0.95)}"]


def curve(out: str, curve_steps: int) -> tuple[list[str], list[tuple]]:
    rows, passages = load_world(validation_file(out), os.path.join(ROOT, "data", "toy", "corpus.jsonl"))
    points, warm = [], None
    lines = ["| step | format-valid | F1 | paired F1 − warm start | searches | turn limit | F1 single / bridge / comparison | "
             "searches single / bridge / comparison | bridge: hop 2 searched |", "|" + " --- |" * 9]
    for s in range(0, curve_steps + 1, 2):
        folder = os.path.join(out, "eval", "toy", f"validation-{s}")
        if not os.path.isfile(os.path.join(folder, "results.json")):
            continue
        predictions = load_predictions(folder)
        warm = predictions if s == 0 else warm
        b = behaviour(predictions, rows, passages)
        points.append((s, *b["f1"]))
        diff = fmt(paired(warm, predictions), 3, signed=True) if s and warm else "–"
        lines.append(f"| {s} | {b['format_valid'][0]:.2f} | {fmt(b['f1'])} | {diff} | {b['searches'][0]:.2f} | "
                     f"{b['turn_limit']:.2f} | " + " / ".join(f"{b['types'][k]['f1']:.2f}" for k in TYPES) + " | "
                     + " / ".join(f"{b['types'][k]['searches']:.2f}" for k in TYPES) + f" | {b['types']['bridge']['hop2_searched']:.0%} |")
    return lines, points


def tries(out: str, steps: int) -> list[str]:
    """Each try's validation row (as the curve's), paired against the plain run at the same step."""
    rows, passages = load_world(validation_file(out), os.path.join(ROOT, "data", "toy", "corpus.jsonl"))
    plain = os.path.join(out, "eval", "toy", f"validation-{steps}")
    lines = ["| try (train.py flags) | format-valid | F1 | paired F1 − plain GRPO | searches single / bridge / comparison | "
             "F1 single / bridge / comparison | bridge: hop 2 searched | training reward, steps 1–N |", "|" + " --- |" * 8]
    names = os.listdir(out) if os.path.isdir(out) else []
    found = sorted(d for d in names if d.startswith("try-") and os.path.isdir(os.path.join(out, d)))  # not try-NAME.log
    for name in found:
        folder = os.path.join(out, "eval", "toy", f"{name}-{steps}")
        if not os.path.isfile(os.path.join(folder, "results.json")) or not os.path.isfile(os.path.join(plain, "results.json")):
            lines.append(f"| {name} | not evaluated yet |" + " |" * 6)
            continue
        with open(os.path.join(out, name, "flags.txt"), encoding="utf-8") as f:
            flags = f.read().strip()
        predictions = load_predictions(folder)
        b = behaviour(predictions, rows, passages)
        t = b["types"]
        rewards = [r for _, r in training_rewards(os.path.join(out, name, "metrics.jsonl"))]
        lines.append(f"| {name} (`{flags}`) | {b['format_valid'][0]:.2f} | {fmt(b['f1'])} | "
                     f"{fmt(paired(load_predictions(plain), predictions), 3, signed=True)} | "
                     + " / ".join(f"{t[k]['searches']:.2f}" for k in TYPES) + " | " + " / ".join(f"{t[k]['f1']:.2f}" for k in TYPES)
                     + f" | {t['bridge']['hop2_searched']:.0%} | " + ", ".join(f"{r:.2f}" for r in rewards) + " |")
    return lines if found else []


def training_rewards(metrics: str) -> list[tuple[int, float]]:
    """(step, mean reward of the step's sampled trajectories) of a run's GRPO rows."""
    if not os.path.isfile(metrics):
        return []
    rows, _ = read_rows(metrics)  # a line being written is skipped
    return [(r["step"], r["reward"]) for r in rows if r.get("phase") == "grpo"]


def plot(out: str, stats: dict, steps: int, points: list[tuple], figures: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(figures, exist_ok=True)
    names = [w for w in list(WORLDS) + ["pool"] if whole(stats, w, steps)]
    if names:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for k, (s, label, colour) in enumerate(((0, "warm start", "tab:gray"), (steps, f"GRPO {steps} steps", "tab:blue"))):
            xs = [i + (k - 0.5) * 0.36 for i in range(len(names))]
            values = [stats[w, s]["f1"] for w in names]
            ax.bar(xs, [v for v, _ in values], width=0.34, color=colour, label=label,
                   yerr=[[v - lo for v, (lo, _) in values], [hi - v for v, (_, hi) in values]], capsize=3)
        ax.set_xticks(range(len(names)), [f"{w}\n({stats[w, 0]['n']} q)" for w in names])
        ax.set_ylabel("test F1 (95% interval)")
        ax.legend(frameon=False)
        fig.tight_layout()
        fig.savefig(os.path.join(figures, "worlds_f1.png"), dpi=120)
    if points:
        fig, (ax, right) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
        s, f1, band = zip(*points)
        ax.plot(s, f1, "o-", color="tab:blue", label="GRPO checkpoint")
        ax.fill_between(s, [lo for lo, _ in band], [hi for _, hi in band], color="tab:blue", alpha=0.2)
        if s[0] == 0:
            ax.axhline(f1[0], color="tab:gray", ls="--", label="warm start")
            ax.axhspan(*band[0], color="tab:gray", alpha=0.12)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("validation F1 (100 q, 95% interval)")
        ax.legend(frameon=False)
        steps_rewards = training_rewards(os.path.join(out, "toy", "metrics.jsonl"))
        if steps_rewards:
            right.plot(*zip(*steps_rewards), ".-", color="tab:orange")
        last = max([*s, *(step for step, _ in steps_rewards)])
        for a in (ax, right):
            a.set_xticks(range(0, last + 1, 2))
        right.set_xlabel("GRPO step")
        right.set_ylabel("training reward (16 trajectories)")
        fig.tight_layout()
        fig.savefig(os.path.join(figures, "learning_curve_validation.png"), dpi=120)


def report(args):
    table, stats = world_table(args.out, args.steps)
    curve_lines, points = curve(args.out, args.curve_steps)
    complete = all(whole(stats, w, args.steps) for w in WORLDS)
    try_lines = tries(args.out, args.steps)
    text = "\n".join(["## Test, each world's warm start and GRPO", "", *table, "", "## Goals", "",
                      *(goals(stats, args.steps) if complete else ["(when every world is evaluated)"]),
                      "", "## Validation curve (toy)", "", *curve_lines, ""]
                     + (["## Tries of an optional change (validation, at the table's step)", "", *try_lines, ""] if try_lines else []))
    print(text)
    with open(os.path.join(args.out, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    plot(args.out, stats, args.steps, points, args.figures)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["run", "report", "try"])
    ap.add_argument("--out", default=os.path.join("runs", "worlds"), help="runs, evaluations and the new worlds' data")
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps of the table's policies")
    ap.add_argument("--curve_steps", type=int, default=16, help="GRPO steps of the toy run (a checkpoint every 2)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for training, and evaluation processes (0: all cores)")
    ap.add_argument("--figures", default=os.path.join(HERE, "figures"))
    ap.add_argument("--name", help="try: its name (out/try-NAME)")
    ap.add_argument("--flags", default="", help="try: the train.py flags it adds, e.g. '--reroll_turn 1'")
    args = ap.parse_args(argv)
    if args.what == "try" and not (args.name and args.flags):
        ap.error("try needs --name and --flags")
    {"run": run, "report": report, "try": try_change}[args.what](args)


if __name__ == "__main__":
    main()
