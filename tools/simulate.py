"""Discrete-event simulation of Loong's asynchronous loop, driving the real ``Scheduler``.

How much faster than synchronous on-policy training (window K = 0) is the async loop at K = 1
and 2 when rollouts have a long tail, and what limits it? Every admission, finish and batch
decision is made by ``loong_train.scheduler.Scheduler``, the class ``loong_train.pipeline`` runs
(with its ``StalenessWindow``); only time and the placement of groups on engines are simulated.
Stdlib plus that scheduler (matplotlib for --plot).

The model, its results at 8 to 1024 engines and what drives the speedup: docs/simulator.md.

Usage::

    python tools/simulate.py --replay runs/NAME    # a real run's scheduling, decision by decision
    python tools/simulate.py [--engines 8,64,256,1024] [--windows 0,1,2] [--steps 200] [--seed 0]
        [--max-groups 20480] [--dist lognormal] [--sigma 1] [--cap 0] [--step-ratio 1]
        [--sync-time 0.05] [--slots 1] [--slot-cost 0.15] [--batch-per-engine 1]
        [--turns 1] [--tool-latency 0] [--tool-sigma 0.5] [--episodes 8] [--call-groups 1]
        [--train-slowdown 1] [--engine-slowdown 1]
        [--json FILE] [--plot FILE.png]

``--json`` writes a list with one object per row: engines, window, batch, steps, sim_time,
throughput, speedup, trainer_busy, engine_busy, engine_load, staleness_mean, staleness_max,
staleness_hist ({"staleness": groups}).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from random import Random
from typing import Any

from loong_core.window import StalenessWindow
from loong_train.scheduler import Scheduler, replay

__all__ = ["SimConfig", "SimResult", "simulate", "sweep"]

_GEN, _TRAIN, _SYNC, _TOOL = 0, 1, 2, 3  # event kinds; at equal times generations are handled first


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. Times are in units of the mean solo generation time of one group."""

    engines: int = 64
    window: int = 1  # max_staleness K; 0 is the synchronous on-policy baseline
    steps: int = 200  # train steps to simulate
    batch_per_engine: int = 1  # B = engines * batch_per_engine groups per train step
    slots: int = 1  # groups one engine generates at once (continuous batching)
    slot_cost: float = 0.15  # n groups on an engine each run 1 + slot_cost * (n - 1) times slower
    dist: str = "lognormal"  # solo generation time: lognormal | pareto | exponential | constant
    sigma: float = 1.0  # lognormal shape
    alpha: float = 2.0  # pareto shape (> 1)
    cap: float = 0.0  # truncate generation times at cap (max tokens, episode timeout); 0: none
    turns: int = 1  # generation segments per group; a tool wait between two of them
    tool_latency: float = 0.0  # median tool wait, in mean generation times of a group
    tool_sigma: float = 0.5  # lognormal shape of one episode's tool wait
    episodes: int = 8  # episodes per group: a group's wait is the slowest of this many draws
    call_groups: int = 1  # groups per rollout call; > 1: ``slots`` counts calls, and a call's
    # groups start together and are reported together, when its last one ends
    step_ratio: float = 1.0  # step_time = step_ratio * batch_per_engine (one batch)
    sync_time: float = 0.05  # weight publish + apply after each step; the trainer waits for it
    remote_share: float = 0.0  # engines on other nodes than the trainer's: their weights cross
    hop_time: float = 0.0  # the network, one copy each through the trainer's link, hop_time apiece
    train_slowdown: float = 1.0  # a train step takes this many times longer while every engine
    # generates (shared cores; linear in the fraction of engines generating); 1: no sharing
    engine_slowdown: float = 1.0  # engines generate this many times slower while a step trains
    seed: int = 0
    record: bool = False  # keep busy intervals and the ledger (for tests and plots)

    def __post_init__(self) -> None:
        if not 0.0 <= self.remote_share <= 1.0 or self.hop_time < 0:
            raise ValueError(
                f"remote_share must be in [0, 1] and hop_time >= 0, got {self.remote_share} and {self.hop_time}"
            )

    @property
    def batch(self) -> int:
        return self.engines * self.batch_per_engine

    @property
    def step_time(self) -> float:
        return self.step_ratio * self.batch_per_engine

    @property
    def remote_engines(self) -> int:
        return round(self.engines * self.remote_share)

    @property
    def sync_cost(self) -> float:
        """What a step's weight sync costs the trainer: the local publish and apply, then one
        copy of the update per engine on another node, sent through the trainer's link."""
        return self.sync_time + self.hop_time * self.remote_engines

    @property
    def warmup(self) -> int:
        """Steps left out of the rates: the pipeline fills during them."""
        return self.steps // 10


