"""DAPO's dynamic sampling (``[loss] dynamic_sampling``): which groups carry no signal, the bad
configurations, and real Ray runs whose ledger shows dropped groups replaced by others, within
the staleness bound and with no sample trained twice. The window's property tests with dropping
are in loong-core's ``tests/test_window.py``."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch

from loong_core.config import ConfigError
from loong_core.records import EpisodeStatus, SpanSource, TokenSpan, Trajectory
from loong_core.window import StalenessWindow
from loong_train.algo.losses import advantages, no_signal
from loong_train.config import load_recipe
from loong_train.controller import run
from loong_train.models.decoder import CausalLM
from loong_train.models.tokenizer import copy_model_files, load_tokenizer
from loong_train.scheduler import replay


def _row(sample: str, reward: float, status: str = "ok", episode: str | None = None) -> Trajectory:
    spans = [
        TokenSpan(token_ids=[1, 2], source=SpanSource.PROMPT),
        TokenSpan(token_ids=[3], source=SpanSource.MODEL, logprobs=[-0.5], weight_version=0),
    ]
    info = {"episode": episode} if episode else {}
    return Trajectory(
        sample_id=sample, group_id="g", spans=spans, reward=reward, status=EpisodeStatus(status), info=info
    )


@pytest.mark.parametrize(
    ("group", "dropped"),
    [
        ([_row("a", 1.0), _row("b", 1.0)], True),
        ([_row("a", 0.0), _row("b", 1.0)], False),
        ([_row("a", 1.0), _row("b", 0.0, "failed")], True),  # a failed episode is not in the statistics
        ([_row("a#0", 1.0, episode="a"), _row("a#1", 1.0, episode="a"), _row("b", 1.0)], True),
        ([_row("a", 0.0, "failed"), _row("b", 0.0, "timeout")], True),
    ],
)
def test_a_group_without_signal_is_one_whose_advantages_are_all_zero(group, dropped):
    assert no_signal(group) is dropped
    for estimator in ("grpo", "rloo"):
        zero = all(
            a == 0
            for a in advantages(group, load_recipe("tiny-calc-agent", [f"loss.estimator={estimator!r}"]).loss)
        )
        assert zero is dropped


@pytest.mark.parametrize(
    ("sets", "error"),
    [
        (
            ["loss.dynamic_sampling=true", 'loss.estimator="reinforce++"'],
            "dynamic_sampling needs estimator = 'grpo' or 'rloo', got estimator = 'reinforce++'",
        ),
        (["loss.dynamic_sampling=true", "loss.dynamic_sampling_max_rounds=0"], "dynamic_sampling_max_rounds"),
    ],
)
def test_options_that_do_not_compose_are_errors_naming_both(sets, error):
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace("+", r"\+")):
        load_recipe("tiny-calc-agent", sets)


REWARD = "def score(completion):\n    return float(len(completion) % 3 == 0)\n"


@pytest.fixture
def stopping_model(tiny_dir, tmp_path):
    """The tiny random model, untied, with an output layer that gives every token logit 0 but
    the end-of-turn token's, about 2 on a typical hidden state: episodes end after a few tokens,
    or run to the limit, so their lengths (hence the test's rewards) vary within a group."""
    tied = CausalLM.from_pretrained(tiny_dir)
    model = CausalLM(dataclasses.replace(tied.config, tie_word_embeddings=False))
    model.load_state_dict(tied.state_dict(), strict=False)
    tokenizer = load_tokenizer(tiny_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hidden = []
    hook = model.model.norm.register_forward_hook(lambda module, args, out: hidden.append(out))
    with torch.no_grad():
        model(
            torch.tensor([tokenizer.encode("<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\nab 12")])
        )
        hook.remove()
        typical = hidden[0][0].mean(0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[end] = 2 * typical / typical.norm() ** 2
    path = tmp_path / "stopping"
    model.save_pretrained(path)
    copy_model_files(tiny_dir, path)
    return path


def _sets(model, tmp_path, window: int, *extra: str) -> list[str]:
    (tmp_path / "data.jsonl").write_text(
        "".join(json.dumps({"prompt": f"q{i}", "answer": "x"}) + "\n" for i in range(40))
    )
    (tmp_path / "reward.py").write_text(REWARD)
    return [
        "task=data",
        f'data.train_files=["{tmp_path / "data.jsonl"}"]',
        f'reward.fn="{tmp_path / "reward.py"}:score"',
        f'model.path="{model}"',
        "warmstart.steps=0",
        "train.steps=3",
        "train.batch_groups=2",
        f"train.max_staleness={window}",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.max_model_tokens=64",
        "eval.every=100",
        "eval.num_tasks=2",
        "loss.dynamic_sampling=true",
        *extra,
    ]


@pytest.mark.integration
def test_a_run_drops_groups_without_signal_and_trains_others_in_their_place(stopping_model, tmp_path):
    """max_staleness 2 (the widest window: most groups in flight): dropped groups are in the
    ledger and the metrics, never trained; every trained sample once, staleness <= 2, and the
    recorded scheduling replays call for call."""
    recipe = load_recipe("tiny-calc-agent", _sets(stopping_model, tmp_path, 2))
    out = run(recipe, tmp_path / "run", tmp_path / "cache")
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    dropped = [g for line in ledger for g in line["dropped"]]
    trained = [g for line in ledger for g in line["groups"]]
    samples = [s for line in ledger for s in line["sample_ids"]]
    assert dropped, "no group was dropped: the reward no longer varies as this test needs"
    assert [m["dropped_groups"] for m in metrics] == [len(line["dropped"]) for line in ledger]
    assert len(trained) == len(set(trained)) == 3 * 2 and not set(trained) & set(dropped)
    assert len(samples) == len(set(samples)) == 3 * 2 * 2
    assert all(m["staleness_max"] <= 2 for m in metrics)
    journal = [json.loads(line) for line in (out / "scheduler.jsonl").read_text().splitlines()]
    assert {e["group"] for e in journal if e["call"] == "finish" and e.get("drop")} >= set(dropped)
    assert replay(journal, StalenessWindow(2, 2), steps=3) == journal


@pytest.mark.integration
def test_a_run_whose_groups_all_lack_signal_finishes_early(tiny_dir, tmp_path):
    """The untrained model never answers the calc questions: every group scores 0 and is
    dropped, and after ``max_rounds * batch_groups`` of them the run finishes as a run does (the
    last version evaluated, the final checkpoint, the summary saying why), instead of raising."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    sets = _sets(model, tmp_path, 0, "loss.dynamic_sampling_max_rounds=2")
    sets = [s for s in sets if not s.startswith(("task=", "data.", "reward."))]
    out = run(load_recipe("tiny-calc-agent", sets), tmp_path / "run", tmp_path / "cache")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 0 < 3  # no step trained; the recipe asked for 3
    assert re.search(r"dropped \d+ groups in a row .*remaining prompts are solved", summary["stopped"])
    assert set(summary["eval_reward_by_version"]) == {"0"}
    assert (out / "checkpoints" / "final" / "model.safetensors").exists()
    assert (out / "ledger.jsonl").read_text() == ""  # nothing trained
