"""Real CPU benchmark of the asynchronous pipeline against the best synchronous run on the same
cores, per workload.

    uv run python tools/bench_async.py --json async.json [--recipe tiny-calc-agent] [--window 2]
        [--steps 80] [--seeds 0,1] [--workload compute] [--workload tools=rollout.tool_latency_ms=200]
        [--configs sync-t1,sync-t2,async-t1] [--no-predict]
    uv run python tools/bench_async.py --json out.json --summarize async.json

A workload is a name and the recipe overrides that make it (``NAME=KEY=VALUE,KEY=VALUE``; the
default: ``compute``, the recipe as shipped, and ``tools-200ms`` and ``tools-1s``, a lognormal
tool latency per call with that median, spent idle, as a sandbox or a web API would keep an agent
waiting, :class:`loong_agentflow.Latency`). Per workload and seed, each configuration is its own
``loong-train run`` process (the warm start is cached and shared, so it is built once and excluded
from the timing):

- ``sync-t1``: ``train.max_staleness = 0`` (rollout and training alternate), one torch thread per
  actor (while one phase runs, the other actor's core idles);
- ``sync-t2``: synchronous, ``threads = 2``: each phase gets both cores;
- ``async-t1``: ``train.max_staleness = --window``, one thread per actor, one rollout call at a
  time per worker (the shipped setting);
- ``async-t1-cc``: as ``async-t1``, with ``rollout.engine.concurrent_calls = --window + 1`` (as
  many calls at once as the window holds batches) and ``rollout.engine.partial = "continue"``
  (an update lands between decode steps instead of waiting for every running call): while one
  call's episodes wait on tools, another's keep the engine busy;
- ``async-t1-tr2``: as ``async-t1`` with two torch threads for the trainer
  (``train.threads = 2``; three threads on two cores): while the engine waits on tools the
  trainer can use both cores. (Two threads for every actor, four on two cores, measured slower:
  the engine's threads then take the trainer's second core whenever it decodes.)

The baselines are the faster synchronous and the faster asynchronous configuration, chosen per
workload on the mean over seeds. Throughput is ``trained_samples_per_s`` of the run's last
metrics line: samples trained divided by the wall time since the actors started. Each run also
reports ``trainer_busy_frac``, ``engine_busy_frac`` (a forward running) and
``engine_rows_per_step`` of that line. The JSON holds, per workload, every configuration's means,
the best of each kind and ``speedup`` (best asynchronous over best synchronous); then every run.
It prints a Markdown table.

Unless ``--no-predict``, every run also gets the simulator's samples/s (``tools/simulate.py``),
from costs measured apart from the runs: the engine's (:func:`engine_costs`), the trainer's (the
synchronous run's steps, which overlap nothing), and how much the trainer and an engine slow
each other down on the shared cores (:func:`shared_core_costs`, for the asynchronous runs).
The output file holds every finished run from the first one on (a cut-off benchmark keeps what
it measured; ``--summarize`` tables it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
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
    "async-t1-tr2": {"threads": 1, "train.threads": 2},
}
DEFAULT_WORKLOADS = [
    "compute",
    "tools-200ms=rollout.tool_latency_ms=200",
    "tools-1s=rollout.tool_latency_ms=1000",
]
MEANS = (
    "samples_per_s",
    "final_eval",
    "trainer_busy",
    "engine_busy",
    "rows_per_step",
    "predicted_samples_per_s",
)


def engine_costs(
    recipe_name: str, sets: dict, cache: Path, threads: int, solo: int = 8, sizes: tuple[int, ...] = (16, 48)
) -> dict:
    """What the simulator needs of the engine, measured in this process on the recipe's
    warm-started model with ``threads`` torch threads and no tool latency:

    - ``group_s``: the mean wall time of a rollout call of one group (its slowest episode), over
      ``solo`` calls, and ``sigma``, the standard deviation of their logs;
    - ``slot_cost``: from the engine's counters over calls of 1 and ``sizes`` groups, busy time =
      a * steps + b * rows (least squares); a group of G rows added to a batch slows every row by
      G b / (a + G b) of a solo group's step;
    - ``turns``: model turns per episode, rounded.
    """
    recipe = _calibration_recipe(recipe_name, sets)
    r = recipe.rollout
    worker, source = _calibration_worker(recipe, cache, threads, f"bench-calibrate-{threads}")
    try:
        worker.rollout([s for s in source.specs(source.next_group())])  # warm up kernels and caches
        times, turns, points = [], [], []
        for groups in [1] * solo + list(sizes):
            stats = worker.engine.stats
            before = (stats.steps, stats.tokens, stats.busy_s)
            out = worker.rollout([s for _ in range(groups) for s in source.specs(source.next_group())])
            points.append([stats.steps - before[0], stats.tokens - before[1], stats.busy_s - before[2]])
            if groups == 1:
                times.append(out.end - out.start)
                turns += [sum(1 for span in t.spans if span.is_model) for t in out.trajectories]
    finally:
        worker.close()
    logs = [math.log(t) for t in times]
    return {
        "threads": threads,
        "group_s": statistics.fmean(times),
        "sigma": statistics.pstdev(logs),
        **fit_slot_cost(points, r.group_size),
        "turns": max(1, round(statistics.fmean(turns))),
    }


def _calibration_recipe(recipe_name: str, sets: dict):
    """The recipe with ``sets``, less the tool latency: calibration measures compute alone."""
    from loong_train.config import load_recipe

    return load_recipe(recipe_name, [f"{k}={v}" for k, v in sets.items() if not k.startswith("rollout.tool")])


def _calibration_worker(recipe, cache: Path, threads: int, name: str):
    """An in-process rollout worker on the recipe's warm-started model, and a source of its
    training groups."""
    from loong_train.source import GroupSource
    from loong_train.tasks import build_task
    from loong_train.tiny.warmstart import prepare_model
    from loong_train.workers.rollout import RolloutWorker
    from loong_transfermesh import TransportConfig

    r = recipe.rollout
    worker = RolloutWorker(
        str(prepare_model(recipe, cache)),
        seed=recipe.seed,
        sampling={"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens},
        limits={
            "max_turns": r.max_turns,
            "max_model_tokens": r.max_model_tokens,
            "timeout_s": r.episode_timeout_s,
        },
        transport=TransportConfig(name=name),
        threads=threads,
        task=recipe.task,
        tables=recipe.task_tables,
    )
    task = build_task(recipe.task, recipe.task_tables)
    return worker, GroupSource(task.train_stream(recipe.seed + 2, []), r.group_size, seed=recipe.seed)


def _call(recipe, source) -> list:
    """The episodes of one rollout call as the run places them: a batch's groups per worker."""
    n = recipe.train.batch_groups // recipe.rollout.workers
    return [s for _ in range(n) for s in source.specs(source.next_group())]


