"""Real CPU benchmark of the asynchronous pipeline: the same recipe and seed trained synchronously
(``train.max_staleness = 0``: rollout and training alternate) and asynchronously (a sliding window
of ``--window`` versions), with the same cores and thread settings.

    uv run python tools/bench_async.py --json async.json [--recipe tiny-calc-agent] [--window 2]
        [--steps 80] [--seeds 0,1]

Each run is ``loong-train run`` in its own process (the warm start is cached and shared, so it is
built once and excluded from the timing). Throughput is ``trained_samples_per_s`` of the run's
last metrics line: samples trained divided by the wall time since the actors started. The JSON
holds ``sync_samples_per_s``, ``async_samples_per_s``, ``sync_final_eval``, ``async_final_eval``
(means over seeds), ``window``, ``speedup`` and the per-seed rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def train(recipe: str, window: int, steps: int, seed: int, out: Path, cache: Path) -> dict:
    """One run; returns its throughput and final held-out success."""
    cmd = [sys.executable, "-m", "loong_train.cli", "run", recipe, "--out", str(out), "--cache", str(cache)]
    for key, value in (("train.max_staleness", window), ("train.steps", steps), ("seed", seed)):
        cmd += ["--set", f"{key}={value}"]
    subprocess.run(cmd, check=True)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    summary = json.loads((out / "summary.json").read_text())
    return {
        "window": window,
        "seed": seed,
        "samples_per_s": last["trained_samples_per_s"],
        "final_eval": summary["final_eval"],
        "wall_s": summary["wall_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the summary")
    parser.add_argument("--recipe", default="tiny-calc-agent")
    parser.add_argument("--window", type=int, default=2, help="max_staleness of the asynchronous run")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "loong")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="loong-bench-async-") as tmp:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for window in (0, args.window):
                out = Path(tmp) / f"w{window}-s{seed}"
                rows.append(train(args.recipe, window, args.steps, seed, out, args.cache))
                print(json.dumps(rows[-1]), flush=True)

    def mean(window: int, key: str) -> float:
        return statistics.fmean(r[key] for r in rows if r["window"] == window)

    result = {
        "recipe": args.recipe,
        "steps": args.steps,
        "window": args.window,
        "sync_samples_per_s": mean(0, "samples_per_s"),
        "async_samples_per_s": mean(args.window, "samples_per_s"),
        "sync_final_eval": mean(0, "final_eval"),
        "async_final_eval": mean(args.window, "final_eval"),
        "runs": rows,
    }
    result["speedup"] = result["async_samples_per_s"] / result["sync_samples_per_s"]
    args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
