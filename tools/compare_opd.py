"""On-policy distillation against RL alone, over seeds, in one command: per domain, held-out
success by train step of each variant (mean over seeds, the seeds' range shaded) and the
domain's teacher, one plot; a table of what a user compares them on.

    uv run python tools/compare_opd.py --out runs/opd-vs-rl [--recipe tiny-multi-teacher-opd]
        [--seeds 0,1,2] [--variant NAME=KEY=VALUE,KEY=VALUE ...] [--set KEY=VALUE ...]

Variants (``--variant``, repeatable; each is the recipe with its overrides, ``--set`` applies to
all): by default ``RL only`` (``opd.enabled=false``: the task reward alone, everything else
equal) and ``OPD`` (the recipe as shipped). Every variant and seed is one ``loong-train run``
into ``OUT/<variant>-s<seed>``, one at a time; the warm start and the teachers are built once
into the cache and shared. An existing run directory with a ``summary.json`` is not run again.

``OUT/eval_by_domain.png`` is the plot, ``OUT/comparison.md`` the table and ``OUT/comparison.json``
its numbers. Per variant and domain: final success (mean over seeds, and each seed's), the first
step at which the mean curve reaches 0.9x the teacher's success, the first step at which it
reaches the level where the first variant (RL only) ends, and the mean wall time of a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

DEFAULT_VARIANTS = ["RL only=opd.enabled=false", "OPD="]
TEACHER_SHARE = 0.9


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``NAME=KEY=VALUE,KEY=VALUE`` -> (name, ["KEY=VALUE", ...]); ``NAME=`` has no overrides."""
    name, _, sets = spec.partition("=")
    return name, [s for s in sets.split(",") if s]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def run(recipe: str, sets: list[str], out: Path, cache: Path) -> None:
    """One ``loong-train run`` into ``out`` (skipped when ``out`` already holds a finished run)."""
    if (out / "summary.json").exists():
        print(f"{out}: finished earlier, reused", flush=True)
        return
    cmd = [sys.executable, "-m", "loong_train.cli", "run", recipe, "--out", str(out), "--cache", str(cache)]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True)


def curves(summary: dict) -> dict[str, list[tuple[int, float]]]:
    """Per domain: (policy version, held-out success), by version."""
    return {
        d: sorted((int(v), x) for v, x in by.items()) for d, by in summary["eval_reward_by_domain"].items()
    }


def mean_curve(runs: list[list[tuple[int, float]]]) -> list[tuple[int, float, float, float]]:
    """(step, mean, min, max) over runs, at the steps every run evaluated (at least one)."""
    common = sorted(set.intersection(*({s for s, _ in c} for c in runs)))
    if not common:
        raise ValueError(f"the runs share no evaluated step: {[[s for s, _ in c] for c in runs]}")
    out = []
    for step in common:
        xs = [dict(c)[step] for c in runs]
        out.append((step, statistics.fmean(xs), min(xs), max(xs)))
    return out


def first_step(curve: list[tuple[int, float, float, float]], level: float) -> int | None:
    """The first step whose mean success is at least ``level``; None if none is."""
    return next((step for step, mean, _, _ in curve if mean >= level - 1e-9), None)


def teacher_levels(runs: list[dict]) -> dict[str, dict]:
    """Per domain: its teacher's name, held-out success per seed (each seed builds its own
    teachers) and their mean, from the runs' summaries."""
    out: dict[str, dict] = {}
    for s in runs:
        for domain, t in s.get("teacher_by_domain", {}).items():
            row = out.setdefault(domain, {"teacher": t["teacher"], "per_seed": []})
            row["per_seed"].append(t["held_out_success"])
    for row in out.values():
        row["held_out_success"] = statistics.fmean(row["per_seed"])
    return out


