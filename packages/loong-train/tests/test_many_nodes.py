"""Beyond one node: a Ray cluster of three nodes on this machine (``ray.cluster_utils.Cluster``,
one raylet each), a recipe whose FSDP ranks (or Megatron's two tensor-parallel ranks) Ray places
on two nodes and whose rollout worker lands on the third (weights over TCP to the trainer's node
address, found at start), against the one-process torch backend at the same seed; a placement the cluster cannot satisfy, refused with
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


def _actors() -> dict:
    """The GCS actor table, dead actors too (a finished run's); ray.util.state needs the dashboard."""
    from ray._private import state

    return state.actors()


def _placed(before: dict) -> dict[str, list[str]]:
    """Node ids of each class's actors started since the table was ``before``."""
    placed: dict[str, list[str]] = {}
    for actor_id, a in _actors().items():
        if actor_id not in before:
            placed.setdefault(a["ActorClassName"], []).append(a["Address"]["NodeID"])
    return placed


def _same_run(a_dir, b_dir, rel: float, weight_atol: float) -> None:
    a, b = read_metrics(a_dir / "metrics.jsonl"), read_metrics(b_dir / "metrics.jsonl")
    assert all(r["grad_norm"] > 0 for r in a) and a[-1]["kl"] != 0  # every step moved the weights
    for ra, rb in zip(a, b, strict=True):
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], rel=rel, abs=1e-6), (ra["step"], key)
    assert ledger(a_dir) == ledger(b_dir)  # the same samples, trained at the same steps
    wa = load_file(a_dir / "checkpoints" / "final" / "model.safetensors")
    wb = load_file(b_dir / "checkpoints" / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.allclose(wa[k], wb[k], rtol=0, atol=weight_atol), k


@pytest.mark.integration
def test_fsdp_ranks_on_two_nodes_train_like_one_process(tmp_path, three_nodes):
    cache, before = tmp_path / "cache", _actors()
    spread = run(_recipe(*FSDP, *TCP), tmp_path / "fsdp", cache)  # weights over TCP to the node address
    placed = _placed(before)
    ranks, workers = placed["FsdpRank"], placed["RolloutWorker"]
    assert len(ranks) == 2 and len(set(ranks)) == 2, placed  # one rank a node
    assert len(workers) == 1 and workers[0] not in ranks  # the engine on the third
    assert set(three_nodes) == {*ranks, *workers}
    one = run(_recipe(*TCP), tmp_path / "torch", cache)
    _same_run(spread, one, rel=1e-4, weight_atol=1e-5)  # the all-reduce sums in another order


@pytest.mark.slow
@pytest.mark.integration
def test_megatron_tensor_parallel_ranks_on_two_nodes_train_like_one_process(tmp_path, three_nodes):
    """tp = 2: rank 0 is the trainer actor, rank 1 a follower actor Ray places on another node
    (one CPU a node); the rollout worker on the third. Megatron splits every matmul over the two
    ranks, so sums run in another order than the torch backend's: metrics within 1e-4 relative,
    final weights within 1e-5 (a tenth of the learning rate: Adam's steps are lr-sized)."""
    cache, before = tmp_path / "cache", _actors()
    split = run(
        _recipe("train.backend.type=megatron", "train.backend.tp=2", *TCP), tmp_path / "megatron", cache
    )
    placed = _placed(before)
    (rank0,), (rank1,), (worker,) = (
        placed["TrainerWorker"],
        placed["MegatronFollower"],
        placed["RolloutWorker"],
    )
    assert len({rank0, rank1, worker}) == 3, placed  # a rank a node, the engine on the third
    assert set(three_nodes) == {rank0, rank1, worker}
    one = run(_recipe(*TCP), tmp_path / "torch", cache)
    _same_run(split, one, rel=1e-4, weight_atol=1e-5)


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
