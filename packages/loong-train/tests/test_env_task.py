"""``task = "env"``: a user's multi-turn environment on the rows of ``[data]``. Bad classes and
arguments are errors before training; the shipped example (examples/shop, an environment with a
tool) runs end to end from a copy of its directory, its episodes and its warm-start demonstrations
decode to exactly the chat template's rendering of the transcript."""

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loong_agentflow import EpisodeLimits, EpisodeSpec, run_episodes
from loong_core.config import ConfigError
from loong_core.protocols import SamplingParams
from loong_train.tasks import TaskTables, build_task
from loong_train.tasks.config import DataConfig, EnvConfig, RewardConfig

EXAMPLE = Path(__file__).parents[3] / "examples" / "shop"


def _tables(**env):
    data = DataConfig(train_files=[str(EXAMPLE / "data.jsonl")])
    return TaskTables(data=data, environment=EnvConfig(**env))


@pytest.mark.parametrize(
    ("env", "reward", "error"),
    [
        ({}, "", r"needs environment\.cls"),
        ({"cls": f"{EXAMPLE / 'env.py'}:Nope"}, "", r"has no function or class 'Nope'"),
        ({"cls": "no_such_module_xyz:Env"}, "", r"importing no_such_module_xyz failed"),
        ({"cls": f"{EXAMPLE / 'env.py'}:Shop", "kwargs": {"width": 3}}, "", r"do not fit .*unexpected keyword argument 'width'"),
        ({"cls": f"{EXAMPLE / 'env.py'}:Shop"}, "r.py:f", r"drop reward\.fn"),
    ],
)  # fmt: skip
def test_bad_environments_are_errors_before_training(env, reward, error):
    tables = _tables(**env)
    tables = TaskTables(data=tables.data, environment=tables.environment, reward=RewardConfig(fn=reward))
    with pytest.raises(ConfigError, match=error):
        build_task("env", tables)


class _Echo:
    """An engine that answers every turn with the next of ``replies`` (a real RolloutEngine)."""

    def __init__(self, codec, replies):
        self.codec, self.replies, self.weight_version = codec, list(replies), 0

    async def generate(self, input_ids, sampling):
        from loong_core.records import SpanSource, TokenSpan

        ids = self.codec.encode(self.replies.pop(0) + "<|im_end|>")
        return TokenSpan(token_ids=ids, source=SpanSource.MODEL, logprobs=[-0.5] * len(ids), weight_version=0)

    def pause(self):
        pass

    def resume(self):
        pass


def _call(item: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'stock', 'arguments': {'item': item}})}</tool_call>"


def _tool_call(item: str) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "stock", "arguments": {"item": item}}}],
    }


def test_an_example_episode_and_its_demonstration_decode_to_the_chat_templates_transcript(tmp_path):
    from loong_train.models.tokenizer import HFCodec, load_tokenizer
    from loong_train.tiny.tokenizer import build_tokenizer

    build_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    codec = HFCodec(tokenizer)
    task = build_task("env", _tables(cls=f"{EXAMPLE / 'env.py'}:Shop"))
    item = dict(task.held_out(1)[0])
    row = item["row"]
    count = str(row["shelf"][row["item"]])
    replies = [_call("nope"), _call(row["item"]), count]  # a missing item (a tool error), the item, its count
    engine = _Echo(codec, replies)
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=80, stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")]
    )
    [traj] = asyncio.run(
        run_episodes(
            task.agent(), [EpisodeSpec("e", "g", item)], engine, codec, sampling, EpisodeLimits(4, 256)
        )
    )
    assert traj.reward == 1.0, traj.info
    shelf = ", ".join(row["shelf"])
    question = {"role": "user", "content": f"How many {row['item']} are left?"}
    transcript = [
        question,
        _tool_call("nope"),
        {"role": "tool", "content": f"error: KeyError: \"no 'nope' on this shelf (there are: {shelf})\""},
        _tool_call(row["item"]),
        {"role": "tool", "content": count},
        {"role": "assistant", "content": count},
    ]
    rendered = tokenizer.apply_chat_template(transcript, tokenize=False)
    decoded = tokenizer.decode(traj.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert decoded + "\n" == rendered  # the template closes the last turn with a newline
    # the warm start's demonstration of the row: its expert turns, in the same layout
    pieces = task.demonstration(item)
    expert = [
        question,
        _tool_call(row["item"]),
        {"role": "tool", "content": count},
        {"role": "assistant", "content": count},
    ]
    assert "".join(text for text, _ in pieces) + "\n" == tokenizer.apply_chat_template(expert, tokenize=False)
    assert [text for text, is_model in pieces if is_model] == [
        f"{_call(row['item'])}<|im_end|>",
        f"{count}<|im_end|>",
    ]


def test_demonstrations_that_are_missing_or_do_not_finish_are_errors_naming_the_row(tmp_path):
    rows = [
        {"item": "fig", "shelf": {"fig": 3}},
        {"item": "fig", "shelf": {"fig": 3}, "demonstration": [_call("fig")]},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 5))
    tables = TaskTables(
        data=DataConfig(train_files=[str(tmp_path / "d.jsonl")]),
        environment=EnvConfig(cls=f"{EXAMPLE / 'env.py'}:Shop"),
    )
    task = build_task("env", tables)
    first, second = (next(i for i in task.train + task.eval if i["id"] == f"d.jsonl:{n}") for n in (1, 2))
    with pytest.raises(
        ConfigError, match=r"d\.jsonl:1: the warm start needs the row's expert turns at 'demonstration'"
    ):
        task.demonstration(first)
    with pytest.raises(ConfigError, match=r"d\.jsonl:2: the environment was not done after the 1 turns"):
        task.demonstration(second)


