"""Partial rollouts (``loong_train.engines.embedded.host``): a weight update lands in a running rollout call.

A real in-process worker generates on one thread while the update arrives through TransferMesh on
another, as Ray's ``weights`` concurrency group delivers it. Every token's logprob is checked
against a fresh full forward (float64 log-softmax) of the model of the version stamped on it:
tokens after the update against the new weights, tokens before it against the old ones.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import pytest
import torch

from loong_core.config import ConfigError
from loong_core.protocols import SamplingParams
from loong_core.records import Trajectory, WeightManifest
from loong_core.telemetry import read_metrics
from loong_core.window import StalenessWindow
from loong_train import controller
from loong_train.config import load_recipe
from loong_train.engines.config import EmbeddedEngineConfig
from loong_train.models.decoder import CausalLM
from loong_train.scheduler import Scheduler
from loong_train.source import GroupSource
from loong_train.tiny import calc
from loong_train.workers.rollout import RolloutWorker
from loong_transfermesh import ShmSender, TransportConfig, remove_slots

TOKENS = 96  # per episode; no stop token, so every episode is long


@pytest.fixture
def setup(tiny_dir, request):
    """A worker at version 0 and version 1 (perturbed weights) pushed into its transport (shm).
    ``request.param``: ``"copy"`` (the default) or ``"zero_copy"``, the receiving mode, with
    ``partial = "continue"``; or ``"off"``: copy mode, ``partial = "off"``."""
    name = f"partial-{request.node.name}".replace("[", "-").replace("]", "")
    param = getattr(request, "param", "copy")
    mode, partial = ("copy", "off") if param == "off" else (param, "continue")
    worker = RolloutWorker(
        str(tiny_dir),
        seed=0,
        sampling={"temperature": 1.0, "max_new_tokens": TOKENS},
        limits={"max_turns": 1, "max_model_tokens": TOKENS},
        transport=TransportConfig(name=name, mode=mode),
        engine=EmbeddedEngineConfig(partial=partial),
    )
    worker.sampling = SamplingParams(temperature=1.0, max_new_tokens=TOKENS, stop_token_ids=[])
    old = CausalLM.from_pretrained(str(tiny_dir)).eval()
    new = CausalLM.from_pretrained(str(tiny_dir)).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    sender = ShmSender(name)
    manifest = sender.push(dict(new.named_parameters()), version=1)
    yield worker, {0: old, 1: new}, manifest
    worker.close()
    sender.close()
    remove_slots(name)


def _rollout_across_update(
    worker: RolloutWorker, manifest: WeightManifest, restart_below: int = -1, evaluation: bool = False
):
    """Start a rollout of 2 groups x 4 episodes; apply ``manifest`` once ~10 tokens per row were
    sampled. Returns the trajectories and the apply's result."""
    source = GroupSource(calc.train_tasks(3, []), group_size=4, seed=7)
    specs = [s for _ in range(2) for s in source.specs(source.next_group())]
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(result=worker.rollout(specs, 0, evaluation)))
    thread.start()
    while worker.engine.stats.tokens < 10 * len(specs):
        time.sleep(0.001)
    applied = worker.apply_weights(manifest, restart_below)
    thread.join()
    return out["result"].trajectories, applied


def _check_logprobs(trajs: list[Trajectory], models: dict[int, CausalLM]) -> None:
    """Every model token's logprob equals log_softmax of a full forward of its version's model."""
    for t in trajs:
        ids = [i for s in t.spans for i in s.token_ids]
        logits = {v: m(torch.tensor([ids])).double()[0] for v, m in models.items()}
        pos = 0
        for s in t.spans:
            if s.is_model:
                for j, (tok, lp, v) in enumerate(
                    zip(s.token_ids, s.logprobs, s.token_versions(), strict=True)
                ):
                    want = torch.log_softmax(logits[v][pos + j - 1], -1)[tok].item()
                    assert abs(lp - want) < 1e-5, (t.sample_id, pos + j, v, lp, want)
            pos += len(s.token_ids)


