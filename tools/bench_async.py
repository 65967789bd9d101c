"""Real CPU benchmark of the asynchronous pipeline against the best synchronous run on the same
cores, per workload.

    uv run python tools/bench_async.py --json async.json [--recipe tiny-calc-agent] [--window 2]
        [--steps 80] [--seeds 0,1] [--workload compute] [--workload tools=rollout.tool_latency_ms=200]

A workload is a name and the recipe overrides that make it (``NAME=KEY=VALUE,KEY=VALUE``; the
default: ``compute``, the recipe as shipped, and ``tools``, a 200 ms median tool latency per call,
:class:`loong_agentflow.Latency`). Per workload and seed, each configuration is its own
``loong-train run`` process (the warm start is cached and shared, so it is built once and excluded
from the timing):

- ``sync-t1``: ``train.max_staleness = 0`` (rollout and training alternate), one torch thread per
  actor (while one phase runs, the other actor's core idles);
- ``sync-t2``: synchronous, ``threads = 2``: each phase gets both cores;
- ``async-t1``: ``train.max_staleness = --window``, one thread per actor, one rollout call at a
  time per worker (the shipped setting);
- ``async-t1-cc``: as ``async-t1``, with ``rollout.engine.concurrent_calls = --window + 1`` (as
  many calls at once as the window holds batches): while one call's episodes wait on tools,
  another's keep the engine busy.

The baselines are the faster synchronous and the faster asynchronous configuration, chosen per
workload on the mean over seeds. Throughput is ``trained_samples_per_s`` of the run's last
metrics line: samples trained divided by the wall time since the actors started. Each run also
reports ``trainer_busy_frac``, ``engine_busy_frac`` (a forward running) and
``engine_rows_per_step`` of that line. The JSON holds, per workload, every configuration's means,
the best of each kind and ``speedup`` (best asynchronous over best synchronous); then every run.
It prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {  # name -> recipe overrides (besides the workload's); the async ones get the window in main
    "sync-t1": {"train.max_staleness": 0, "threads": 1},
    "sync-t2": {"train.max_staleness": 0, "threads": 2},
    "async-t1": {"threads": 1},
    "async-t1-cc": {"threads": 1},
}
DEFAULT_WORKLOADS = ["compute", "tools=rollout.tool_latency_ms=200"]
MEANS = ("samples_per_s", "final_eval", "trainer_busy", "engine_busy", "rows_per_step")


def train(recipe: str, sets: dict, out: Path, cache: Path) -> dict:
    """One run with ``sets`` overrides; returns its throughput and final held-out success."""
    cmd = [sys.executable, "-m", "loong_train.cli", "run", recipe, "--out", str(out), "--cache", str(cache)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    subprocess.run(cmd, check=True)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    summary = json.loads((out / "summary.json").read_text())
    return {
        "samples_per_s": last["trained_samples_per_s"],
        "final_eval": summary["final_eval"],
        "wall_s": summary["wall_s"],
        "trainer_busy": last["trainer_busy_frac"],
        "engine_busy": last["engine_busy_frac"],
        "rows_per_step": last["engine_rows_per_step"],
    }


def config_sets(config: str, window: int) -> dict:
    """The overrides of ``config`` (``CONFIGS``) for an asynchronous window of ``window``."""
    sets = dict(CONFIGS[config])
    sets.setdefault("train.max_staleness", window)
    if config.endswith("-cc"):
        sets["rollout.engine.concurrent_calls"] = window + 1
    return sets


def parse_workload(spec: str) -> tuple[str, dict[str, str]]:
    """``NAME`` or ``NAME=KEY=VALUE,KEY=VALUE`` -> (name, overrides)."""
    name, _, rest = spec.partition("=")
    sets = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--workload {spec!r}: expected NAME=KEY=VALUE,KEY=VALUE, got {item!r}")
        sets[key] = value
    return name, sets


def summarize(rows: list[dict]) -> dict:
    """Per workload: each configuration's means over seeds, the best synchronous and asynchronous
    ones, and the speedup of the best asynchronous over the best synchronous."""
    out = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        configs = {}
        for config in dict.fromkeys(r["config"] for r in rows if r["workload"] == workload):
            mine = [r for r in rows if r["workload"] == workload and r["config"] == config]
            configs[config] = {k: statistics.fmean(r[k] for r in mine) for k in MEANS if k in mine[0]}

        sync, asyn = _best(configs, "sync"), _best(configs, "async")
        out[workload] = {
            "configs": configs,
            "best_sync": sync,
            "best_async": asyn,
            "speedup": configs[asyn]["samples_per_s"] / configs[sync]["samples_per_s"],
        }
    return out


def _best(configs: dict, kind: str) -> str:
    """The fastest configuration whose name starts with ``kind``."""
    return max((c for c in configs if c.startswith(kind)), key=lambda c: configs[c]["samples_per_s"])


def table(summary: dict) -> str:
    """The summary as a Markdown table: one row per workload and configuration."""
    lines = [
        "| workload | configuration | samples/s | vs best sync | held-out success | trainer busy | engine busy | rows/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload, w in summary.items():
        base = w["configs"][w["best_sync"]]["samples_per_s"]
        for config, c in w["configs"].items():
            mark = " (best)" if config in (w["best_sync"], w["best_async"]) else ""
            lines.append(
                f"| {workload} | {config}{mark} | {c['samples_per_s']:.1f} | {c['samples_per_s'] / base:.2f}x "
                f"| {c['final_eval']:.2f} | {c.get('trainer_busy', float('nan')):.0%} "
                f"| {c.get('engine_busy', float('nan')):.0%} | {c.get('rows_per_step', float('nan')):.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the summary")
    parser.add_argument("--recipe", default="tiny-calc-agent")
    parser.add_argument("--window", type=int, default=2, help="max_staleness of the asynchronous run")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--workload", action="append", help="NAME[=KEY=VALUE,...]; repeatable")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "loong")
    args = parser.parse_args()
    workloads = [parse_workload(w) for w in args.workload or DEFAULT_WORKLOADS]
    rows = []
    with tempfile.TemporaryDirectory(prefix="loong-bench-async-") as tmp:
        for name, workload in workloads:
            for seed in [int(s) for s in args.seeds.split(",")]:
                for config in CONFIGS:
                    sets = {
                        **workload,
                        **config_sets(config, args.window),
                        "train.steps": args.steps,
                        "seed": seed,
                    }
                    out = Path(tmp) / f"{name}-{config}-s{seed}"
                    rows.append(
                        {"workload": name, "config": config, "seed": seed}
                        | train(args.recipe, sets, out, args.cache)
                    )
                    print(json.dumps(rows[-1]), flush=True)
    result = {
        "recipe": args.recipe,
        "steps": args.steps,
        "window": args.window,
        "workloads": summarize(rows),
        "runs": rows,
    }
    args.json.write_text(json.dumps(result, indent=2))
    print(table(result["workloads"]))


if __name__ == "__main__":
    main()
