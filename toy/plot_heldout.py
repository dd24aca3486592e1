"""Held-out F1 with its 95% interval, per policy and world, as bars (from evaluate.py results).

    python toy/plot_heldout.py "toy/warm start=runs/eval/warm/results.json" \
        "toy/+ GRPO=runs/eval/grpo/results.json" --out docs/figures/heldout_f1.png

Each argument is WORLD/POLICY=RESULTS: the bars of one world stand together, one colour per policy.
The value is the pooled F1 over all of the run's questions ("average" in results.json, the same as
the dataset's own when there is one dataset) and the whiskers its 95% bootstrap interval.
"""
import argparse
import json


def read(spec):
    label, path = spec.split("=", 1)
    world, policy = label.split("/", 1) if "/" in label else ("", label)
    results = json.load(open(path))
    (dataset,) = results["datasets"].values() if len(results["datasets"]) == 1 else (results["average"],)
    return world, policy, dataset["f1"], dataset["interval"]["f1"], dataset["n"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="WORLD/POLICY=path/to/results.json")
    ap.add_argument("--out", default="heldout_f1.png")
    ap.add_argument("--title", default="held-out F1, greedy, 95% bootstrap interval")
    args = ap.parse_args(argv)
    rows = [read(spec) for spec in args.runs]
    for world, policy, f1, (lo, hi), n in rows:
        print(f"{world:<10} {policy:<30} F1 {f1:.3f} [{lo:.3f}, {hi:.3f}]  ({n} questions)")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = list(dict.fromkeys(r[0] for r in rows))
    policies = list(dict.fromkeys(r[1] for r in rows))
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(max(5.5, 1.2 + 1.4 * len(worlds) * len(policies)), 3.8))
    for k, policy in enumerate(policies):
        xs, ys, errs = [], [], [[], []]
        for w, world in enumerate(worlds):
            for r in rows:
                if r[:2] == (world, policy):
                    xs.append(w + (k - (len(policies) - 1) / 2) * width)
                    ys.append(r[2])
                    errs[0].append(r[2] - r[3][0])
                    errs[1].append(r[3][1] - r[2])
        ax.bar(xs, ys, width, yerr=errs, capsize=3, label=policy)
    ax.set_xticks(range(len(worlds)), [f"{w}\n({next(r[4] for r in rows if r[0] == w)} questions)" for w in worlds])
    ax.set_ylabel("F1")
    ax.set_ylim(0, 1)
    ax.set_title(args.title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