@pytest.mark.parametrize("setup", ["copy", "zero_copy"], indirect=True)
@torch.no_grad()
def test_continue_keeps_generating_under_the_new_version(setup):
    worker, models, manifest = setup
    trajs, applied = _rollout_across_update(worker, manifest)
    assert applied.restarted == 0 and worker.weight_version() == 1
    slot = worker.receiver.read(1)  # zero_copy: the engine reads only the new slot from the apply on
    for name, p in worker.engine.model.named_parameters():
        assert (p.data_ptr() == slot[name].data_ptr()) == (worker.receiver.mode == "zero_copy"), name
    crossed = [t for t in trajs if t.mixed_versions]
    assert len(crossed) == len(trajs)  # every episode was mid-generation when the update came
    for t in crossed:
        versions = t.token_versions[t.prompt_len :]
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
        assert t.oldest_version == 0
    _check_logprobs(trajs, models)
    # the reference can tell the versions apart: new tokens scored by the old model disagree
    t = crossed[0]
    wrong = {0: models[0], 1: models[0]}
    with pytest.raises(AssertionError):
        _check_logprobs([t], wrong)


@torch.no_grad()
def test_restart_reruns_episodes_that_started_below_the_floor(setup):
    worker, models, manifest = setup
    trajs, applied = _rollout_across_update(worker, manifest, restart_below=1)
    assert applied.restarted == len(trajs)
    # nothing of the version-0 generations survives: all tokens are from the new weights
    assert all(t.oldest_version == 1 and not t.mixed_versions for t in trajs)
    assert all(t.num_model_tokens == TOKENS for t in trajs)
    _check_logprobs(trajs, models)


@torch.no_grad()
def test_an_update_waits_for_a_running_evaluation(setup):
    worker, models, manifest = setup
    trajs, applied = _rollout_across_update(worker, manifest, restart_below=1, evaluation=True)
    assert applied.restarted == 0 and worker.weight_version() == 1
    assert all(t.oldest_version == 0 and not t.mixed_versions for t in trajs)
    _check_logprobs(trajs, models)


def _specs(groups: int, seed: int = 7) -> list:
    source = GroupSource(calc.train_tasks(seed, []), group_size=4, seed=seed)
    return [s for _ in range(groups) for s in source.specs(source.next_group())]