def _backend(recipe, cache: Path, threads: int):
    """The recipe's train backend on its warm-started model, with ``threads`` torch threads."""
    import msgspec
    import torch

    from loong_train.backends.base import build_backend
    from loong_train.controller import trainer_options
    from loong_train.tiny.warmstart import prepare_model

    torch.set_num_threads(threads)
    options = msgspec.structs.replace(trainer_options(recipe)["options"], threads=threads)
    return build_backend(str(prepare_model(recipe, cache)), options)


def shared_core_costs(
    recipe_name: str, sets: dict, cache: Path, engine_threads: int, train_threads: int, repeats: int = 3
) -> dict:
    """How much the trainer and an engine slow each other down on this machine's shared cores,
    measured on the recipe's model, each phase alone and then beside a second process that runs
    the other phase without pause (:func:`hog`):

    - ``train_slowdown``: a train step (one batch of rollouts) beside a decoding engine over alone;
    - ``engine_slowdown``: a rollout call (one batch's groups, no tool latency) beside a training
      trainer over alone.

    The simulator's ``train_slowdown`` and ``engine_slowdown`` (``tools/simulate.py``)."""
    import pickle
    import time

    import torch

    from loong_train.algo.losses import pack_batch

    recipe = _calibration_recipe(recipe_name, sets)
    worker, source = _calibration_worker(recipe, cache, engine_threads, "bench-shared")
    try:
        trajectories = worker.rollout(_call(recipe, source)).trajectories  # warm-up, and a batch
        # The cost of a step does not depend on the advantages' values.
        batch = pack_batch(trajectories, [(-1.0) ** i for i in range(len(trajectories))], policy_version=0)

        def call() -> float:
            start = time.perf_counter()
            worker.rollout(_call(recipe, source))
            return time.perf_counter() - start

        with tempfile.TemporaryDirectory(prefix="loong-bench-shared-") as tmp:
            batch_path = Path(tmp) / "batch.pkl"
            batch_path.write_bytes(pickle.dumps(batch))
            torch.set_num_threads(engine_threads)
            call_alone = [call() for _ in range(repeats)]
            with _hogging("train", recipe_name, sets, cache, train_threads, batch_path):
                call_beside = [call() for _ in range(repeats)]
            backend = _backend(recipe, cache, train_threads)

            def step() -> float:
                start = time.perf_counter()
                backend.train_step(batch)
                return time.perf_counter() - start

            step()  # warm-up
            train_alone = [step() for _ in range(repeats)]
            with _hogging("decode", recipe_name, sets, cache, engine_threads, batch_path):
                train_beside = [step() for _ in range(repeats)]
    finally:
        worker.close()
    means = {
        "call_alone_s": statistics.fmean(call_alone),
        "call_beside_s": statistics.fmean(call_beside),
        "train_alone_s": statistics.fmean(train_alone),
        "train_beside_s": statistics.fmean(train_beside),
    }
    return {
        "engine_threads": engine_threads,
        "train_threads": train_threads,
        **means,
        "engine_slowdown": means["call_beside_s"] / means["call_alone_s"],
        "train_slowdown": means["train_beside_s"] / means["train_alone_s"],
    }


