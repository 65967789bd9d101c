"""``[rollout] engine = "sglang"``: a RolloutWorker (in process) runs white-box episodes against its
own supervised server (launcher ``loong``: ``loong-train serve-sglang`` on CPU), receives weights
through TransferMesh and pushes them into the server over a gloo group, and pushes them again
after the server was killed and relaunched.

References: the torch trainer's recomputed logprobs for the server's tokens (an independent
forward pass, the first-step check of ``test_first_step.py``), and the trainer's own weights for
what the server holds (``/get_weights_by_name``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import torch
from train_testkit import server_port, wait_relaunched

from loong_core.protocols import SamplingParams
from loong_train.algo.losses import grpo_advantages, pack_batch
from loong_train.backends.config import MegatronBackendConfig
from loong_train.config import load_recipe, recipe_names
from loong_train.controller import trainer_options
from loong_train.engines.config import SGLangEngineConfig
from loong_train.engines.sglang.supervisor import SGLangServerError
from loong_train.source import GroupSource
from loong_train.tiny import calc
from loong_train.workers.rollout import RolloutWorker
from loong_train.workers.trainer import TrainerWorker
from loong_transfermesh import TransportConfig

PROBE = "model.layers.0.mlp.up_proj.weight"


def _served(url: str, name: str) -> torch.Tensor:
    body = {"name": name, "truncate_size": 10**9}
    return torch.tensor(httpx.post(f"{url}/get_weights_by_name", json=body).json())


def _version(url: str) -> str:
    return httpx.get(f"{url}/get_weight_version").json()["weight_version"]


async def _streamed(engine, prompt: list[int]) -> list:
    return [d async for d in engine.stream(prompt, SamplingParams(max_new_tokens=8))]


def _rollout(worker: RolloutWorker, seed: int, groups: int = 1):
    source = GroupSource(calc.train_tasks(seed, []), group_size=4)
    specs = [s for _ in range(groups) for s in source.specs(source.next_group())]
    return worker.rollout(specs).trajectories


@pytest.mark.integration
def test_worker_generates_takes_weights_and_survives_a_server_restart(tiny_dir, recipe, tmp_path):
    transport = TransportConfig(name=f"sglang-rollout-{os.getpid()}")
    config = SGLangEngineConfig(launcher="loong", port_base=server_port(2), health_interval_s=0.3)
    worker = RolloutWorker(
        str(tiny_dir),
        seed=0,
        sampling={"temperature": 1.0, "max_new_tokens": 24},
        limits={"max_turns": 2, "max_model_tokens": 40},
        transport=transport,
        engine=config,
        log_dir=str(tmp_path / "logs"),
    )
    trainer = TrainerWorker(str(tiny_dir), transport=transport, **trainer_options(recipe))
    url, supervisor = worker.engine.supervisor.url, worker.engine.supervisor
    try:
        trajs = _rollout(worker, seed=0, groups=2)
        assert {t.oldest_version for t in trajs} == {0}
        deltas = asyncio.run(_streamed(worker.engine, trajs[0].spans[0].token_ids))
        assert len(deltas) > 1 and sum(len(d.token_ids) for d in deltas) == 8  # across the client's loop
        assert all(d.weight_version == 0 and len(d.logprobs) == len(d.token_ids) for d in deltas)
        batch = pack_batch(trajs, grpo_advantages(trajs), policy_version=0)
        recomputed = trainer.logprobs(batch)
        gaps = [
            abs(a - b)
            for a, b, m in zip(recomputed, batch.behaviour_logprobs, batch.loss_mask, strict=True)
            if m
        ]
        assert len(gaps) > 50 and max(gaps) <= 1e-5

        manifest = trainer.publish(trainer.train_step(batch)).manifest
        worker.apply_weights(manifest)
        sent = trainer.backend.named_weights()
        assert _version(url) == "1" and worker.weight_version() == 1
        assert torch.equal(_served(url, PROBE), sent[PROBE])
        assert {t.oldest_version for t in _rollout(worker, seed=1)} == {1}

        os.kill(supervisor.pid, signal.SIGKILL)  # the relaunched server loads the checkpoint ...
        wait_relaunched(supervisor, lambda: _healthy_at_version(url, "1"), "at version 1")
        assert torch.equal(_served(url, PROBE), sent[PROBE])  # ... and gets version 1 pushed again
        assert {t.oldest_version for t in _rollout(worker, seed=2)} == {1}
    finally:
        trainer.close()
        worker.close()
    assert supervisor.pid is None
    log = (tmp_path / "logs" / "sglang-0.log").read_text()
    assert log.count("serve-sglang:") == 2 and "exited with code -9" in log


def _holds_all(url: str, named: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(_served(url, k), v) for k, v in named.items())


@pytest.mark.integration
def test_direct_weights_reach_both_servers_and_a_restarted_one_is_caught_up(tiny_dir, recipe, tmp_path):
    """``weights = "direct"``: two workers (no host copy) and their servers; the trainer pushes
    each version into both (bit for bit, every tensor) and the workers only confirm it. One
    server is killed: relaunched from the checkpoint (version 0), the trainer's watcher catches it
    up to the newest version, and the worker's next rollout runs on it."""
    config = SGLangEngineConfig(port_base=server_port(2), health_interval_s=0.2, weights="direct")
    workers = [
        RolloutWorker(
            str(tiny_dir),
            seed=i,
            sampling={"temperature": 1.0, "max_new_tokens": 16},
            limits={"max_turns": 2, "max_model_tokens": 32},
            engine=config,
            worker_id=i,
            log_dir=str(tmp_path / "logs"),
        )
        for i in range(2)
    ]
    options = {
        **trainer_options(recipe),
        "receivers": 0,
        "servers": config.pusher(2),
        "watch_interval_s": 0.2,
    }
    trainer = TrainerWorker(str(tiny_dir), transport=TransportConfig(), **options)
    urls = [config.url(0), config.url(1)]
    try:
        assert all(w.engine.model is None and w.receiver is None for w in workers)
        for version in (1, 2):
            trajs = [t for i, w in enumerate(workers) for t in _rollout(w, seed=10 * version + i)]
            assert {t.oldest_version for t in trajs} == {version - 1}
            manifest = trainer.publish(
                trainer.train_step(pack_batch(trajs, grpo_advantages(trajs), version - 1))
            ).manifest
            assert manifest.version == version
            sent = trainer.backend.named_weights()
            assert [_version(u) for u in urls] == [str(version)] * 2
            assert all(_holds_all(u, sent) for u in urls)
            for w in workers:
                w.apply_weights(manifest)
                assert w.weight_version() == version

        supervisor = workers[1].engine.supervisor
        os.kill(supervisor.pid, signal.SIGKILL)  # relaunched from the checkpoint: version 0 ...
        wait_relaunched(supervisor, lambda: _healthy_at_version(urls[1], "2"), "at version 2")
        assert _holds_all(urls[1], sent)  # ... and the trainer pushed version 2 into it
        assert {t.oldest_version for t in _rollout(workers[1], seed=3)} == {2}
    finally:
        trainer.close()
        for w in workers:
            w.close()