def _in_threads(*calls) -> list:
    """Run each ``(fn, *args)`` on its own thread (as Ray's ``rollout`` group does); their results."""
    out: list = [None] * len(calls)

    def run(i, fn, *args):
        out[i] = fn(*args)

    threads = [threading.Thread(target=run, args=(i, *c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@torch.no_grad()
def test_concurrent_calls_share_the_running_batch_and_sample_what_each_would_alone(setup):
    worker, _, _ = setup
    a, b = _specs(1, seed=3), _specs(1, seed=4)
    alone = [worker.rollout(a).trajectories, worker.rollout(b).trajectories]
    worker.engine.stats.steps = worker.engine.stats.tokens = 0
    together = [r.trajectories for r in _in_threads((worker.rollout, a), (worker.rollout, b))]
    assert worker.engine.stats.mean_occupancy > len(a)  # rows of both calls in one decode step
    for solo, shared in zip(alone, together, strict=True):
        assert [t.sample_id for t in solo] == [t.sample_id for t in shared]
        for x, y in zip(solo, shared, strict=True):  # per-episode seeds: the same tokens
            assert x.token_ids == y.token_ids
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("setup", ["off"], indirect=True)
@torch.no_grad()
def test_with_partial_off_an_update_waits_for_the_running_calls_and_holds_new_ones(setup):
    """``partial = "off"`` with concurrent calls: an update that arrives mid-generation waits for
    both running calls (none of their tokens is from version 1), and a call that arrives while
    the update waits starts only after it (all its tokens are from version 1)."""
    worker, models, manifest = setup
    assert worker.between_calls
    first, second, later = _specs(1, seed=3), _specs(1, seed=4), _specs(1, seed=5)
    out: dict = {}

    def update_then_call():
        while worker.engine.stats.tokens < 10 * (len(first) + len(second)):
            time.sleep(0.001)
        apply = threading.Thread(target=lambda: out.update(applied=worker.apply_weights(manifest)))
        apply.start()
        while not worker.host._swapping:  # the update is pending: the next call must wait for it
            time.sleep(0.001)
        out["later"] = worker.rollout(later)
        apply.join()

    results = _in_threads((worker.rollout, first), (worker.rollout, second), (update_then_call,))
    assert out["applied"].version == 1 and worker.weight_version() == 1
    running = [t for r in results[:2] for t in r.trajectories]
    assert all(t.num_model_tokens == TOKENS for t in running)  # still generating when it came
    assert {v for t in running for v in t.token_versions[t.prompt_len :]} == {0}
    assert {v for t in out["later"].trajectories for v in t.token_versions[t.prompt_len :]} == {1}
    _check_logprobs([*running, *out["later"].trajectories], models)


@pytest.mark.slow  # ~6 s of training; Ray's start dominates (26 to 84 s in all on the shared 2 cores)
@pytest.mark.integration
def test_pipeline_with_partial_continue_and_concurrent_calls_keeps_the_window_bound(tmp_path, monkeypatch):
    """Ray run, 2 workers running 2 calls each at once, max_staleness 1, long generations
    (random init: few stop tokens), so updates land mid-call: mixed-version samples get trained,
    staleness stays <= 1, nothing is evicted or trained twice."""
    pipes: list = []
    start = controller._start
    monkeypatch.setattr(controller, "_start", lambda *a: pipes.append(start(*a)) or pipes[-1])
    overrides = [
        "warmstart.steps=0",
        "train.steps=5",
        "train.batch_groups=2",
        "train.max_staleness=1",
        "rollout.workers=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=48",
        "rollout.max_model_tokens=96",
        "rollout.engine.partial=continue",
        "rollout.engine.concurrent_calls=2",
        "eval.every=5",
        "eval.num_tasks=4",
    ]
    out = controller.run(load_recipe("tiny-calc-agent", overrides), tmp_path / "run", tmp_path / "cache")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["staleness_max"] <= 1 for r in rows)
    assert sum(r["mixed_version_samples"] for r in rows) > 0
    assert rows[-1]["restarted_episodes"] == 0 and rows[-1]["reissued_groups"] == 0
    assert pipes[0].window.stats.evicted == 0
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    samples = Counter(s for e in ledger for s in e["sample_ids"])
    assert len(samples) == 5 * 2 * 2 and max(samples.values()) == 1  # no sample trained twice


def test_partial_rollouts_and_concurrent_calls_need_the_embedded_engine_and_a_whitebox_agent():
    assert (
        load_recipe("tiny-calc-agent", ["rollout.engine.partial=restart"]).rollout.engine.partial == "restart"
    )
    with pytest.raises(
        ValueError, match=r"rollout\.engine\.partial = 'continue' needs agent\.type = 'whitebox'"
    ):
        load_recipe("tiny-calc-agent", ["rollout.engine.partial=continue", "agent.type=blackbox"])
    with pytest.raises(
        ValueError, match=r"rollout\.engine\.concurrent_calls = 2 needs agent\.type = 'whitebox'"
    ):
        load_recipe("tiny-calc-agent", ["rollout.engine.concurrent_calls=2", "agent.type=blackbox"])
    with pytest.raises(ConfigError, match=r"concurrent_calls must be >= 1, got 0"):
        load_recipe("tiny-calc-agent", ["rollout.engine.concurrent_calls=0"])


@pytest.mark.parametrize("k", [1, 2])
def test_no_in_flight_group_is_ever_below_the_restart_floor(k):
    """Why ``restart`` is a guard: driving the scheduler as the pipeline does (admission at the
    queued version, finishes at random later versions, a take whenever possible), every in-flight
    entry's admit version stays >= ``Scheduler.restart_floor()`` and nothing is evicted."""
    rng = random.Random(k)
    scheduler = Scheduler(StalenessWindow(max_staleness=k, batch_size=2), steps=50)
    window, ids, checked = scheduler.window, (f"g{i}" for i in range(10**6)), 0
    while window.version < 50:
        while rng.random() < 0.7 and scheduler.admit(1, lambda: next(ids)):
            pass
        for entry, admitted in list(window.in_flight.items()):
            if rng.random() < 0.4:
                assert scheduler.finish(entry, rng.randint(admitted, window.version))
        if scheduler.take() is not None:
            scheduler.published(window.version + 1)
            assert all(a >= scheduler.restart_floor() for a in window.in_flight.values())
            checked += len(window.in_flight)
    assert checked > 20 and window.stats.evicted == 0