_HOG_READY_S = 600  # a hog's first iteration: a warm start from the cache and one call or step


class _hogging:
    """A :func:`hog` subprocess running ``kind`` for the duration of the ``with`` block (from its
    first finished iteration on)."""

    def __init__(self, kind: str, recipe: str, sets: dict, cache: Path, threads: int, batch: Path) -> None:
        self.cmd = [
            sys.executable,
            __file__,
            "--hog",
            kind,
            recipe,
            json.dumps(sets),
            str(cache),
            str(threads),
        ]
        self.cmd.append(str(batch))

    def __enter__(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], _HOG_READY_S)
        if not ready or self.proc.stdout.readline().strip() != "ready":
            exited = self.proc.poll()
            self._stop()
            why = f"exited with {exited}" if exited is not None else f"not ready within {_HOG_READY_S} s"
            raise RuntimeError(f"{' '.join(self.cmd[2:5])}: {why} before its first iteration")

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # stuck in a step that ignores SIGTERM's unwinding
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def hog(kind: str, recipe_name: str, sets: dict, cache: Path, threads: int, batch_path: Path) -> None:
    """Run ``kind`` without pause until SIGTERM: ``decode`` rollout calls as :func:`shared_core_costs`
    times them, or ``train`` steps on the pickled batch at ``batch_path``. Prints ``ready`` after
    the first iteration."""
    import pickle
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwind: the worker's close runs
    recipe = _calibration_recipe(recipe_name, sets)
    if kind == "decode":
        worker, source = _calibration_worker(recipe, cache, threads, "bench-shared-hog")

        def iteration() -> None:
            worker.rollout(_call(recipe, source))
    else:
        worker, batch = None, pickle.loads(batch_path.read_bytes())
        backend = _backend(recipe, cache, threads)

        def iteration() -> None:
            backend.train_step(batch)

    try:
        iteration()
        print("ready", flush=True)
        while True:
            iteration()
    finally:
        if worker is not None:
            worker.close()


