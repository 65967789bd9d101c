"""Behaviour pinned bit for bit: ``tiny-calc-agent`` at ``max_staleness = 0``, seed 0, 10 steps.

A synchronous run with a fixed seed is deterministic on one machine, so any change to what the
pipeline computes (which prompts it draws, what it samples, how it packs, the loss, the optimizer,
the weight sync) shows as a difference in its metrics, its ledger or its final weights. Restructures
must reproduce the fixture exactly; a change that means to alter behaviour re-records it and says so.

Record (writes ``fixtures/tiny_calc_agent_sync10.json``)::

    LOONG_RECORD_REGRESSION=1 uv run pytest packages/loong-train/tests/test_regression.py -m slow

Floating point depends on the CPU's kernels and the torch build, so the fixture carries a platform
fingerprint (torch's version and a hash of a fixed forward pass of a tiny model); on a platform
whose fingerprint differs the test skips with that reason instead of failing on arithmetic noise.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loong_core.telemetry import read_metrics
from loong_train.config import load_recipe
from loong_train.controller import run

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_calc_agent_sync10.json"
OVERRIDES = ["train.max_staleness=0", "train.steps=10", "seed=0"]
# wall-clock fields differ run to run, and so does how requests share decode steps (the engine's
# loop admits what arrived while a step ran)
TIMING = ("_s", "_per_s", "_frac", "_start", "_end", "_per_step")


def platform_fingerprint() -> str:
    """torch's version plus a hash of a fixed forward pass (matmul, softmax, RMS norm kernels)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=gen)
    w = torch.randn(64, 64, generator=gen)
    y = torch.softmax(x @ w, -1) * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    return f"{torch.__version__}:{hashlib.sha256(y.numpy().tobytes()).hexdigest()[:16]}"


def weight_hashes(path: Path) -> dict[str, str]:
    """sha256 of every tensor's bytes (name -> hash): equal hashes mean bit-identical weights."""
    tensors = load_file(str(path))
    return {
        k: hashlib.sha256(v.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in sorted(tensors.items())
    }


def fingerprint(out: Path) -> dict:
    """What a run computed: metrics without timing fields, the ledger, eval results, final weights."""
    metrics = [
        {k: v for k, v in row.items() if not k.endswith(TIMING)}
        for row in read_metrics(out / "metrics.jsonl")
    ]
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {
        "metrics": metrics,
        "ledger": ledger,
        "eval_reward_by_version": summary["eval_reward_by_version"],
        "weights": weight_hashes(out / "checkpoints" / "final" / "model.safetensors"),
    }


def _dump(record: dict) -> str:
    """JSON with one line per step, so a re-recorded fixture diffs step by step."""
    parts = []
    for key, value in sorted(record.items()):
        if isinstance(value, list):
            rows = ",\n  ".join(json.dumps(v, sort_keys=True) for v in value)
            parts.append(f"{json.dumps(key)}: [\n  {rows}\n ]")
        else:
            parts.append(f"{json.dumps(key)}: {json.dumps(value, indent=None, sort_keys=True)}")
    return "{\n " + ",\n ".join(parts) + "\n}\n"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.xdist_group("tiny-calc-warm-start")  # with the learning test: one warm start for both
def test_sync_run_reproduces_the_recorded_fixture(tmp_path, tiny_cache):
    recipe = load_recipe("tiny-calc-agent", OVERRIDES)
    got = {"platform": platform_fingerprint(), **fingerprint(run(recipe, tmp_path / "run", tiny_cache))}
    if os.environ.get("LOONG_RECORD_REGRESSION"):
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(_dump(got))
        return
    want = json.loads(FIXTURE.read_text())
    if want["platform"] != got["platform"]:
        pytest.skip(f"fixture recorded on platform {want['platform']}, this is {got['platform']}: re-record")
    assert len(got["metrics"]) == 10
    for step, (a, b) in enumerate(zip(got["metrics"], want["metrics"], strict=True), start=1):
        assert a == b, f"step {step} metrics differ"
    assert got["ledger"] == want["ledger"]
    assert got["eval_reward_by_version"] == want["eval_reward_by_version"]
    assert got["weights"] == want["weights"]
