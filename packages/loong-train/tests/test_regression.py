"""Behaviour pinned bit for bit: ``tiny-calc-agent`` at ``max_staleness = 0``, seed 0, 10 steps.

A synchronous run with a fixed seed is deterministic on one machine, so any change to what the
pipeline computes (which prompts it draws, what it samples, how it packs, the loss, the optimizer,
the weight sync) shows as a difference in its metrics, its ledger or its final weights. Restructures
must reproduce the fixture exactly; a change that means to alter behaviour re-records it and says so.

Record (writes ``fixtures/regression/tiny_calc_agent_sync10-<platform>.json``)::

    LOONG_RECORD_REGRESSION=1 uv run pytest packages/loong-train/tests/test_regression.py -m slow

Floating point depends on the CPU's kernels and the torch build: two Xeons with the same ISA level
can pick different matrix kernels for the model's shapes. So each fixture is recorded for one
platform fingerprint (torch's version, its CPU capability, and a hash of the tiny model's own
forward, backward and cached decode step on one thread, the shapes the run computes), and the test
checks the fixture of the platform it runs on; where none was recorded it skips and says so.
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
from loong_train.models.decoder import CausalLM, DecoderConfig, KVCache

FIXTURES = Path(__file__).parent / "fixtures" / "regression"
OVERRIDES = ["train.max_staleness=0", "train.steps=10", "seed=0"]
# wall-clock fields differ run to run, and so does how requests share decode steps (the engine's
# loop admits what arrived while a step ran)
TIMING = ("_s", "_per_s", "_frac", "_start", "_end", "_per_step")


def platform_fingerprint() -> str:
    """torch's version and CPU capability plus a hash of the recipe's model computing on one thread:
    a training forward and backward and a cached decode step, from a fixed random init."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the run's actors (threads = 1)
    try:
        m = load_recipe("tiny-calc-agent").model
        sizes = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
        cfg = DecoderConfig(vocab_size=101, **{k: getattr(m, k) for k in sizes})
        model = CausalLM(cfg)
        model.init_weights(0)
        ids = torch.randint(0, cfg.vocab_size, (16, 96), generator=torch.Generator().manual_seed(0))
        logits = model(ids)
        logits.float().log_softmax(-1).mean().backward()
        with torch.no_grad():
            cache = KVCache(cfg, 16, 128, torch.float32, "cpu")
            mask = torch.ones(16, 1, 32, 32, dtype=torch.bool).tril()
            model(ids[:, :32], mask=mask, cache=cache)
            step = model(
                ids[:, 32:33],
                positions=torch.full((16, 1), 32),
                mask=torch.ones(16, 1, 1, 33, dtype=torch.bool),
                cache=cache,
                start=32,
            )
    finally:
        torch.set_num_threads(threads)
    digest = hashlib.sha256()
    for t in (logits.detach(), step, *(p.grad for p in model.parameters())):
        digest.update(t.contiguous().numpy().tobytes())
    return f"{torch.__version__}-{torch.backends.cpu.get_cpu_capability()}-{digest.hexdigest()[:12]}"


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
    platform = platform_fingerprint()
    fixture = FIXTURES / f"tiny_calc_agent_sync10-{platform}.json"
    recording = bool(os.environ.get("LOONG_RECORD_REGRESSION"))
    if not recording and not fixture.exists():
        recorded = sorted(p.stem.split("-", 1)[1] for p in FIXTURES.glob("*.json"))
        pytest.skip(f"no fixture for platform {platform} (recorded: {recorded}): record one on this machine")
    got = {"platform": platform, **fingerprint(run(recipe, tmp_path / "run", tiny_cache))}
    if recording:
        FIXTURES.mkdir(exist_ok=True)
        fixture.write_text(_dump(got))
        return
    want = json.loads(fixture.read_text())
    assert len(got["metrics"]) == 10
    for step, (a, b) in enumerate(zip(got["metrics"], want["metrics"], strict=True), start=1):
        assert a == b, f"step {step} metrics differ"
    assert got["ledger"] == want["ledger"]
    assert got["eval_reward_by_version"] == want["eval_reward_by_version"]
    assert got["weights"] == want["weights"]