@dataclass
class SimResult:
    """Metrics of one run. Rates are over the steps after ``SimConfig.warmup``; the lists after
    ``speedup`` are filled only with ``record``."""

    engines: int
    window: int
    batch: int
    steps: int
    sim_time: float
    throughput: float  # groups trained per unit time
    trainer_busy: float  # fraction of time training (weight sync excluded)
    engine_busy: float  # fraction of time an engine runs >= 1 group, mean over engines
    engine_load: float  # groups running on an engine, time-average, mean over engines
    staleness_mean: float
    staleness_max: int
    staleness_hist: dict[str, int]
    speedup: float = float("nan")  # throughput / throughput at window 0, same engines
    trainer_intervals: list[tuple[float, float]] = field(default_factory=list)
    engine_intervals: list[list[tuple[float, float]]] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    trained: list[str] = field(default_factory=list)  # in train order, with repeats if any
    pending: list[str] = field(default_factory=list)  # in flight, buffered or taken at the end

    def summary(self) -> dict[str, Any]:
        keys = ("engines", "window", "batch", "steps", "sim_time", "throughput", "speedup")
        keys += ("trainer_busy", "engine_busy", "engine_load", "staleness_mean", "staleness_max")
        return {k: getattr(self, k) for k in keys} | {"staleness_hist": self.staleness_hist}


def _sampler(cfg: SimConfig, rng: Random) -> Callable[[], float]:
    """Solo generation times with mean 1 (before ``cap``)."""
    a, s = cfg.alpha, cfg.sigma
    draws = {
        "constant": lambda: 1.0,
        "exponential": lambda: rng.expovariate(1.0),
        "lognormal": lambda: rng.lognormvariate(-s * s / 2, s),
        "pareto": lambda: (a - 1) / a * rng.paretovariate(a),
    }
    draw = draws[cfg.dist]
    return (lambda: min(draw(), cfg.cap)) if cfg.cap > 0 else draw


class _Engine:
    """Processor sharing: each of its n groups gets 1 / (1 + slot_cost * (n - 1)) solo-seconds
    of work done per second; ``work`` is the work every group present since time 0 would have."""

    def __init__(self, index: int) -> None:
        self.index, self.work, self.clock, self.load, self.epoch = index, 0.0, 0.0, 0.0, 0
        self.active: dict[str, float] = {}  # group id -> ``work`` at which it finishes
        self.busy_since = 0.0
        self.busy = 0.0
        self.intervals: list[tuple[float, float]] = []
        self.returning: list[str] = []  # groups back from a tool wait, queued for a slot
        self.calls = 0  # rollout calls running (call mode)

    def progress(self, now: float, slot_cost: float, speed: float = 1.0) -> None:
        """Advance ``work`` to ``now``; ``speed`` scales the whole engine (shared cores)."""
        n = len(self.active)
        if n:
            self.work += (now - self.clock) * speed / (1 + slot_cost * (n - 1))
            self.load += (now - self.clock) * n
        self.clock = now

    def next_finish(self, now: float, slot_cost: float, speed: float = 1.0) -> float:
        remaining = min(self.active.values()) - self.work
        return now + max(remaining, 0.0) * (1 + slot_cost * (len(self.active) - 1)) / speed


