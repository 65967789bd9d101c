"""Held-out success of several runs in one plot, and their table: one curve per run, or one per
group of runs (an algorithm over seeds: its mean, with the seeds' range shaded).

    uv run python tools/plot_seeds.py runs/seed0 runs/seed1 runs/seed2 --out docs/curve.png
    uv run python tools/plot_seeds.py grpo=runs/grpo-s0,runs/grpo-s1 dapo=runs/dapo-s0,runs/dapo-s1 \\
        --out docs/algorithms.png

Each run directory's ``metrics.jsonl`` gives ``eval_reward_mean`` by the policy version it
evaluated (``eval_policy_version``; the first is the model before RL) and ``summary.json`` its wall time. A group's curve ends where its
shortest run's does (a run that stopped early). Prints a Markdown table: per run,
start, best, final and gain; per group, the means over its runs, each run's final success, and
the mean wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def curve(run: Path) -> list[tuple[int, float]]:
    """(policy version evaluated, held-out success) pairs. An evaluation's result lands at whichever
    train step is running when it finishes, so the version it evaluated is the x value."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [
        (r.get("eval_policy_version", r["step"]), r["eval_reward_mean"])
        for r in rows
        if "eval_reward_mean" in r
    ]


def wall_s(run: Path) -> float:
    """The run's wall time; for a run that stopped early (no summary), its last step's."""
    if (run / "summary.json").exists():
        return json.loads((run / "summary.json").read_text())["wall_s"]
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["elapsed_s"]


def _group(spec: str) -> tuple[str, list[Path]]:
    """``name=dir,dir,...`` -> (name, dirs); a plain directory is a group of one named after it."""
    name, _, dirs = spec.rpartition("=")
    paths = [Path(d) for d in dirs.split(",")]
    return name or paths[0].name, paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="a run directory, or NAME=DIR,DIR,... for a group")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="held-out success")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [_group(spec) for spec in args.runs]
    grouped = any(len(runs) > 1 for _, runs in groups)
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if not grouped:
        print("| run | start | best | final | final - start |\n|---|---|---|---|---|")
    else:
        print("| runs | start | best | final | final - start | final per run | wall time |")
        print("|---|---|---|---|---|---|---|")
    for name, runs in groups:
        curves = [curve(run) for run in runs]
        n = min(map(len, curves))  # a run that stopped early ends its group's curve there
        curves = [c[:n] for c in curves]
        steps = [s for s, _ in curves[0]]
        if any([s for s, _ in c] != steps for c in curves):
            raise SystemExit(f"{name}: its runs were evaluated at different steps")
        mean = [statistics.fmean(c[i][1] for c in curves) for i in range(len(steps))]
        ax.plot(steps, mean, label=name)
        if len(runs) > 1:
            low = [min(c[i][1] for c in curves) for i in range(len(steps))]
            high = [max(c[i][1] for c in curves) for i in range(len(steps))]
            ax.fill_between(steps, low, high, alpha=0.15)
        first, last = mean[0], mean[-1]
        row = f"| {name} | {first:.2f} | {max(mean):.2f} | {last:.2f} | {last - first:+.2f} |"
        if grouped:
            finals = ", ".join(f"{c[-1][1]:.2f}" for c in curves)
            row += f" {finals} | {statistics.fmean(map(wall_s, runs)) / 60:.1f} min |"
        print(row)
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