def fit_slot_cost(points: list[list[float]], group_size: int) -> dict:
    """``points``: [decode steps, rows, busy seconds] per call. Least squares of busy = a * steps
    + b * rows gives ``step_s`` = a and ``row_s`` = b; a group of ``group_size`` rows joining a
    batch slows each step by ``slot_cost`` = G b / (a + G b) of a solo group's step."""
    import torch

    x = torch.tensor([[steps, rows] for steps, rows, _ in points], dtype=torch.float64)
    y = torch.tensor([[busy] for *_, busy in points], dtype=torch.float64)
    a, b = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    return {"step_s": a, "row_s": b, "slot_cost": group_size * b / (a + group_size * b)}


def run_costs(out: Path) -> dict:
    """A run's trainer: mean train step and weight sync seconds (``trace.json``, metrics)."""
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    steps = [e["dur"] / 1e6 for e in events if e.get("name") == "train_step"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"train_s": statistics.fmean(steps), "sync_s": statistics.fmean(r["weight_sync_s"] for r in lines)}


def predict(
    recipe_name: str, sets: dict, engine: dict, trainer: dict, steps: int, shared: dict | None = None
) -> float:
    """The simulator's samples/s for one configuration (``sets``: the workload's and the
    configuration's overrides), from the engine's and the trainer's measured costs, in units of
    the solo group time ``engine["group_s"]``, and how much they slow each other down where they
    overlap (``shared``, :func:`shared_core_costs`; none: not at all)."""
    import simulate  # tools/simulate.py: tools/ is on the path of this script and of the tests

    from loong_train.config import load_recipe

    recipe = load_recipe(recipe_name, [f"{k}={v}" for k, v in sets.items()])
    r, t, u = recipe.rollout, recipe.train, engine["group_s"]
    cfg = simulate.SimConfig(
        engines=r.workers,
        window=t.max_staleness,
        steps=steps,
        batch_per_engine=t.batch_groups // r.workers,
        call_groups=t.batch_groups // r.workers,
        slots=r.engine.concurrent_calls,
        slot_cost=engine["slot_cost"],
        dist="lognormal" if engine["sigma"] > 0 else "constant",
        sigma=engine["sigma"],
        turns=engine["turns"],
        tool_latency=r.tool_latency_ms / 1000 / u,
        tool_sigma=r.tool_latency_sigma,
        episodes=r.group_size,
        step_ratio=trainer["train_s"] / (t.batch_groups // r.workers) / u,
        sync_time=trainer["sync_s"] / u,
        train_slowdown=shared["train_slowdown"] if shared else 1.0,
        engine_slowdown=shared["engine_slowdown"] if shared else 1.0,
    )
    return simulate.simulate(cfg).throughput / u * r.group_size


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
    if "-cc" in config:
        sets["rollout.engine.concurrent_calls"] = window + 1
        sets["rollout.engine.partial"] = "continue"
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


def cpu_floor(sync_t1: dict, cores: int) -> float:
    """The samples/s no schedule can beat on ``cores`` cores: the synchronous one-thread run
    overlaps nothing, so its trainer and engine busy fractions add up to the core-seconds one
    sample costs (tool waits cost none); all cores busy all the time trains ``cores`` over that."""
    return cores * sync_t1["samples_per_s"] / (sync_t1["trainer_busy"] + sync_t1["engine_busy"])


def summarize(rows: list[dict], cores: int = 2) -> dict:
    """Per workload: each configuration's means over seeds, the best synchronous and asynchronous
    ones, the speedup of the best asynchronous over the best synchronous, and the CPU floor
    (:func:`cpu_floor`)."""
    out = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        configs = {}
        for config in dict.fromkeys(r["config"] for r in rows if r["workload"] == workload):
            mine = [r for r in rows if r["workload"] == workload and r["config"] == config]
            configs[config] = {k: statistics.fmean(r[k] for r in mine) for k in MEANS if k in mine[0]}

        sync, asyn = _best(configs, "sync"), _best(configs, "async")
        out[workload] = {"configs": configs, "best_sync": sync, "best_async": asyn}
        if sync and asyn:
            out[workload]["speedup"] = configs[asyn]["samples_per_s"] / configs[sync]["samples_per_s"]
            predicted = [configs[c].get("predicted_samples_per_s") for c in (asyn, sync)]
            if all(predicted):  # the simulator's, for the same two
                out[workload]["predicted_speedup"] = predicted[0] / predicted[1]
        if "sync-t1" in configs and "engine_busy" in configs["sync-t1"]:
            out[workload]["cpu_floor_samples_per_s"] = cpu_floor(configs["sync-t1"], cores)
    return out


def _best(configs: dict, kind: str) -> str | None:
    """The fastest configuration whose name starts with ``kind``; None if no run was of that kind."""
    mine = [c for c in configs if c.startswith(kind)]
    return max(mine, key=lambda c: configs[c]["samples_per_s"]) if mine else None


def _predicted(w: dict, config: str) -> str:
    """The simulator's ratio to its own best-synchronous prediction, or a dash."""
    predicted = {c: v.get("predicted_samples_per_s") for c, v in w["configs"].items()}
    if predicted[config] is None or not predicted.get(w["best_sync"]):
        return "-"
    return f"{predicted[config] / predicted[w['best_sync']]:.2f}x"


def table(summary: dict) -> str:
    """The summary as a Markdown table: one row per workload and configuration."""
    lines = [
        "| workload | configuration | samples/s | vs best sync | simulator | held-out success "
        "| trainer busy | engine busy | rows/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, w in summary.items():
        base = w["configs"][w["best_sync"]]["samples_per_s"] if w["best_sync"] else math.nan
        if floor := w.get("cpu_floor_samples_per_s"):
            lines.append(
                f"| {workload} | CPU floor (every core busy) | {floor:.1f} | {floor / base:.2f}x | | | | | |"
            )
        for config, c in w["configs"].items():
            mark = " (best)" if config in (w["best_sync"], w["best_async"]) else ""
            ratio = "-" if math.isnan(base) else f"{c['samples_per_s'] / base:.2f}x"
            lines.append(
                f"| {workload} | {config}{mark} | {c['samples_per_s']:.1f} | {ratio} "
                f"| {_predicted(w, config)} | {c['final_eval']:.2f} | {c.get('trainer_busy', float('nan')):.0%} "
                f"| {c.get('engine_busy', float('nan')):.0%} | {c.get('rows_per_step', float('nan')):.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--hog"]:  # a second process of shared_core_costs
        kind, recipe, sets, cache, threads, batch = sys.argv[2:]
        hog(kind, recipe, json.loads(sets), Path(cache), int(threads), Path(batch))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the summary")
    parser.add_argument("--recipe", default="tiny-calc-agent")
    parser.add_argument("--window", type=int, default=2, help="max_staleness of the asynchronous run")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--workload", action="append", help="NAME[=KEY=VALUE,...]; repeatable")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="comma-separated configurations to run (the simulator needs the sync-tN of each async run's trainer threads)",
    )
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "loong")
    parser.add_argument("--no-predict", dest="predict", action="store_false", help="skip the simulator")
    parser.add_argument("--summarize", type=Path, help="only summarize this earlier --json output")
    args = parser.parse_args()
    if args.summarize:
        result = json.loads(args.summarize.read_text())
        result["workloads"] = summarize(result["runs"], result.get("cores", 2))
        args.json.write_text(json.dumps(result, indent=2))
        print(table(result["workloads"]))
        return
    workloads = [parse_workload(w) for w in args.workload or DEFAULT_WORKLOADS]
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = args.configs.split(",")
    if unknown := set(configs) - set(CONFIGS):
        parser.error(f"--configs: unknown {sorted(unknown)}; expected some of {list(CONFIGS)}")
    rows = []
    result = {"recipe": args.recipe, "steps": args.steps, "window": args.window, "cores": os.cpu_count()}

    def save() -> None:  # after every run: a cut-off benchmark keeps what it measured
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(result | {"runs": rows}, indent=2))
        os.replace(tmp, args.json)

    with tempfile.TemporaryDirectory(prefix="loong-bench-async-") as tmp:
        for name, workload in workloads:
            for seed in seeds:
                runs = {}
                for config in configs:
                    sets = {
                        **workload,
                        **config_sets(config, args.window),
                        "train.steps": args.steps,
                        "seed": seed,
                    }
                    runs[config] = (sets, Path(tmp) / f"{name}-{config}-s{seed}")
                    rows.append(
                        {"workload": name, "config": config, "seed": seed, "sets": sets}
                        | train(args.recipe, *runs[config], args.cache)
                    )
                    print(json.dumps(rows[-1]), flush=True)
                    save()
                if args.predict:
                    add_costs(args.recipe, runs, rows[-len(runs) :], args.cache)
                    add_predictions(args.recipe, rows[-len(runs) :], args.steps)
                    save()
    result["workloads"] = summarize(rows, os.cpu_count() or 1)
    save()
    print(table(result["workloads"]))


