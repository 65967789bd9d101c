"""End-of-run plots: reward and held-out eval reward, staleness, utilization, train-inference
mismatch and the generation spent on groups with no signal over steps; for task sets with domains, held-out success per domain beside a baseline run and the teachers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loong_core.telemetry import read_metrics

__all__ = ["plot_domains", "plot_run"]


def plot_run(run_dir: Path, evals: dict[int, float]) -> list[Path]:
    """Write ``plots/{reward,staleness,utilization,mismatch,signal}.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl")
    out = []
    for name, size, draw in (
        ("reward.png", (7, 4), _reward),
        ("staleness.png", (7, 3.5), _staleness),
        ("utilization.png", (7, 3.5), _utilization),
        ("mismatch.png", (7, 3.5), _mismatch),
        ("signal.png", (7, 3.5), _signal),
    ):
        fig, ax = plt.subplots(figsize=size)
        draw(ax, rows, evals)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:  # a run without a step has no curve
            ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / "plots" / name, dpi=110)
        plt.close(fig)
        out.append(run_dir / "plots" / name)
    return out


def _reward(ax, rows: list[dict], evals: dict[int, float]) -> None:
    ax.plot(
        [r["step"] for r in rows],
        [r["reward_mean"] for r in rows],
        label="train reward (batch mean)",
        alpha=0.7,
    )
    ax.plot(list(evals), list(evals.values()), "o-", label="held-out eval reward", color="C3")
    ax.set(xlabel="train step (policy version)", ylabel="reward", ylim=(-0.02, 1.02), title="Reward")


def _staleness(ax, rows: list[dict], evals: dict[int, float]) -> None:
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["staleness_mean"] for r in rows], label="mean")
    ax.step(steps, [r["staleness_max"] for r in rows], where="mid", label="max")
    ax.set(xlabel="train step", ylabel="staleness (versions)", title="Sample staleness")


def _utilization(ax, rows: list[dict], evals: dict[int, float]) -> None:
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["trainer_busy_frac"] for r in rows], label="trainer busy")
    ax.plot(steps, [r["rollout_busy_frac"] for r in rows], label="rollout busy")
    if all("engine_busy_frac" in r for r in rows):  # embedded engines count their forwards
        ax.plot(steps, [r["engine_busy_frac"] for r in rows], label="engine busy (forward running)")
    ax.set(xlabel="train step", ylabel="busy fraction", ylim=(0, 1.05), title="Utilization")


def _mismatch(ax, rows: list[dict], evals: dict[int, float]) -> None:
    for key, label in (("mismatch_kl", "all tokens"), ("onpolicy_mismatch_kl", "on-policy tokens only")):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), ".-", label=label)
    ax.set(
        xlabel="train step",
        ylabel="KL(rollout || trainer)",
        title="Train-inference mismatch (k3, before update)",
    )
    ax.set_yscale("symlog", linthresh=1e-8)


def _signal(ax, rows: list[dict], evals: dict[int, float]) -> None:
    """The share of each step's generation in groups with nothing to learn and, with a
    curriculum, the share of prompts seen that rest as solved or hopeless."""
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r.get("no_signal_share", 0.0) for r in rows], label="generation with no signal")
    if rows and "prompts_active" in rows[-1]:
        seen = [max(1, r["prompts_active"] + r["prompts_solved"] + r["prompts_hopeless"]) for r in rows]
        for key, label in (("prompts_solved", "prompts resting: solved"), ("prompts_hopeless", "hopeless")):
            ax.plot(steps, [r[key] / n for r, n in zip(rows, seen, strict=True)], "--", label=label)
    ax.set(xlabel="train step", ylabel="share", ylim=(-0.02, 1.02), title="Generation without signal")


def plot_domains(run_dir: Path, summary: dict[str, Any], baseline: Path | None = None) -> Path:
    """Write ``plots/eval_by_domain.png``: one panel per domain with this run's held-out success
    by policy version, the baseline run's (when ``baseline/summary.json`` exists) and, dashed, the
    held-out success of the domain's teacher."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(summary.get("label", run_dir.name), summary, "C3")]
    if baseline is not None and (baseline / "summary.json").exists():
        other = json.loads((baseline / "summary.json").read_text())
        runs.append((other.get("label", baseline.name), other, "C0"))
    domains = sorted(summary["eval_reward_by_domain"])
    fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 3.8), squeeze=False)
    for ax, domain in zip(axes[0], domains, strict=True):
        for label, s, color in runs:
            curve = sorted((int(v), x) for v, x in s.get("eval_reward_by_domain", {}).get(domain, {}).items())
            if curve:
                ax.plot(*zip(*curve, strict=True), "o-", color=color, label=label)
        if teacher := summary.get("teacher_by_domain", {}).get(domain):
            ax.axhline(
                teacher["held_out_success"], ls="--", color="C2", label=f"teacher {teacher['teacher']!r}"
            )
        ax.set(xlabel="train step (policy version)", ylabel="held-out success", ylim=(-0.02, 1.02))
        ax.set_title(f"domain {domain!r}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    path = run_dir / "plots" / "eval_by_domain.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
