"""loong-train drives every transport it accepts: a synchronous run whose weights travel over TCP
(background receivers, a port chosen before the trainer binds it) equals the same run over shared
memory, metric for metric, in its ledger and in its final weights. Real Ray runs of a tiny recipe
(``train_testkit.SMALL_RUN``: every step's update depends on what it sampled)."""

import logging

import pytest
import ray
from train_testkit import SMALL_RUN, assert_same_run

from loong_core.telemetry import read_metrics
from loong_train.config import load_recipe
from loong_train.controller import run


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=3, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.mark.integration
def test_a_tcp_run_equals_the_shm_run(tmp_path, cluster):
    sync = [*SMALL_RUN, "train.steps=2", "train.max_staleness=0"]  # one worker: a fixed batch order
    shm = run(load_recipe("tiny-calc-agent", sync), tmp_path / "shm", tmp_path / "cache")
    tcp_recipe = load_recipe("tiny-calc-agent", [*sync, "transport.type='tcp'", "transport.checksum=true"])
    tcp = run(tcp_recipe, tmp_path / "tcp", tmp_path / "cache")
    a, b = read_metrics(shm / "metrics.jsonl"), read_metrics(tcp / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2]
    assert all(r["weight_sync_s"] > 0 for r in b)  # the updates did travel
    assert_same_run(a, b, shm, tcp)
