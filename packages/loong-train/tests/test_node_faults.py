"""A node dies mid-run, on a Ray cluster of one machine (``ray.cluster_utils.Cluster``: a head
without CPUs for actors and three one-CPU nodes, each its own raylet; weights over TCP to the
trainer's node address). The node is removed without grace (its raylet and workers killed), as
a machine that loses power.

- The rollout worker's node: Ray restarts the worker on the spare node, the groups it was
  generating are issued again, and the run finishes every step with no sample lost or trained
  twice (the ledger).
- The trainer's node: the run stops with an error naming that node and ``--resume``; resumed
  on the nodes left, it continues from the newest checkpoint and finishes, again with no group
  trained twice.
- A Megatron follower rank's node: the run stops naming the rank and its node.
"""

import logging
import os
import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster
from train_testkit import SMALL_RUN, ledger

from loong_core.telemetry import read_metrics
from loong_train.config import load_recipe
from loong_train.controller import run
from loong_train.pipeline import TrainerLost

TCP = ['transport.type="tcp"', 'transport.address="0.0.0.0:0"', 'transport.key="node-faults-test"']
STEPS = 16  # a tiny step takes a fraction of a second: room for the kill to land mid-run
FAST_DEATH = {  # the GCS declares a silent node dead within about a second
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 200,
    "health_check_failure_threshold": 3,
}


@pytest.fixture
def cluster():
    before = os.environ.get("RAY_ADDRESS")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "_system_config": FAST_DEATH})
    for _ in range(3):
        c.add_node(num_cpus=1)
    ray.init(address=c.address, logging_level=logging.WARNING)
    yield c
    ray.shutdown()
    c.shutdown()
    if before is None:
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = before


def _recipe(*overrides):
    return load_recipe("tiny-calc-agent", [*SMALL_RUN, *TCP, f"train.steps={STEPS}", *overrides])


def _alive_on(actor_class: str) -> str | None:
    """The node id of the live actor of ``actor_class`` (the GCS actor table); None while
    there is none."""
    from ray._private import state

    nodes = [
        a["Address"]["NodeID"]
        for a in state.actors().values()
        if a["ActorClassName"] == actor_class and a["State"] == "ALIVE"
    ]
    assert len(nodes) <= 1, (actor_class, nodes)
    return nodes[0] if nodes else None


def _kill_node_at_step(cluster: Cluster, out, step: int, actor_class: str) -> dict:
    """Once ``out/metrics.jsonl`` reaches ``step``, remove the node ``actor_class`` runs on;
    returns what was killed (filled in from a thread). The node is looked up as soon as the
    actor is alive, so the kill itself costs no query of the GCS once the step is reached."""
    killed: dict = {}

    def watch() -> None:
        deadline = time.monotonic() + 300
        node = None
        path = out / "metrics.jsonl"
        while time.monotonic() < deadline:
            if node is None:
                node_id = _alive_on(actor_class)
                if node_id:
                    node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
            elif path.exists() and len(path.read_text().splitlines()) >= step:
                cluster.remove_node(node, allow_graceful=False)
                killed.update(node_id=node.node_id, ip=node.node_ip_address)
                killed["run_steps_then"] = len(path.read_text().splitlines())
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    killed["thread"] = thread
    return killed


def _assert_ledger_complete(out, steps: int, group_size: int) -> None:
    entries = ledger(out)
    assert [e["step"] for e in entries] == list(range(1, steps + 1))
    groups = [g for e in entries for g in e["groups"]]
    assert len(groups) == len(set(groups))  # no group trained twice
    samples = [s for e in entries for s in e["sample_ids"]]
    assert len(samples) == len(set(samples)) == len(groups) * group_size  # every sample, once


@pytest.mark.slow
@pytest.mark.integration
def test_the_rollout_workers_node_dies_and_the_run_goes_on(tmp_path, cluster):
    out = tmp_path / "run"
    killed = _kill_node_at_step(cluster, out, 2, "RolloutWorker")
    run(_recipe("train.max_staleness=1"), out, tmp_path / "cache")
    killed["thread"].join()
    assert killed.get("node_id"), "the run ended before the node could be killed"
    rows = read_metrics(out / "metrics.jsonl")
    assert killed["run_steps_then"] < STEPS, "the node died after the run's last step"
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["worker_restarts"] >= 1
    _assert_ledger_complete(out, STEPS, group_size=2)


@pytest.mark.slow
@pytest.mark.integration
def test_the_trainers_node_dies_the_run_stops_naming_it_and_resumes(tmp_path, cluster):
    out, cache = tmp_path / "run", tmp_path / "cache"
    recipe = _recipe("train.max_staleness=0", "train.checkpoint_every=2")
    killed = _kill_node_at_step(cluster, out, 3, "TrainerWorker")
    with pytest.raises(TrainerLost) as lost:
        run(recipe, out, cache)
    killed["thread"].join()
    message = str(lost.value)
    assert killed["ip"] in message and killed["node_id"][:12] in message
    assert f"--resume {out}" in message
    # the nodes left hold the trainer and the worker again: resumed from step 2's checkpoint
    run(recipe, out, cache, resume=True)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
    _assert_ledger_complete(out, STEPS, group_size=2)


@pytest.mark.slow
@pytest.mark.integration
def test_a_megatron_followers_node_dies_the_run_stops_naming_it(tmp_path, cluster):
    """tp = 2 with the follower rank on a node of its own (one CPU a node): its node removed
    at step 2, rank 0's next collective fails, and the run stops naming the rank, its node and
    ``--resume``."""
    out = tmp_path / "run"
    recipe = _recipe("train.max_staleness=0", "train.backend.type=megatron", "train.backend.tp=2")
    killed = _kill_node_at_step(cluster, out, 2, "MegatronFollower")
    with pytest.raises(TrainerLost) as lost:
        run(recipe, out, tmp_path / "cache")
    killed["thread"].join()
    message = str(lost.value)
    assert f"rank 1 on node {killed['node_id']}" in message, message
    assert f"--resume {out}" in message
