"""The learning curve of a train.py run, as it is: tables, and a plot when matplotlib is there.

    python tools/plot_curve.py runs/memsearcher/metrics.jsonl            # tables (+ reward.png beside it)
    python tools/plot_curve.py /tmp/run/metrics.jsonl --out curve.png --window 5

Reads metrics.jsonl (a run still writing it is fine: a partial last line is skipped). The warm
start (rows with phase "warm_start") is a table of its negative log-likelihood per step; GRPO
(one row per step) is step, reward, its moving average over `--window` steps, format_valid, turns,
searches, the share of groups with all-equal rewards, kl, clip fraction and seconds per step, then
the mean reward of the first and last `--window` steps. Nothing is smoothed away: the raw reward is
printed and plotted next to its moving average. The plot puts both phases on one time line.
"""
import argparse
import json
import os


def read_rows(path):
    rows, skipped = [], 0
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written right now
                skipped += 1
    return rows, skipped


def moving_average(values, window):
    """Mean of the last `window` values at each point (fewer at the start)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1):i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def seconds_per_step(row):
    return sum(row.get(k, 0.0) for k in ("seconds_rollout", "seconds_reference", "seconds_update"))


def print_warm_start(rows):
    print(f"{'warm':>5} | {'NLL':>7} | {'tok/s':>6} | {'s':>5}")
    for r in rows:
        print(f"{r['step']:>5} | {r['loss']:>7.4f} | {r.get('tokens_per_second', 0):>6.0f} | {r.get('seconds', 0):>5.0f}")
    print(f"warm start: {len(rows)} steps, {sum(r.get('seconds', 0) for r in rows) / 60:.1f} min, "
          f"NLL {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")


def print_table(rows, window):
    rewards = [r.get("reward", float("nan")) for r in rows]
    smooth = moving_average(rewards, window)
    print(f"{'step':>5} | {'reward':>7} | {f'MA{window}':>7} | {'format':>6} | {'turns':>5} | {'searches':>8} | "
          f"{'equal':>5} | {'kl':>8} | {'clip':>5} | {'s/step':>6}")
    for r, ma in zip(rows, smooth):
        print(f"{r.get('step', 0):>5} | {r.get('reward', float('nan')):>7.3f} | {ma:>7.3f} | "
              f"{r.get('format_valid', float('nan')):>6.2f} | {r.get('turns', float('nan')):>5.2f} | "
              f"{r.get('searches', float('nan')):>8.2f} | {r.get('equal_reward_groups', float('nan')):>5.2f} | "
              f"{r.get('kl', float('nan')):>8.5f} | {r.get('clip_frac', float('nan')):>5.3f} | {seconds_per_step(r):>6.0f}")
    k = min(window, len(rows))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    total = sum(seconds_per_step(r) for r in rows)
    print(f"{len(rows)} steps, {total / 60:.0f} min of steps: mean reward of the first {k} steps {first:.3f}, "
          f"of the last {k} {last:.3f} ({last - first:+.3f})")
    return rewards, smooth


def describe_run(folder, warm, rows):
    """What was run, for the plot's title: the policy, the batch and the recipe, read from the newest
    checkpoint's trainer_state.json (or warm_start/'s) beside metrics.jsonl."""
    states = sorted((os.path.join(root, "trainer_state.json") for root, _, files in os.walk(folder)
                     if "trainer_state.json" in files), key=os.path.getmtime)
    if not states:
        return f"{len(warm)} warm-start steps, {len(rows)} GRPO steps"
    a = json.load(open(states[-1]))["args"]
    model = "SmolLM2-135M" if a.get("model") == "default" else os.path.basename(str(a.get("model")))
    recipe = [name for name, on in (("oracle" + (" when unsolved" if a.get("oracle_when_unsolved") else ""),
                                     a.get("oracle_per_group")),
                                    (f"evidence {a.get('evidence_weight')}", a.get("evidence_weight")),
                                    ("equal groups skipped", a.get("skip_equal_groups")),
                                    (f"KL {a.get('kl_coef')}", a.get("kl_coef"))) if on]
    return (f"{model}: {len(warm)} warm-start steps, then GRPO {len(rows)} steps x {a.get('batch_size')} questions x "
            f"G {a.get('group_size')}" + (f"\n({', '.join(recipe)})" if recipe else " (released recipe)"))


def plot(warm, rows, rewards, smooth, window, path, title):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = [p for p in (warm, rows) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    if warm:
        ax = axes[0][0]
        ax.plot([r["step"] for r in warm], [r["loss"] for r in warm], marker=".", color="tab:gray")
        ax.set_xlabel("warm-start step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("NLL of demonstrations (trained tokens)")
        ax.set_title("1. warm start")
    if rows:
        ax = axes[0][-1]
        steps = [r.get("step", i + 1) for i, r in enumerate(rows)]
        ax.plot(steps, rewards, marker=".", alpha=0.5, label="reward (per step)")
        ax.plot(steps, smooth, label=f"moving average ({window} steps)")
        if any("evidence" in r for r in rows):
            ax.plot(steps, [r.get("evidence", float("nan")) for r in rows], linestyle="--", label="evidence share retrieved")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("sampled trajectories' answer reward")
        ax.set_ylim(-0.02, 1.02)  # the reward's whole range: no zooming into noise
        ax.set_title(("2. " if warm else "") + "GRPO")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", help="a train.py metrics.jsonl")
    ap.add_argument("--out", help="the plot (default: reward.png beside the metrics file)")
    ap.add_argument("--window", type=int, default=5, help="moving-average window in steps")
    ap.add_argument("--title", help="the plot's title (default: what was run, from the run's newest trainer_state.json)")
    args = ap.parse_args(argv)
    rows, skipped = read_rows(args.metrics)
    if skipped:
        print(f"skipped {skipped} unreadable line(s) (a run still writing?)")
    if not rows:
        raise SystemExit(f"{args.metrics}: no rows yet")
    warm = [r for r in rows if r.get("phase") == "warm_start"]
    rows = [r for r in rows if r.get("phase", "grpo") == "grpo"]
    if warm:
        print_warm_start(warm)
    rewards, smooth = print_table(rows, max(1, args.window)) if rows else ([], [])
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "reward.png")
    title = args.title or describe_run(os.path.dirname(os.path.abspath(args.metrics)), warm, rows)
    plot(warm, rows, rewards, smooth, max(1, args.window), out, title)


if __name__ == "__main__":
    main()
