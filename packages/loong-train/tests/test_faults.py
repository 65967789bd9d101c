"""Faults: a rollout worker's process is killed mid-run (SIGKILL, a real process). Ray restarts it,
the groups it was generating are issued again, and the ledger shows every sample trained once."""

import json
import os
import signal
import threading
import time
from collections import Counter

import pytest

from loong_core.telemetry import read_metrics
from loong_train import controller
from loong_train.config import load_recipe

FAST = [
    "warmstart.steps=0",
    "train.steps=6",
    "train.batch_groups=2",
    "train.max_staleness=1",
    "rollout.workers=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=12",
    "rollout.max_model_tokens=24",
    "eval.every=3",
    "eval.num_tasks=4",
]


def _kill_after_step_one(pipes: list, metrics, worker: int, killed: dict, stop: threading.Event) -> None:
    """Once the run has trained a step, SIGKILL rollout worker ``worker``'s process."""
    while not stop.is_set():
        if pipes and metrics.exists() and any(r["step"] >= 1 for r in read_metrics(metrics)):
            killed["pid"] = pipes[0].pool.pids[worker]
            os.kill(killed["pid"], signal.SIGKILL)
            return
        time.sleep(0.02)


@pytest.mark.integration
def test_killed_rollout_worker_is_restarted_and_no_sample_is_lost(tmp_path, monkeypatch):
    pipes: list = []
    start = controller._start
    monkeypatch.setattr(controller, "_start", lambda *a: pipes.append(start(*a)) or pipes[-1])
    recipe = load_recipe("tiny-calc-agent", FAST)
    out_dir, killed, stop = tmp_path / "run", {}, threading.Event()
    killer = threading.Thread(
        target=_kill_after_step_one, args=(pipes, out_dir / "metrics.jsonl", 0, killed, stop), daemon=True
    )
    killer.start()
    try:
        out = controller.run(recipe, out_dir, tmp_path / "cache")
    finally:
        stop.set()
        killer.join()
    assert "pid" in killed, "the run ended before the kill"

    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] <= recipe.train.max_staleness for r in rows)
    assert pipes[0].pool.pids[0] != killed["pid"]  # the worker answered again, from a new process

    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert [e["step"] for e in ledger] == [1, 2, 3, 4, 5, 6]
    groups = [g for e in ledger for g in e["groups"]]
    assert len(groups) == len(set(groups)) == 6 * recipe.train.batch_groups
    samples = Counter(s for e in ledger for s in e["sample_ids"])
    assert max(samples.values()) == 1  # no sample trained twice
    n = recipe.rollout.group_size
    assert set(samples) == {f"{g}-{j}" for g in groups for j in range(n)}  # each group complete
    summary = json.loads((out / "summary.json").read_text())
    assert summary["worker_restarts"] >= 1 and summary["steps"] == 6


def test_a_restarted_worker_takes_the_newest_published_weights(tiny_dir):
    """What Ray's restart runs: the constructor reloads the model, then copies in the newest
    version the trainer published; an older update queued before the death is then skipped."""
    import torch

    from loong_train.models.decoder import CausalLM
    from loong_train.workers.rollout import RolloutWorker
    from loong_transfermesh import TransportConfig, open_sender

    transport = TransportConfig(name=f"catch-up-test-{os.getpid()}", mode="zero_copy")
    trained = CausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    sender = open_sender(transport)
    try:
        old = sender.push(dict(trained.named_parameters()), version=2)
        sender.push(dict(trained.named_parameters()), version=3)
        worker = RolloutWorker(
            str(tiny_dir),
            seed=0,
            sampling={"temperature": 1.0, "max_new_tokens": 8},
            limits={"max_turns": 1, "max_model_tokens": 8},
            transport=transport,
        )
        assert worker.weight_version() == 3
        slot = worker.receiver.read(3)
        for name, p in worker.engine.model.named_parameters():
            assert p.equal(dict(trained.named_parameters())[name]), name
            assert p.data_ptr() != slot[name].data_ptr()  # copied: the slot may be reused
        worker.apply_weights(old)
        assert worker.weight_version() == 3
    finally:
        sender.close()


@pytest.mark.integration
def test_a_run_that_fails_to_start_ends_the_actors_it_began(tmp_path, monkeypatch):
    """A failure after the actors began (here the reach check raising, as a call on a worker that
    died in its constructor does): the run raises it, ends every actor it started on a cluster
    that outlives it, and removes its core board."""
    import ray

    from loong_train import ray_env
    from loong_train.cores import board_path

    began: list = []

    def recording(real):
        def record(*args):
            out = real(*args)
            began.extend(out if isinstance(out, list) else [out])
            return out

        return record

    for name in ("_start_workers", "_start_trainer"):
        monkeypatch.setattr(controller, name, recording(getattr(controller, name)))

    boards: dict = {}  # this run's board (others' come and go: runs in parallel test processes)

    def unreachable(recipe, transport, trainer, workers):  # after the actors started, as the check does
        ray.get([trainer.node.remote(), *(w.node.remote() for w in workers)])
        boards["path"] = path = board_path(transport.name)
        boards["made"] = path.exists()
        raise RuntimeError("no worker answered")

    monkeypatch.setattr(controller, "_check_reach", unreachable)
    recipe = load_recipe("tiny-calc-agent", [*FAST, "train.borrow_idle_threads=true"])
    ours = not ray.is_initialized()
    if ours:
        ray_env.connect(recipe)  # a cluster the run did not start: it stays up after the run
    try:
        with pytest.raises(RuntimeError, match="no worker answered"):
            controller.run(recipe, tmp_path / "run", tmp_path / "cache")
        assert len(began) == 3 and ray.is_initialized()
        for actor in began:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(actor.node.remote(), timeout=60)
        assert boards["made"], "the run made no core board"
        assert not boards["path"].exists()
    finally:
        if ours:
            ray.shutdown()