class _Sim:
    """The event loop: engines admit and generate, the trainer takes, trains, syncs, advances."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.scheduler = Scheduler(StalenessWindow(cfg.window, cfg.batch), steps=cfg.steps)
        self.window = self.scheduler.window
        self.draw = _sampler(cfg, Random(cfg.seed))  # same stream for every window: common numbers
        self.tool_rng = Random(cfg.seed + 1)
        self.segments: dict[str, list[float]] = {}  # group -> work of the segments still to run
        self.waiting: dict[int, tuple[str, int]] = {}  # tool event seq -> (group, engine)
        self.engines = [_Engine(i) for i in range(cfg.engines)]
        self.ids = (f"g{i}" for i in itertools.count())
        self.calls: dict[str, list[str]] = {}  # call mode: group -> the groups of its call
        self.left: dict[int, set[str]] = {}  # call mode: id(call list) -> groups still running
        self.free = [(0, i) for i in range(cfg.engines)]  # (groups running, engine): least loaded
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.staleness: Counter[int] = Counter()
        self.admitted: list[str] = []
        self.trained: list[str] = []
        self.trainer_intervals: list[tuple[float, float]] = []
        self.at_warmup = (0.0, 0.0, 0.0, 0.0)
        # Shared cores: the running step's work left (in solo seconds) as of ``train_clock``,
        # engines generating, and an epoch that invalidates a step's stale end events.
        self.shared = cfg.train_slowdown != 1.0 or cfg.engine_slowdown != 1.0
        self.train_left, self.train_clock, self.train_epoch = 0.0, 0.0, 0
        self.train_start = 0.0
        self.train_busy = 0.0  # wall time of finished steps
        self.training = False
        self.generating = 0

    def run(self) -> SimResult:
        self.schedule()
        while self.window.version < self.cfg.steps:
            if not self.events:
                raise RuntimeError(f"simulation stalled at t={self.now}: {self.window.stats}")
            self.now = self.events[0][0]
            while self.events and self.events[0][0] == self.now:
                _, kind, _, engine, epoch = heapq.heappop(self.events)
                self.handle(kind, engine, epoch)
            self.schedule()
        return self.result()

    def push(self, at: float, kind: int, engine: int = -1, epoch: int = -1) -> None:
        heapq.heappush(self.events, (at, kind, self.seq, engine, epoch))
        self.seq += 1

    def handle(self, kind: int, engine: int, epoch: int) -> None:
        if kind == _GEN:
            self.on_generation(self.engines[engine], epoch)
        elif kind == _TOOL:
            group, index = self.waiting.pop(epoch)
            self.engines[index].returning.append(group)
            self.serve_returning(self.engines[index])
        elif kind == _TRAIN:
            if epoch != self.train_epoch:
                return  # the engines' load changed since this end time was computed
            self.set_training(False)
            self.train_busy += self.now - self.train_start
            if self.cfg.record:
                self.trainer_intervals.append((self.train_start, self.now))
            self.push(self.now + self.cfg.sync_cost, _SYNC)
        else:
            self.scheduler.published(version := self.window.version + 1)  # new rollouts use it
            if version == self.cfg.warmup:
                self.at_warmup = self.totals()

    def on_generation(self, engine: _Engine, epoch: int) -> None:
        if epoch != engine.epoch:
            return  # its group count changed since this finish time was computed
        engine.progress(self.now, self.cfg.slot_cost, self.engine_speed())
        for group in [g for g, end in engine.active.items() if end <= engine.work + 1e-9]:
            del engine.active[group]
            if self.segments[group]:  # a tool call: the group leaves the engine while it waits
                self.waiting[self.seq] = (group, engine.index)
                self.push(self.now + self.tool_wait(), _TOOL, engine.index, self.seq)
            else:
                del self.segments[group]
                self.group_done(engine, group)
        if not engine.active:
            engine.busy += self.now - engine.busy_since
            if self.cfg.record:
                engine.intervals.append((engine.busy_since, self.now))
            self.set_generating(-1)
        self.serve_returning(engine, reschedule=False)  # ahead of new groups
        self.reschedule(engine)

    def group_done(self, engine: _Engine, group: str) -> None:
        """Report ``group`` to the scheduler (no partial rollout: it keeps the version it was
        admitted at); in call mode, once every group of its call is done, all of them."""
        if self.cfg.call_groups == 1:
            self.scheduler.finish(group, self.window.in_flight[group])
            return
        call = self.calls.pop(group)
        left = self.left[id(call)]
        left.discard(group)
        if not left:
            del self.left[id(call)]
            engine.calls -= 1
            for g in call:
                self.scheduler.finish(g, self.window.in_flight[g])

    def schedule(self) -> None:
        """What the controller does after each event: start a train step, then fill free slots."""
        if self.window.stats.buffered >= self.window.batch_size:  # (else no batch: skip the O(live) take)
            self.start_train_step()
        self.admit()

    def start_train_step(self) -> None:
        if (batch := self.scheduler.take()) is None:
            return
        self.trained += batch
        self.staleness.update(self.window.last_batch_staleness)
        self.train_start, self.train_clock, self.train_left = self.now, self.now, self.cfg.step_time
        self.set_training(True)
        self.retime_train()

    def train_speed(self) -> float:
        """The running step's speed: 1 / train_slowdown with every engine generating."""
        return 1 / (1 + (self.cfg.train_slowdown - 1) * self.generating / self.cfg.engines)

    def engine_speed(self) -> float:
        """An engine's speed: 1 / engine_slowdown while a step trains."""
        return 1 / self.cfg.engine_slowdown if self.training else 1.0

    def retime_train(self) -> None:
        """(Re)schedule the running step's end at the current speed."""
        self.train_epoch += 1
        self.push(self.now + self.train_left / self.train_speed(), _TRAIN, epoch=self.train_epoch)

    def set_generating(self, delta: int) -> None:
        """An engine starts (+1) or stops (-1) generating: a running step changes speed."""
        if self.training and self.shared:
            self.train_left -= (self.now - self.train_clock) * self.train_speed()
            self.train_clock = self.now
            self.generating += delta
            self.retime_train()
        else:
            self.generating += delta

    def set_training(self, training: bool) -> None:
        """A step starts or ends: every generating engine changes speed."""
        if not self.shared:
            self.training = training
            return
        busy = [e for e in self.engines if e.active]
        for engine in busy:
            engine.progress(self.now, self.cfg.slot_cost, self.engine_speed())
        self.training = training
        for engine in busy:
            self.push_finish(engine)

    def load(self, engine: _Engine) -> int:
        """What ``slots`` counts on ``engine``: groups running, or in call mode calls running."""
        return engine.calls if self.cfg.call_groups > 1 else len(engine.active)

    def admit(self) -> None:
        """Fill free slots, least loaded engine first, while the scheduler admits."""
        while self.free:
            n, i = self.free[0]
            engine = self.engines[i]
            if n != self.load(engine) or n >= self.cfg.slots:
                heapq.heappop(self.free)  # stale: the engine's load changed since
                continue
            if not (groups := self.scheduler.admit(self.cfg.call_groups, lambda: next(self.ids))):
                return
            heapq.heappop(self.free)
            self.admitted += groups
            if self.cfg.call_groups > 1:
                engine.calls += 1
                self.left[id(groups)] = set(groups)
                self.calls.update((g, groups) for g in groups)
            for group in groups:
                self.start_generation(engine, group)

    def start_generation(self, engine: _Engine, group: str) -> None:
        work, turns = self.draw(), self.cfg.turns
        self.segments[group] = [work / turns] * turns
        self.run_segment(engine, group)
        self.reschedule(engine)

    def run_segment(self, engine: _Engine, group: str) -> None:
        """Put ``group``'s next segment on ``engine`` (whose clock is at ``now``)."""
        engine.progress(self.now, self.cfg.slot_cost, self.engine_speed())
        if not engine.active:
            engine.busy_since = self.now
            self.set_generating(+1)
        engine.active[group] = engine.work + self.segments[group].pop()

    def serve_returning(self, engine: _Engine, reschedule: bool = True) -> None:
        """Groups back from their tools take the engine's free slots, first come first served."""
        served, room = False, self.cfg.slots * self.cfg.call_groups  # a call's groups always fit
        while engine.returning and len(engine.active) < room:
            self.run_segment(engine, engine.returning.pop(0))
            served = True
        if served and reschedule:
            self.reschedule(engine)

    def tool_wait(self) -> float:
        """The slowest of ``episodes`` lognormal tool waits with median ``tool_latency``."""
        cfg, rng = self.cfg, self.tool_rng
        if cfg.tool_latency <= 0:
            return 0.0
        return max(cfg.tool_latency * math.exp(cfg.tool_sigma * rng.gauss(0, 1)) for _ in range(cfg.episodes))

    def push_finish(self, engine: _Engine) -> None:
        """Schedule ``engine``'s next group end (invalidating the one scheduled before)."""
        engine.epoch += 1
        at = engine.next_finish(self.now, self.cfg.slot_cost, self.engine_speed())
        self.push(at, _GEN, engine.index, engine.epoch)

    def reschedule(self, engine: _Engine) -> None:
        if engine.active:
            self.push_finish(engine)
        else:
            engine.epoch += 1
        if self.load(engine) < self.cfg.slots:
            heapq.heappush(self.free, (self.load(engine), engine.index))

    def totals(self) -> tuple[float, float, float, float]:
        """(now, engine busy time, integral of running groups, summed over engines; trainer busy
        time). Taken after a sync, when no step is running."""
        busy = sum(e.busy + (self.now - e.busy_since if e.active else 0.0) for e in self.engines)
        load = sum(e.load + (self.now - e.clock) * len(e.active) for e in self.engines)
        return self.now, busy, load, self.train_busy

    def result(self) -> SimResult:
        cfg, w = self.cfg, self.window
        (t0, busy0, load0, train0), (t1, busy1, load1, train1) = self.at_warmup, self.totals()
        span, steps = t1 - t0, cfg.steps - cfg.warmup
        hist = sorted(self.staleness.items())
        rec = cfg.record
        return SimResult(
            engines=cfg.engines,
            window=cfg.window,
            batch=cfg.batch,
            steps=cfg.steps,
            sim_time=t1,
            throughput=steps * cfg.batch / span,
            trainer_busy=(train1 - train0) / span,
            engine_busy=(busy1 - busy0) / (cfg.engines * span),
            engine_load=(load1 - load0) / (cfg.engines * span),
            staleness_mean=sum(s * c for s, c in hist) / self.staleness.total(),
            staleness_max=max(self.staleness),
            staleness_hist={str(s): c for s, c in hist},
            trainer_intervals=self.trainer_intervals if rec else [],
            engine_intervals=[e.intervals for e in self.engines] if rec else [],
            admitted=self.admitted if rec else [],
            trained=self.trained if rec else [],
            pending=[*w.in_flight, *w.buffered, *w.taken] if rec else [],
        )


