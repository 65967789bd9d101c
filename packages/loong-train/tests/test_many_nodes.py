"""Beyond one node: a Ray cluster of three nodes on this machine (``ray.cluster_utils.Cluster``,
one raylet each), a recipe whose FSDP ranks Ray places on two nodes and whose rollout worker
lands on the third (weights over TCP to the trainer's node address, found at start), against the
one-process torch backend at the same seed; a placement the cluster cannot satisfy, refused with
what is missing; shared memory to a worker on another node, refused before any step."""

import logging
import os

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from safetensors.torch import load_file
from train_testkit import COMPARED, SMALL_RUN, ledger

from loong_core.telemetry import read_metrics
from loong_train.config import load_recipe
from loong_train.controller import run

FSDP = ['train.backend.type="fsdp"', "train.backend.ranks=2", 'train.backend.placement="STRICT_SPREAD"']
TCP = ['transport.type="tcp"', 'transport.address="0.0.0.0:0"', 'transport.key="many-nodes-test"']


@pytest.fixture(scope="module")
def three_nodes():
    before = os.environ.get("RAY_ADDRESS")
    cluster = Cluster()
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    yield [n.node_id for n in nodes]
    ray.shutdown()
    cluster.shutdown()
    if before is None:  # joining the cluster exported its address: later tests start their own
        os.environ.pop("RAY_ADDRESS", None)
    else:
        os.environ["RAY_ADDRESS"] = before


def _recipe(*overrides):
    return load_recipe("tiny-calc-agent", [*SMALL_RUN, "train.max_staleness=0", "train.steps=3", *overrides])


@pytest.mark.integration
def test_fsdp_ranks_on_two_nodes_train_like_one_process(tmp_path, three_nodes):
    from ray._private import state  # the GCS actor table (ray.util.state needs the dashboard)

    cache = tmp_path / "cache"
    spread = run(_recipe(*FSDP, *TCP), tmp_path / "fsdp", cache)  # weights over TCP to the node address
    placed = {}
    for a in state.actors().values():  # the run's actors, dead once it finished
        placed.setdefault(a["ActorClassName"], []).append(a["Address"]["NodeID"])
    ranks, workers = placed["FsdpRank"], placed["RolloutWorker"]
    assert len(ranks) == 2 and len(set(ranks)) == 2, placed  # one rank a node
    assert len(workers) == 1 and workers[0] not in ranks  # the engine on the third
    assert set(three_nodes) == {*ranks, *workers}

    one = run(_recipe(*TCP), tmp_path / "torch", cache)
    a, b = read_metrics(spread / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
    assert all(r["grad_norm"] > 0 for r in a) and a[-1]["kl"] != 0  # every step moved the weights
    for ra, rb in zip(a, b, strict=True):  # the all-reduce sums in another order: float rounding
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)
    assert ledger(spread) == ledger(one)  # the same samples, trained at the same steps
    wa = load_file(spread / "checkpoints" / "final" / "model.safetensors")
    wb = load_file(one / "checkpoints" / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=0, atol=1e-5), k


@pytest.mark.integration
def test_more_ranks_than_the_cluster_places_is_an_error(tmp_path, three_nodes):
    recipe = _recipe(
        'train.backend.type="fsdp"', "train.backend.ranks=4", "train.backend.placement_timeout_s=3"
    )
    missing = r"ranks = 4 ranks of 1 CPUs each \(placement 'PACK'\) could not be placed .* 3 node\(s\)"
    with pytest.raises(ray.exceptions.RayActorError, match=missing):  # the trainer's start fails
        run(recipe, tmp_path / "run", tmp_path / "cache")


@pytest.mark.integration
def test_shared_memory_to_a_worker_on_another_node_is_refused(tmp_path, three_nodes):
    """One CPU a node: the trainer (1 CPU) and the rollout worker (1 CPU) land on two nodes."""
    from loong_core.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"transport type 'shm' reaches rollout workers on the trainer's node only"
    ):
        run(_recipe(), tmp_path / "run", tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"type 'tcp' on loopback \(127.0.0.1:\d+\)"):
        run(_recipe('transport.type="tcp"'), tmp_path / "run2", tmp_path / "cache")