@pytest.mark.integration
def test_a_server_the_supervisor_gave_up_on_fails_the_rollout_call(tiny_dir, tmp_path):
    config = SGLangEngineConfig(port_base=server_port(2), health_interval_s=0.2, max_restarts=0)
    worker = RolloutWorker(
        str(tiny_dir),
        seed=0,
        sampling={"temperature": 1.0, "max_new_tokens": 8},
        limits={"max_turns": 1, "max_model_tokens": 8},
        engine=config,
        log_dir=str(tmp_path),
    )
    supervisor = worker.engine.supervisor
    try:
        os.kill(supervisor.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while supervisor.error is None:
            assert time.monotonic() < deadline, "the supervisor did not give up within 60 s"
            time.sleep(0.05)
        with pytest.raises(SGLangServerError, match=r"sglang-0\.log"):
            _rollout(worker, seed=0)
    finally:
        worker.close()


def _healthy_at_version(url: str, version: str) -> bool:
    try:
        return _version(url) == version
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ({"launcher": "sglang"}, "needs a GPU per tensor-parallel rank"),
        ({"launcher": "sglang", "gpus": 1, "tp_size": 2}, "needs a GPU per tensor-parallel rank"),
        ({"gpus": 1.5}, "fraction of one GPU or a whole number"),
        ({"tp_size": 2}, "need launcher = 'sglang'"),
        ({"host": "0.0.0.0"}, "set api_key"),
        ({"update_backend": "tensor"}, 'it needs weights = "direct"'),
    ],
)
def test_sglang_table_errors_name_the_problem(table, problem):
    with pytest.raises(ValueError, match=problem):
        SGLangEngineConfig(**table)