def simulate(cfg: SimConfig) -> SimResult:
    """Run one configuration to ``cfg.steps`` train steps."""
    return _Sim(cfg).run()


def sweep(base: SimConfig, engines: list[int], windows: list[int], max_groups: int = 0) -> list[SimResult]:
    """Every (engines, window) pair; ``speedup`` is against window 0 at the same engine count.

    ``max_groups`` > 0 caps the groups of one run: steps = min(steps, max(10, max_groups // B)),
    as the window's checks cost O(live entries) each and a run costs about steps * B**2.
    """
    results = []
    for e in engines:
        cfg = replace(base, engines=e)
        if max_groups > 0:
            cfg = replace(cfg, steps=min(cfg.steps, max(10, max_groups // cfg.batch)))
        runs = {k: simulate(replace(cfg, window=k)) for k in sorted({0, *windows})}
        for k in windows:
            runs[k].speedup = runs[k].throughput / runs[0].throughput
            results.append(runs[k])
    return results


def _table(results: list[SimResult]) -> str:
    head = f"{'engines':>7} {'B':>5} {'K':>2} {'steps':>5} {'time':>8} {'groups/t':>9} {'speedup':>7} "
    head += f"{'trainer':>7} {'engine':>6} {'load':>5} {'stale':>5} {'max':>3}  staleness hist"
    rows = [head]
    for r in results:
        rows.append(
            f"{r.engines:>7} {r.batch:>5} {r.window:>2} {r.steps:>5} {r.sim_time:>8.1f} {r.throughput:>9.2f} "
            f"{r.speedup:>6.2f}x {r.trainer_busy:>7.1%} {r.engine_busy:>6.1%} {r.engine_load:>5.2f} "
            f"{r.staleness_mean:>5.2f} {r.staleness_max:>3}  {r.staleness_hist}"
        )
    return "\n".join(rows)


def _plot(results: list[SimResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for k in sorted({r.window for r in results}):
        runs = [r for r in results if r.window == k]
        xs = [r.engines for r in runs]
        left.plot(xs, [r.speedup for r in runs], "o-", label=f"window {k}")
        right.plot(xs, [r.trainer_busy for r in runs], "o-", label=f"window {k}")
    for ax, label in ((left, "speedup over window 0"), (right, "trainer busy fraction")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("engines")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def replay_run(run_dir: str | Path) -> bool:
    """Drive this simulator's scheduler with the calls a real run recorded in its
    ``scheduler.jsonl`` (``loong-train run`` writes it): True when it makes every decision the
    run's pipeline made. The window's size and the step count come from the run's config."""
    import tomllib

    run_dir = Path(run_dir)
    config = tomllib.loads((run_dir / "config.toml").read_text())
    train = config.get("train", {})
    journal = [json.loads(line) for line in (run_dir / "scheduler.jsonl").read_text().splitlines()]
    window = StalenessWindow(train.get("max_staleness", 1), train.get("batch_groups", 16))
    return replay(journal, window, steps=train.get("steps", 100)) == journal


def main(argv: list[str] | None = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--replay"]:
        same = replay_run(argv[1])
        print(
            f"{argv[1]}: the simulator's scheduler {'repeats every' if same else 'DIFFERS from the'} decision"
        )
        raise SystemExit(0 if same else 1)
    d = SimConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=_ints, default=[8, 64, 256, 1024])
    p.add_argument("--windows", type=_ints, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--max-groups", type=int, default=20480, help="cap on groups per run; 0: none")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-per-engine", type=int, default=d.batch_per_engine)
    p.add_argument("--slots", type=int, default=d.slots)
    p.add_argument("--slot-cost", type=float, default=d.slot_cost)
    p.add_argument("--dist", choices=["lognormal", "pareto", "exponential", "constant"], default=d.dist)
    p.add_argument("--sigma", type=float, default=d.sigma)
    p.add_argument("--alpha", type=float, default=d.alpha)
    p.add_argument("--cap", type=float, default=d.cap)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--tool-latency", type=float, default=d.tool_latency)
    p.add_argument("--tool-sigma", type=float, default=d.tool_sigma)
    p.add_argument("--episodes", type=int, default=d.episodes)
    p.add_argument("--call-groups", type=int, default=d.call_groups)
    p.add_argument("--step-ratio", type=float, default=d.step_ratio)
    p.add_argument("--sync-time", type=float, default=d.sync_time)
    p.add_argument("--remote-share", type=float, default=d.remote_share, help="engines on other nodes")
    p.add_argument("--hop-time", type=float, default=d.hop_time, help="one remote engine's copy")
    p.add_argument("--train-slowdown", type=float, default=d.train_slowdown)
    p.add_argument("--engine-slowdown", type=float, default=d.engine_slowdown)
    p.add_argument("--json", help="write a list of per-run result objects to this file")
    p.add_argument("--plot", help="write a PNG of speedup and trainer busy vs engines (matplotlib)")
    a = p.parse_args(argv)
    base = SimConfig(
        steps=a.steps, seed=a.seed, batch_per_engine=a.batch_per_engine, slots=a.slots,
        slot_cost=a.slot_cost, dist=a.dist, sigma=a.sigma, alpha=a.alpha, cap=a.cap,
        step_ratio=a.step_ratio, sync_time=a.sync_time, remote_share=a.remote_share,
        hop_time=a.hop_time, turns=a.turns, tool_latency=a.tool_latency,
        tool_sigma=a.tool_sigma, episodes=a.episodes, call_groups=a.call_groups,
        train_slowdown=a.train_slowdown, engine_slowdown=a.engine_slowdown,
    )  # fmt: skip
    started = time.perf_counter()
    results = sweep(base, a.engines, a.windows, a.max_groups)
    print(_table(results))
    workload = {k: v for k, v in vars(base).items() if k not in ("engines", "window", "steps", "record")}
    print(f"[{time.perf_counter() - started:.1f}s] {workload}")
    if a.json:
        Path(a.json).write_text(json.dumps([r.summary() for r in results], indent=1) + "\n")
    if a.plot:
        _plot(results, a.plot)


if __name__ == "__main__":
    main()