def compare(summaries: dict[str, list[dict]]) -> dict:
    """Per domain, per variant: the mean curve, final success, steps to 0.9x teacher and to the
    first variant's final level, wall time; each domain's teacher level is its mean over the seeds.
    ``summaries``: variant -> its runs' summary.json, seeds in the same order for every variant."""
    first = next(iter(summaries))
    teachers = teacher_levels(summaries[first])
    domains = sorted(curves(summaries[first][0]))
    out = {"teachers": teachers, "domains": {}}
    for domain in domains:
        rows = {}
        for variant, runs in summaries.items():
            c = mean_curve([curves(s)[domain] for s in runs])
            rows[variant] = {
                "curve": c,
                "final": c[-1][1],
                "final_per_seed": [dict(curves(s)[domain])[c[-1][0]] for s in runs],  # at that step
                "wall_s": statistics.fmean(s["wall_s"] for s in runs),
            }
        baseline = rows[first]["final"]
        for row in rows.values():
            if domain in teachers:
                row["steps_to_teacher"] = first_step(
                    row["curve"], TEACHER_SHARE * teachers[domain]["held_out_success"]
                )
            row["steps_to_baseline_final"] = first_step(row["curve"], baseline)
        out["domains"][domain] = rows
    out["baseline"] = first
    return out


def table(result: dict) -> str:
    def steps(x: int | None) -> str:
        return "not reached" if x is None else str(x)

    lines = [
        f"| domain | variant | final success | per seed | steps to {TEACHER_SHARE}x teacher "
        f"| steps to {result['baseline']}'s final | wall time |",
        "|---|---|---|---|---|---|---|",
    ]
    for domain, rows in result["domains"].items():
        if teacher := result["teachers"].get(domain):
            seeds = ", ".join(f"{x:.2f}" for x in teacher["per_seed"])
            lines.append(
                f"| {domain} | teacher {teacher['teacher']!r} | {teacher['held_out_success']:.2f} | {seeds} | | | |"
            )
        for variant, r in rows.items():
            seeds = ", ".join(f"{x:.2f}" for x in r["final_per_seed"])
            lines.append(
                f"| {domain} | {variant} | {r['final']:.2f} | {seeds} | {steps(r.get('steps_to_teacher'))} "
                f"| {steps(r['steps_to_baseline_final'])} | {r['wall_s'] / 60:.1f} min |"
            )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(result["domains"])
    fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 3.8), squeeze=False)
    for ax, domain in zip(axes[0], domains, strict=True):
        for i, (variant, r) in enumerate(result["domains"][domain].items()):
            steps, mean, low, high = zip(*r["curve"], strict=True)
            ax.plot(steps, mean, "o-", ms=3, color=f"C{i}", label=variant)
            ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.15)
        if teacher := result["teachers"].get(domain):
            level = teacher["held_out_success"]
            ax.axhline(
                level, ls="--", color="k", lw=1, label=f"teacher {teacher['teacher']!r} (mean over seeds)"
            )
            ax.axhline(TEACHER_SHARE * level, ls=":", color="k", lw=1, label=f"{TEACHER_SHARE}x teacher")
        ax.set(xlabel="train step (policy version)", ylabel="held-out success", ylim=(-0.02, 1.02))
        ax.set_title(f"domain {domain!r}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", default="tiny-multi-teacher-opd")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument(
        "--variant", action="append", help="NAME=KEY=VALUE,...; repeatable; the first is the baseline"
    )
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every variant; repeatable")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "loong")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant or DEFAULT_VARIANTS]
    if len({slug(name) for name, _ in variants}) < len(variants):
        parser.error(f"--variant: names must differ in letters and digits: {[n for n, _ in variants]}")
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    summaries: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for seed in seeds:  # seed by seed: a cut-off comparison has every variant of its first seeds
        for name, sets in variants:
            out = args.out / f"{slug(name)}-s{seed}"
            run(args.recipe, [*args.set, *sets, f"seed={seed}"], out, args.cache)
            summaries[name].append(json.loads((out / "summary.json").read_text()))
    result = compare(summaries)
    (args.out / "comparison.json").write_text(json.dumps(result, indent=2))
    (args.out / "comparison.md").write_text(table(result) + "\n")
    plot(result, args.out / "eval_by_domain.png")
    print(table(result))


if __name__ == "__main__":
    main()
