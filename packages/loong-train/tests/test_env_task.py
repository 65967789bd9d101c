"""``task = "env"``: a user's multi-turn environment on the rows of ``[data]``. Bad classes and
arguments are errors before training; the shipped example (examples/guess-number) runs end to end
from a copy of its directory, and its episodes decode to the environment's transcript."""

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
from loong_train.tasks.data import DataConfig
from loong_train.tasks.env import EnvConfig
from loong_train.tasks.reward import RewardConfig

EXAMPLE = Path(__file__).parents[3] / "examples" / "guess-number"


def _tables(**env):
    data = DataConfig(train_files=[str(EXAMPLE / "data.jsonl")])
    return TaskTables(data=data, environment=EnvConfig(**env))


@pytest.mark.parametrize(
    ("env", "reward", "error"),
    [
        ({}, "", r"needs environment\.cls"),
        ({"cls": f"{EXAMPLE / 'env.py'}:Nope"}, "", r"has no function or class 'Nope'"),
        ({"cls": "no_such_module_xyz:Env"}, "", r"importing no_such_module_xyz failed"),
        ({"cls": f"{EXAMPLE / 'env.py'}:GuessNumber", "kwargs": {"width": 3}}, "", r"do not fit .*unexpected keyword argument 'width'"),
        ({"cls": f"{EXAMPLE / 'env.py'}:GuessNumber"}, "r.py:f", r"drop reward\.fn"),
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
        return TokenSpan(token_ids=ids, source=SpanSource.MODEL, logprobs=[-0.5] * len(ids))

    def pause(self):
        pass

    def resume(self):
        pass


def test_an_example_episode_decodes_to_the_environments_transcript(tmp_path):
    from loong_train.models.tokenizer import HFCodec, load_tokenizer
    from loong_train.tiny.tokenizer import build_tokenizer

    build_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    codec = HFCodec(tokenizer)
    task = build_task("env", _tables(cls=f"{EXAMPLE / 'env.py'}:GuessNumber"))
    item = dict(task.held_out(1)[0])
    secret = item["row"]["secret"]
    replies = ["x", "9" if secret < 9 else "1", str(secret)]  # not a number, wrong, right
    engine = _Echo(codec, replies)
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=8, stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")]
    )
    [traj] = asyncio.run(
        run_episodes(
            task.agent(), [EpisodeSpec("e", "g", item)], engine, codec, sampling, EpisodeLimits(4, 64)
        )
    )
    assert traj.reward == 1.0, traj.info
    hint = "higher" if int(replies[1]) < secret else "lower"
    transcript = [
        {"role": "user", "content": "Guess my number from 1 to 9. Answer with the number only."},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "Answer with a number only."},
        {"role": "assistant", "content": replies[1]},
        {"role": "user", "content": hint},
        {"role": "assistant", "content": replies[2]},
    ]
    rendered = tokenizer.apply_chat_template(transcript, tokenize=False)
    decoded = tokenizer.decode(traj.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert decoded + "\n" == rendered  # the template closes the last turn with a newline


@pytest.mark.integration
def test_the_guess_number_example_trains_from_a_copy_of_its_directory(tmp_path):
    work = tmp_path / "guess-number"
    shutil.copytree(EXAMPLE, work)
    sets = [
        "train.steps=2",
        "train.batch_groups=2",
        "rollout.group_size=2",
        "eval.every=1",
        "eval.num_tasks=4",
    ]
    cmd = [sys.executable, "-m", "loong_train.cli", "run", "recipe.toml", "--cache", "cache"]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        json.loads(line)
        for line in (work / "runs" / "guess-number" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2] and all(r["failed"] == 0 for r in rows)
    assert all(0 <= r["reward_mean"] <= 1 for r in rows)