def test_sglang_launcher_flags():
    config = SGLangEngineConfig(
        launcher="sglang", python="/opt/sglang/bin/python", gpus=2, tp_size=2, mem_fraction_static=0.7,
        port_base=31000, args=["--context-length", "4096"],
    )  # fmt: skip
    server = config.server("/ckpt/Qwen3-8B", worker_id=3, log_dir="/runs/x/logs", seed=7)
    assert server.argv() == [
        "/opt/sglang/bin/python", "-m", "sglang.launch_server",
        "--model-path", "/ckpt/Qwen3-8B", "--host", "127.0.0.1", "--port", "31003",
        "--tp-size", "2", "--random-seed", "7", "--skip-tokenizer-init",
        "--mem-fraction-static", "0.7", "--context-length", "4096",
    ]  # fmt: skip
    assert server.log_path == "/runs/x/logs/sglang-3.log"
    # /health must not generate: a paused server (weight update) would fail its health checks
    assert server.env == {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
    lora = config.server(
        "/ckpt", worker_id=0, log_dir="", seed=7, lora_rank=16, lora_modules=["q_proj", "v_proj"]
    )
    assert lora.argv()[-8:] == [
        "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
        "--context-length", "4096",
    ]  # fmt: skip


GPU_TOTALS = {  # GPUs each shipped GPU recipe asks Ray for, as docs/gpu.md states them
    "qwen3-0.6b-calc-colocated": 1,
    "qwen3-0.6b-calc-sglang": 2,
    "qwen3-1.7b-calc-sglang": 4,
    "qwen3-8b-calc-sglang": 8,
}


def test_every_shipped_recipe_loads_and_gpu_recipes_reserve_what_docs_say():
    for name in recipe_names():
        recipe = load_recipe(name)
        b, s = recipe.train.backend, recipe.rollout.engine
        if name not in GPU_TOTALS:  # the CPU recipes stay on the embedded engine and CPU
            assert s.type == "embedded" and b.type == "torch" and b.gpus == 0
            continue
        assert isinstance(s, SGLangEngineConfig) and s.launcher == "sglang"
        assert isinstance(b, MegatronBackendConfig)
        total = b.gpus + recipe.rollout.workers * s.gpus
        assert total == GPU_TOTALS[name], name
        assert b.gpus == b.tp * b.pp * b.dp or (b.gpus < 1 and b.tp * b.pp * b.dp == 1), name
        assert s.gpus >= s.tp_size or (s.gpus < 1 and s.tp_size == 1), name
    assert set(GPU_TOTALS) < set(recipe_names())


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("lora", [[], ["train.lora.rank=4", "train.max_staleness=0"]], ids=["full", "lora"])
def test_a_ray_run_with_an_sglang_engine_trains_and_logs_the_server(tiny_dir, tmp_path, lora):
    """The whole controller with ``rollout.engine = "sglang"``: Ray actors, one supervised server.
    With LoRA (adapter-only updates through the server's LoRA API) and ``max_staleness = 0``,
    every step trains on samples of the trainer's current adapter: the trainer's logprobs match
    the server's at every step only if the server sampled with each adapter exactly."""
    from loong_core.telemetry import read_metrics
    from loong_train.controller import run

    sets = [f"model.path={tiny_dir}", "rollout.engine.type=sglang",
            f"rollout.engine.port_base={server_port(2)}", "train.steps=3", "train.batch_groups=2",
            "rollout.group_size=4", "rollout.max_new_tokens=16", "rollout.max_model_tokens=32",
            "eval.every=100", "eval.num_tasks=4", *lora]  # fmt: skip
    out = run(load_recipe("tiny-calc-agent", sets), tmp_path / "run", tmp_path / "cache")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert rows[0]["mismatch_kl"] < 1e-9  # the servers generated with the trainer's initial weights
    if lora:
        assert all(r["mismatch_kl"] < 1e-9 and r["staleness_max"] == 0 for r in rows), rows
    log = (out / "logs" / "sglang-0.log").read_text()
    assert log.count("=== loong: launch") == 1 and "serve-sglang:" in log


@pytest.mark.slow
@pytest.mark.integration
def test_a_ray_run_with_direct_weights_into_two_servers(tiny_dir, tmp_path):
    """The controller with ``weights = "direct"``: two workers and servers, the trainer pushing
    into both. Synchronous (``max_staleness = 0``), so every step trains on samples the servers
    generated at the trainer's current version: the trainer's recomputed logprobs match theirs
    at every step only if both servers held the trainer's weights exactly."""
    from loong_core.telemetry import read_metrics
    from loong_train.controller import run

    sets = [f"model.path={tiny_dir}", "rollout.engine.type=sglang", "rollout.engine.weights=direct",
            f"rollout.engine.port_base={server_port(2)}", "rollout.workers=2", "train.max_staleness=0",
            "train.steps=3", "train.batch_groups=2", "rollout.group_size=4", "rollout.max_new_tokens=16",
            "rollout.max_model_tokens=32", "eval.every=100", "eval.num_tasks=4"]  # fmt: skip
    out = run(load_recipe("tiny-calc-agent", sets), tmp_path / "run", tmp_path / "cache")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert all(r["mismatch_kl"] < 1e-9 and r["staleness_max"] == 0 for r in rows), rows
    for i in range(2):
        assert (out / "logs" / f"sglang-{i}.log").read_text().count("=== loong: launch") == 1