@pytest.mark.integration
def test_the_shop_example_trains_from_a_copy_of_its_directory(tmp_path):
    work = tmp_path / "shop"
    shutil.copytree(EXAMPLE, work)
    sets = [
        "train.steps=2",
        "train.batch_groups=2",
        "rollout.group_size=2",
        "eval.every=1",
        "eval.num_tasks=4",
        "warmstart.steps=2",  # the warm start on the rows' expert turns runs; a real one is longer
        "warmstart.eval_every=2",
        "warmstart.eval_tasks=4",
    ]
    cmd = [sys.executable, "-m", "loong_train.cli", "run", "recipe.toml", "--cache", "cache"]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (work / "runs" / "shop" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["failed"] == 0 for r in rows)
    assert all(0 <= r["reward_mean"] <= 1 for r in rows)


def _skyrl_rows(tmp_path, n=10):
    """SkyRL's gsm8k rows as its own dataset script writes them, in a parquet file (verl's format)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {k} + 3? Answer as '#### N'."}],
            "env_class": "gsm8k_multi_turn",
            "reward_spec": {"method": "rule", "ground_truth": str(k + 3)},
            "extra_info": {"max_turns": 2, "index": k},
        }
        for k in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    return tmp_path / "train.parquet"


def test_a_skyrl_gym_environment_runs_unchanged_on_its_own_rows_and_stays_token_exact(tmp_path):
    """SkyRL-gym's own multi-turn GSM8k env (per-turn rewards: 0.2 / max_turns for a well-formatted
    wrong answer, 1 for the right one) on SkyRL-shaped rows read from parquet."""
    from loong_train.models.tokenizer import HFCodec, load_tokenizer
    from loong_train.tiny.tokenizer import build_tokenizer

    build_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    codec = HFCodec(tokenizer)
    tables = TaskTables(
        data=DataConfig(train_files=[str(_skyrl_rows(tmp_path))]),
        environment=EnvConfig(cls="skyrl_gym.envs.gsm8k.multi_turn_env:GSM8kMultiTurnEnv", api="skyrl"),
    )
    task = build_task("env", tables)
    item = dict(task.held_out(1)[0])
    assert item["id"].startswith("train.parquet:")
    row = item["row"]
    right = row["reward_spec"]["ground_truth"]
    wrong = str(int(right) + 1)
    engine = _Echo(codec, [f"#### {wrong}", f"#### {right}"])
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=40, stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")]
    )
    [traj] = asyncio.run(
        run_episodes(
            task.agent(), [EpisodeSpec("e", "g", item)], engine, codec, sampling, EpisodeLimits(4, 400)
        )
    )
    assert traj.reward == pytest.approx(0.2 / 2 + 1.0), traj.info
    transcript = [
        *row["prompt"],
        {"role": "assistant", "content": f"#### {wrong}"},
        {
            "role": "user",
            "content": "Now provide only the final numeric answer in the exact format: '#### ANSWER'.",
        },
        {"role": "assistant", "content": f"#### {right}"},
    ]
    decoded = tokenizer.decode(traj.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert decoded + "\n" == tokenizer.apply_chat_template(transcript, tokenize=False)
    model_text = codec.decode([t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m])
    assert model_text == f"#### {wrong}<|im_end|>#### {right}<|im_end|>"


def test_skyrl_constructor_mismatch_is_an_error_before_training(tmp_path):
    tables = TaskTables(
        data=DataConfig(train_files=[str(_skyrl_rows(tmp_path))]),
        environment=EnvConfig(cls=f"{EXAMPLE / 'env.py'}:Shop", api="skyrl"),
    )
    with pytest.raises(ConfigError, match=r"builds .*Shop as cls\(env_config=\.\.\., extras=row\)"):
        build_task("env", tables)
