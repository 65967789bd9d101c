"""Held-out success of several runs of one recipe (one per seed) in one plot, and their table.

    uv run python tools/plot_seeds.py runs/seed0 runs/seed1 runs/seed2 --out docs/curve.png

Each run directory's ``metrics.jsonl`` gives ``eval_reward_mean`` by step (its first evaluation
is the model before RL). Prints a Markdown table: start, best, final and gain per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["eval_reward_mean"]) for r in rows if "eval_reward_mean" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="held-out success")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    print("| run | start | best | final | final - start |\n|---|---|---|---|---|")
    for run in args.runs:
        points = curve(run)
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, label=run.name)
        first, last = values[0], values[-1]
        print(f"| {run.name} | {first:.2f} | {max(values):.2f} | {last:.2f} | {last - first:+.2f} |")
    ax.set_xlabel("policy version (train step)")
    ax.set_ylabel("held-out success")
    ax.set_ylim(0, 1)
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