_ENGINES: dict[int, dict] = {}  # threads -> engine_costs, measured once per benchmark
_SHARED: dict[tuple[int, int], dict] = {}  # (engine, train threads) -> shared_core_costs, once


def add_costs(recipe: str, runs: dict, rows: list[dict], cache: Path) -> None:
    """What the simulator needs for each row: the engine's costs (:func:`engine_costs`, measured
    once per thread count) and the trainer's, from the synchronous run with the same threads
    (train steps there overlap nothing); for an asynchronous run also how much the two slow each
    other down (:func:`shared_core_costs`, once per pair of thread counts; a synchronous run
    overlaps nothing). A row whose trainer threads had no synchronous run gets none."""
    for row in rows:
        sets = row["sets"]
        threads, train_threads = int(sets["threads"]), int(sets.get("train.threads", sets["threads"]))
        if f"sync-t{train_threads}" not in runs:
            continue
        if threads not in _ENGINES:
            _ENGINES[threads] = engine_costs(recipe, sets, cache, threads)
            print(json.dumps(_ENGINES[threads]), flush=True)
        row["engine_costs"] = _ENGINES[threads]
        row["trainer_costs"] = run_costs(runs[f"sync-t{train_threads}"][1])
        add_shared_costs(recipe, row, cache)


def add_shared_costs(recipe: str, row: dict, cache: Path) -> None:
    """An asynchronous row's ``shared_costs`` (:func:`shared_core_costs`, measured once per pair
    of thread counts: the caches are per benchmark, which runs one recipe)."""
    sets = row["sets"]
    if int(sets["train.max_staleness"]) == 0:
        return
    threads, train_threads = int(sets["threads"]), int(sets.get("train.threads", sets["threads"]))
    if (threads, train_threads) not in _SHARED:
        _SHARED[threads, train_threads] = shared_core_costs(recipe, sets, cache, threads, train_threads)
        print(json.dumps(_SHARED[threads, train_threads]), flush=True)
    row["shared_costs"] = _SHARED[threads, train_threads]


def add_predictions(recipe: str, rows: list[dict], steps: int) -> None:
    """Each row's ``predicted_samples_per_s`` from its costs (:func:`add_costs`), if it has them."""
    for row in rows:
        if "trainer_costs" in row:
            costs = row["engine_costs"], row["trainer_costs"]
            row["predicted_samples_per_s"] = predict(
                recipe, row["sets"], *costs, steps, row.get("shared_costs")
            )


if __name__ == "__main__":
    main()
