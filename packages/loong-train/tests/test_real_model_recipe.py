"""The real-model recipe (``smollm2-arithmetic``) end to end on a tiny stand-in: a Llama GGUF file
with a byte-level BPE and a chat template that adds a default system prompt, as SmolLM2's does.
SmolLM2-135M-Instruct itself trains in the documented command (docs/real-model.md), not here."""

import json

import pytest
import torch
from gguf_testkit import tiny_llama_gguf

from loong_core.telemetry import read_metrics
from loong_train.config import load_recipe
from loong_train.controller import run
from loong_train.models.auto import load_causal_lm
from loong_train.tasks import build_task

# SmolLM2-Instruct's layout: ChatML, and a system turn of its own when the conversation has none
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny helpful model<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SMALL = [
    "train.steps=2",
    "train.batch_groups=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "rollout.max_model_tokens=64",
    "eval.every=2",
    "eval.num_tasks=4",
    "train.checkpoint_every=1",
    "loss.kl_coef=0.5",  # an untrained stand-in earns no reward: the k1 KL term still moves the weights
    "loss.kl_estimator=k1",
    "rollout.engine.dtype=float32",  # step 1's mismatch is float rounding on any CPU ('auto': bfloat16 on some)
]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    task = build_task("arithmetic")
    texts = [item["messages"][0]["content"] + f" {item['answer']}" for item in task.held_out(200)]
    return tiny_llama_gguf(
        tmp_path_factory.mktemp("stand-in"), [*texts, "You are a tiny helpful model"], TEMPLATE
    )


@pytest.mark.integration
def test_the_recipe_trains_a_gguf_model_checkpoints_it_and_resumes(stand_in, tmp_path):
    from transformers import LlamaForCausalLM

    overrides = [f'model.path="{stand_in["path"]}"', *SMALL]
    out = run(load_recipe("smollm2-arithmetic", overrides), tmp_path / "run", tmp_path / "cache")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["mismatch_kl"] < 1e-9  # the engine served the converted weights the trainer holds
    (converted,) = (tmp_path / "cache" / "gguf").iterdir()

    final = out / "checkpoints" / "final"
    ids = torch.tensor([stand_in["tokenizer"].encode("What is 3+4? 7")])
    with torch.no_grad():
        theirs = LlamaForCausalLM.from_pretrained(final, dtype=torch.float32).eval()(ids).logits
        ours = load_causal_lm(final)(ids).float()
        start = load_causal_lm(converted)(ids).float()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert (ours - start).abs().max() > 1e-4  # the checkpoint holds the trained weights, not the start
    assert "You are a tiny helpful model" in (final / "chat_template.jinja").read_text()
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == stand_in[
        "tokenizer"
    ].convert_tokens_to_ids("<|im_end|>")

    resumed = run(
        load_recipe("smollm2-arithmetic", [*overrides, "train.steps=3"]), out, tmp_path / "cache", True
    )
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.integration
def test_a_black_box_agent_on_the_gguf_model_trains_token_exact(stand_in, tmp_path):
    """Episodes of an openai-SDK program through the proxy, which renders each call with the
    model's own template: every episode is recorded and trains on the tokens the engine sampled
    (step 1's mismatch KL is float rounding)."""
    import sys

    agent = [
        "agent.type=blackbox",
        f'agent.command=["{sys.executable}", "-m", "loong_train.tiny.calc_agent"]',
        'agent.preload=["openai"]',
        "train.borrow_idle_threads=false",  # an agent program runs on the worker's cores
    ]
    overrides = [f'model.path="{stand_in["path"]}"', *SMALL, *agent, "train.steps=1", "eval.every=1"]
    out = run(load_recipe("smollm2-arithmetic", overrides), tmp_path / "run", tmp_path / "cache")
    (row,) = read_metrics(out / "metrics.jsonl")
    assert row["samples"] == 4 and row["failed"] == 0
    assert row["mismatch_kl"] < 1e-9
