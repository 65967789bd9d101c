"""``task = "data"``: the user's rows and reward function. Unit tests of the rows, the split, the
reward binding and every bad input, then one real run started from a user's own directory."""

import itertools
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loong_core.config import ConfigError
from loong_train.config import load_recipe
from loong_train.tasks import TaskTables, build_task
from loong_train.tasks.config import DataConfig, RewardConfig
from loong_train.tasks.data import DataTask
from loong_train.tasks.reward import load_reward

ROWS = [{"prompt": f"what is {i}+1?", "answer": str(i + 1), "metadata": {"n": i}} for i in range(20)]


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def data(tmp_path):
    return _write(tmp_path / "data.jsonl", ROWS)


def test_rows_become_items_and_the_split_is_disjoint_and_seeded(data):
    task = DataTask(DataConfig(train_files=[str(data)], eval_fraction=0.25, split_seed=3), RewardConfig())
    again = DataTask(DataConfig(train_files=[str(data)], eval_fraction=0.25, split_seed=3), RewardConfig())
    held = task.held_out(100)
    assert len(held) == 5 and held == again.held_out(100)
    assert {i["id"] for i in held}.isdisjoint(i["id"] for i in task.train)
    assert len(task.train) + len(held) == len(ROWS)
    first = held[0]
    assert first["messages"] == [{"role": "user", "content": first["row"]["prompt"]}]
    assert first["answer"] == first["row"]["answer"] and first["metadata"] == first["row"]["metadata"]
    stream = task.train_stream(7, held)
    two_passes = [next(stream)["id"] for _ in range(2 * len(task.train))]
    assert sorted(two_passes[:15]) == sorted(two_passes[15:]) == sorted(i["id"] for i in task.train)
    assert two_passes[:15] != two_passes[15:]  # reshuffled each pass
    assert (
        task.reward(first, f" {first['answer']} ") == 1.0 and task.reward(first, "no") == 0.0
    )  # exact match


def test_verl_and_chat_rows_and_eval_files(tmp_path):
    verl = [{"prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"ground_truth": "4"}}] * 3
    train, held = _write(tmp_path / "t.jsonl", verl), tmp_path / "e.json"
    held.write_text(json.dumps(verl[:1]))
    config = DataConfig(
        train_files=[str(train)],
        eval_files=[str(held)],
        answer_key="reward_model.ground_truth",
        system_prompt="Be brief.",
    )
    task = DataTask(config, RewardConfig())
    assert len(task.train) == 3 and [i["id"] for i in task.held_out(8)] == ["e.json:0"]
    item = task.held_out(1)[0]
    assert item["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    ]
    assert item["answer"] == "4"


def test_verl_parquet_rows_are_read_as_verl_writes_them(tmp_path):
    """verl's preprocessing scripts write parquet through pandas (``df.to_parquet``); the rows,
    nested columns included, come back as they were, with ids counted from 0."""
    import pandas as pd

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{i}+2?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(6)
    ]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    config = DataConfig(train_files=[str(tmp_path / "train.parquet")], answer_key="reward_model.ground_truth")
    task = DataTask(config, RewardConfig())
    items = sorted(task.train + task.held_out(8), key=lambda i: int(i["id"].split(":")[1]))
    assert [i["id"] for i in items] == [f"train.parquet:{k}" for k in range(6)]
    assert [i["row"] for i in items] == rows
    assert items[3]["messages"] == rows[3]["prompt"] and items[3]["answer"] == "5"
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"bad\.parquet: not a readable parquet file"):
        DataTask(DataConfig(train_files=[str(tmp_path / "bad.parquet")]), RewardConfig())


def test_a_reward_gets_what_it_names_sync_or_async(tmp_path, data):
    (tmp_path / "rw.py").write_text(
        textwrap.dedent("""
        async def score(completion, answer, prompt, messages, metadata, row):
            assert messages[-1] == {"role": "assistant", "content": completion}
            assert prompt == row["prompt"] and metadata == row["metadata"]
            return {"score": float(completion == answer), "length": len(completion)}
        """)
    )
    fn = load_reward(RewardConfig(fn=f"{tmp_path / 'rw.py'}:score"), tmp_path)
    task = DataTask(DataConfig(train_files=[str(data)]), RewardConfig(fn=f"{tmp_path / 'rw.py'}:score"))
    item = task.held_out(1)[0]
    assert fn.names == ("completion", "answer", "prompt", "messages", "metadata", "row")
    assert task.reward(item, item["answer"]) == 1.0 and task.reward(item, "x") == 0.0
    # the dict's other numbers ride along as the episode's metrics (reward/length in the run's)
    assert task.reward(item, "xyz").metrics == {"length": 3.0}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("def score(completion):\n    raise KeyError('boom')", "boom"),
        ("def score(completion):\n    return float('nan')", r"returned nan, expected a finite number"),
        ("def score(completion):\n    return 'high'", r"returned 'high'"),
        ("def score(completion):\n    return {'value': 1}", r"returned \{'value': 1\}"),
        ("import time\ndef score(completion):\n    time.sleep(5)", r"ran past 0\.2s"),
    ],
)
def test_a_reward_that_fails_raises_for_its_episode_only(tmp_path, data, body, error):
    (tmp_path / "rw.py").write_text(body)
    task = DataTask(
        DataConfig(train_files=[str(data)]), RewardConfig(fn=f"{tmp_path / 'rw.py'}:score", timeout_s=0.2)
    )
    with pytest.raises(Exception, match=error):
        task.reward(task.held_out(1)[0], "1")
    assert math.isfinite(
        DataTask(DataConfig(train_files=[str(data)]), RewardConfig()).reward(task.held_out(1)[0], "1")
    )


@pytest.mark.parametrize(
    ("files", "reward", "error"),
    [
        ({"data.jsonl": None}, "", r"data file .*missing\.jsonl does not exist"),
        ({"data.jsonl": ""}, "", r"data file .*data\.jsonl has no rows"),
        ({"data.jsonl": '{"prompt": "a"}\n{"prompt": \n'}, "", r"data\.jsonl, line 2: not valid JSON"),
        ({"data.jsonl": '{"prompt": "a"}\n{"question": "b"}\n'}, "", r"data\.jsonl:2: the row has no prompt key 'prompt' \(keys: question\)"),
        ({"data.jsonl": '{"prompt": 7}\n'}, "", r"data\.jsonl:1: 'prompt' must be a string or a list of"),
        ({"data.jsonl": '[1]\n'}, "", r"data\.jsonl:1: a row must be a JSON object, got list"),
        ({"data.jsonl": '{"prompt": "a"}\n' * 4, "rw.py": "import nonexistent_module_xyz"}, "rw.py:score", r"importing .*rw\.py failed \(ModuleNotFoundError"),
        ({"data.jsonl": '{"prompt": "a"}\n' * 4}, "nope.py:score", r"file .*nope\.py does not exist"),
        ({"data.jsonl": '{"prompt": "a"}\n' * 4, "rw.py": "x = 1"}, "rw.py:score", r"rw\.py has no function or class 'score'"),
        ({"data.jsonl": '{"prompt": "a"}\n' * 4, "rw.py": "def score(solution_str): ..."}, "rw.py:score", r"parameter 'solution_str' is none of completion, prompt"),
        ({"data.jsonl": '{"prompt": "a"}\n' * 4}, "no_such_pkg_xyz.mod:fn", r"importing no_such_pkg_xyz\.mod failed"),
        ({"data.jsonl": '{"prompt": "a"}\n'}, "", r"hold 1 rows: too few to hold out"),
    ],
)  # fmt: skip
def test_bad_input_is_an_error_naming_the_file_row_or_key(tmp_path, files, reward, error):
    for name, text in files.items():
        if text is not None:
            (tmp_path / name).write_text(text)
    train = "missing.jsonl" if files.get("data.jsonl", "") is None else "data.jsonl"
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ConfigError, match=error):
            build_task(
                "data", TaskTables(data=DataConfig(train_files=[train]), reward=RewardConfig(fn=reward))
            )
    finally:
        os.chdir(old)


def test_recipe_paths_are_made_absolute_and_a_data_task_needs_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = load_recipe("tiny-calc-agent", ["task=data", 'data.train_files=["d.jsonl"]', "reward.fn=rw.py:score"])
    assert r.data.train_files == [str(tmp_path / "d.jsonl")] and r.reward.fn == f"{tmp_path / 'rw.py'}:score"
    with pytest.raises(ConfigError, match=r"needs data\.train_files"):
        build_task("data")


USER_REWARD = """
import json, pathlib

def score(completion, answer, prompt):
    with open(pathlib.Path(__file__).with_name("calls.jsonl"), "a") as f:
        f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\\n")
    if int(answer) % 2 == 0:
        raise ValueError(f"no score for {answer}")
    return {"score": 1.0 if completion else 0.5, "chars": len(completion)}
"""

USER_RECIPE = """
name = "my-task"
task = "data"

[data]
train_files = ["data.jsonl"]
eval_fraction = 0.2

[reward]
fn = "reward.py:score"

[warmstart]
steps = 0

[train]
steps = 2
batch_groups = 2

[rollout]
group_size = 4
max_new_tokens = 48
max_model_tokens = 96

[eval]
every = 1
num_tasks = 4
"""


@pytest.mark.integration
def test_a_users_data_reward_and_recipe_train_from_their_own_directory(tmp_path):
    _write(tmp_path / "data.jsonl", ROWS)
    (tmp_path / "reward.py").write_text(USER_REWARD)
    (tmp_path / "recipe.toml").write_text(USER_RECIPE)
    cmd = [sys.executable, "-m", "loong_train.cli", "run", "recipe.toml", "--cache", "cache"]
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "my-task" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2]
    # an untrained model: finished episodes earn the user's 1.0 or 0.5, truncated ones 0 (exact
    # match would give 0 throughout); each call got a row's own prompt and answer
    assert any(r["reward_mean"] > 0 for r in rows)
    # the reward's other key, a step mean over the episodes that finished (truncated ones are not scored)
    chars = [r["reward/chars"] for r in rows if "reward/chars" in r]
    assert chars and all(c >= 0 for c in chars)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    pairs = {(r["prompt"], r["answer"]) for r in ROWS}
    assert calls and all((c["prompt"], c["answer"]) in pairs for c in calls)
    # the reward raised on the rows whose answer is even: those episodes failed, were
    # counted, and each was logged with its row (line n of data.jsonl holds answer n); the run went on
    raised = {c["answer"] for c in calls if int(c["answer"]) % 2 == 0}
    trained_failures = sum(r["failed"] for r in rows)
    assert raised and trained_failures > 0
    logged = set(re.findall(r"\(row data\.jsonl:(\d+)\) failed: ValueError: no score for (\d+)", done.stderr))
    assert logged and all(line == answer for line, answer in logged)
    assert {answer for _, answer in logged} <= raised


VERL_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "openai/gsm8k" and extra_info == {"index": 3}
    return {"score": float(solution_str.strip() == ground_truth), "acc": 1}
"""
TRL_REWARDS = """
def exact(prompts, completions, answer, **kwargs):
    assert isinstance(prompts[0], list) and kwargs["level"] == [2]
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]

def short(completions, **kwargs):
    return [-float(len(c)) for c in completions]

def unsure(completions, **kwargs):
    return [None]
"""


def test_verl_and_trl_reward_functions_run_unchanged(tmp_path):
    (tmp_path / "verl_rw.py").write_text(VERL_REWARD)
    (tmp_path / "trl_rw.py").write_text(TRL_REWARDS)
    verl_row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "2+2?"}],
        "reward_model": {"ground_truth": "4"},
        "extra_info": {"index": 3},
        "answer": "4",
        "level": 2,
    }
    data = _write(tmp_path / "d.jsonl", [verl_row] * 4)
    config = DataConfig(train_files=[str(data)], answer_key="reward_model.ground_truth")

    def task(fn, style):
        return DataTask(config, RewardConfig(fn=f"{tmp_path / fn}", style=style))

    verl = task("verl_rw.py:compute_score", "verl")
    item = verl.held_out(1)[0]
    assert verl.reward(item, " 4") == 1.0 and verl.reward(item, "5") == 0.0
    trl = task("trl_rw.py:exact", "trl")
    assert trl.reward(item, "4") == 1.0 and trl.reward(item, "44") == 0.0
    text_rows = _write(tmp_path / "t.jsonl", [{"prompt": "hi", "answer": "x"}] * 4)
    short = DataTask(
        DataConfig(train_files=[str(text_rows)]), RewardConfig(fn=f"{tmp_path}/trl_rw.py:short", style="trl")
    )
    assert short.reward(short.held_out(1)[0], "abc") == -3.0  # a text row's completion is text
    with pytest.raises(ValueError, match=r"unsure returned None, expected a finite number"):
        task("trl_rw.py:unsure", "trl").reward(item, "4")
    with pytest.raises(
        ConfigError, match=r"style 'verl' calls it as \(data_source, solution_str, ground_truth"
    ):
        task("trl_rw.py:short", "verl")


def test_the_warm_start_demonstrates_a_rows_answer_and_refuses_a_row_without_one(tmp_path, data):
    from loong_agentflow import ChatML

    task = DataTask(DataConfig(train_files=[str(data)]), RewardConfig())
    item = task.train[0]
    assert task.demonstration(item) == [
        (ChatML.prompt(item["messages"]), False),
        (f"{item['answer']}<|im_end|>", True),
    ]
    rows = _write(tmp_path / "bare.jsonl", [{"prompt": "hi"}] * 4)
    bare = DataTask(DataConfig(train_files=[str(rows)], answer_key="solution"), RewardConfig(fn=""))
    with pytest.raises(ConfigError, match=r"bare\.jsonl:\d: no answer at data\.answer_key 'solution'"):
        bare.demonstration(bare.train[0])


def test_a_cached_warm_start_is_keyed_by_what_the_task_files_hold(tmp_path, data, monkeypatch):
    from loong_train.tiny.warmstart import _file_digests

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.toml").write_text('name = "t"\ntask = "data"\n[data]\ntrain_files = ["data.jsonl"]\n')
    before = _file_digests(load_recipe(str(tmp_path / "recipe.toml")))
    assert list(before) == [str(data)]
    _write(data, ROWS[:-1])  # one row fewer: another warm start
    assert _file_digests(load_recipe(str(tmp_path / "recipe.toml"))) != before


def test_episode_numbers_become_step_means_over_the_episodes_that_carry_them():
    from loong_core.records import SpanSource, TokenSpan, Trajectory
    from loong_train.run.writer import _episode_metrics

    prompt = [TokenSpan(token_ids=[1], source=SpanSource.PROMPT)]
    carried = [{"len": 2.0, "fmt": 1.0}, {"len": 4.0}, {}, {"len": math.nan}]
    trajs = [Trajectory(f"s{i}", "g", prompt, metrics=m) for i, m in enumerate(carried)]
    assert _episode_metrics(trajs) == {"reward/fmt": 1.0, "reward/len": 3.0}  # NaN left out


class _RewardService:
    """A real reward service on loopback: scores exact match, or answers as ``plan`` says
    (one entry per request: an HTTP status, or "hang"), recording every request."""

    def __init__(self, plan=()):
        import http.server
        import threading

        self.plan, self.requests = list(plan), []
        service = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                service.requests.append((dict(self.headers), body))
                step = service.plan.pop(0) if service.plan else 200
                if step == "hang":
                    threading.Event().wait(1.0)
                    return
                if step != 200:
                    self.send_response(step)
                    self.end_headers()
                    self.wfile.write(b"try later" if step >= 500 else b"bad request: no such row")
                    return
                score = float(body["completion"].strip() == body["answer"])
                out = json.dumps({"score": score, "chars": len(body["completion"])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service():
    made = []

    def make(plan=()):
        made.append(_RewardService(plan))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_reward_service_gets_every_parameter_and_its_key(tmp_path, data, service, monkeypatch):
    monkeypatch.setenv("MY_REWARD_KEY", "s3cret")
    svc = service()
    reward = RewardConfig(url=svc.url, api_key_env="MY_REWARD_KEY")
    task = DataTask(DataConfig(train_files=[str(data)]), reward)
    item = task.held_out(1)[0]
    assert task.reward(item, f" {item['answer']}") == 1.0 and task.reward(item, "no") == 0.0
    headers, body = svc.requests[0]
    assert headers["Authorization"] == "Bearer s3cret"
    assert body == {
        "completion": f" {item['answer']}",
        "prompt": item["row"]["prompt"],
        "messages": [*item["messages"], {"role": "assistant", "content": f" {item['answer']}"}],
        "answer": item["answer"],
        "metadata": item["row"]["metadata"],
        "row": item["row"],
    }
    assert task.reward(item, "abc").metrics == {"chars": 3.0}  # other numbers, logged as reward/<key>


def test_a_reward_service_is_retried_on_5xx_and_timeouts_but_not_on_4xx(data, service):
    item = DataTask(DataConfig(train_files=[str(data)]), RewardConfig()).held_out(1)[0]

    def score(plan, **config):
        svc = service(plan)
        task = DataTask(DataConfig(train_files=[str(data)]), RewardConfig(url=svc.url, **config))
        svc.requests.clear()  # building the task sends nothing, but be sure
        return task, svc

    task, svc = score([503])
    assert task.reward(item, item["answer"]) == 1.0 and len(svc.requests) == 2  # retried once
    task, svc = score([400])
    with pytest.raises(RuntimeError, match=r"answered 400: bad request: no such row"):
        task.reward(item, item["answer"])
    assert len(svc.requests) == 1  # a client error is not retried
    task, svc = score(["hang", "hang"], timeout_s=0.2, retries=1)
    with pytest.raises(RuntimeError, match=r"failed 2 times"):
        task.reward(item, item["answer"])
    assert len(svc.requests) == 2
    task, svc = score([503, 503, 503], retries=2)
    with pytest.raises(RuntimeError, match=r"answered 503: try later"):
        task.reward(item, item["answer"])


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"url": "http://127.0.0.1:1/s", "fn": "r.py:f"}, r"set fn .* or url .*, not both"),
        ({"url": "127.0.0.1:1/s"}, r"url must start with http:// or https://"),
        ({"url": "http://127.0.0.1:1/s", "style": "verl"}, r"style 'verl' is for functions"),
        ({"url": "http://127.0.0.1:1/s", "retries": -1}, r"retries must be >= 0"),
        ({"url": "http://127.0.0.1:1/s", "group": True}, r"group = true .*; a url cannot take that"),
        ({"fn": "r.py:f", "style": "verl", "group": True}, r"style 'verl' \(one sample per call\)"),
        ({"group": True}, r"group = true calls a function once per group: set fn"),
    ],
)
def test_bad_reward_service_settings_are_errors(config, error):
    with pytest.raises(ValueError, match=error):
        RewardConfig(**config)


def test_a_group_reward_with_a_black_box_agent_is_an_error():
    with pytest.raises(ValueError, match=r"reward.group = true scores the final turns of white-box episodes"):
        load_recipe("tiny-calc-agent", ["reward.group=true", 'reward.fn="r.py:f"', "agent.type=blackbox"])


def test_an_unset_key_variable_is_an_error_before_training(data, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    reward = RewardConfig(url="http://127.0.0.1:1/s", api_key_env="NO_SUCH_KEY_VAR")
    with pytest.raises(ConfigError, match=r"'NO_SUCH_KEY_VAR', which is not set"):
        DataTask(DataConfig(train_files=[str(data)]), reward)


GROUP_REWARD = """
import json, os

def shortest(completion, answer):
    with open(os.environ["LOONG_TEST_CALLS"], "a") as f:
        f.write(json.dumps({"completion": completion, "answer": answer}) + "\\n")
    if "raise" in answer:
        raise RuntimeError("this group cannot be scored")
    best = min(len(c) for c in completion)
    return [float("nan") if c == "nan" else {"score": float(len(c) == best), "len": len(c)} for c in completion]
"""


def _episode(sample: str, group: str, status="ok"):
    from loong_core.records import EpisodeStatus, SpanSource, TokenSpan, Trajectory

    spans = [TokenSpan(token_ids=[1], source=SpanSource.PROMPT)]
    return Trajectory(sample_id=sample, group_id=group, spans=spans, status=EpisodeStatus(status))


def test_a_group_reward_scores_each_group_in_one_call(tmp_path, data, monkeypatch):
    """``reward.group``: one call per group with lists, finished episodes only; the call's failure
    fails its group, a NaN entry fails its episode, the other groups are scored."""
    from loong_core.records import EpisodeStatus
    from loong_train.tasks.reward import score_groups

    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("LOONG_TEST_CALLS", str(calls))
    (tmp_path / "rw.py").write_text(GROUP_REWARD)
    task = DataTask(
        DataConfig(train_files=[str(data)]), RewardConfig(fn=f"{tmp_path}/rw.py:shortest", group=True)
    )
    assert task.reward(task.held_out(1)[0], "anything") == 0.0  # deferred to its group
    texts = {
        "a0": "abc",
        "a1": "a",
        "a2": "zz",
        "a3": "never scored",
        "b0": "x",
        "b1": "y",
        "c0": "q",
        "d0": "nan",
        "d1": "ok",
    }
    answers = {"a": "1", "b": "raise", "c": "3", "d": "4"}
    trajs = [_episode(s, s[0], "truncated" if s == "a3" else "ok") for s in texts]
    items = {s: {"id": f"row{s}", "messages": [], "answer": answers[s[0]]} for s in texts}
    score_groups(task.group_reward, trajs, items, lambda t: texts[t.sample_id])
    got = {t.sample_id: (t.reward, t.status.value) for t in trajs}
    assert got == {
        "a0": (0.0, "ok"), "a1": (1.0, "ok"), "a2": (0.0, "ok"), "a3": (0.0, "truncated"),
        "b0": (0.0, "failed"), "b1": (0.0, "failed"), "c0": (1.0, "ok"), "d0": (0.0, "failed"), "d1": (1.0, "ok"),
    }  # fmt: skip
    assert trajs[1].metrics == {"len": 1.0} and "this group cannot be scored" in trajs[4].info["error"]
    assert "returned nan" in trajs[7].info["error"] and trajs[7].info["task_id"] == "rowd0"
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    assert made == [
        {"completion": ["abc", "a", "zz"], "answer": ["1", "1", "1"]},
        {"completion": ["x", "y"], "answer": ["raise", "raise"]},
        {"completion": ["q"], "answer": ["3"]},
        {"completion": ["nan", "ok"], "answer": ["4", "4"]},
    ]
    assert all(t.status is not EpisodeStatus.TIMEOUT for t in trajs)


def test_a_rollout_call_scores_its_groups_with_their_final_turns(tiny_dir, tmp_path, data, monkeypatch):
    """A real RolloutWorker: each group's completions, decoded from the episodes' last model turn,
    reach the group function together, and its scores become the trajectories' rewards."""
    from loong_core.records import EpisodeStatus
    from loong_train.pipeline import GroupSource
    from loong_train.workers.rollout import RolloutWorker

    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("LOONG_TEST_CALLS", str(calls))
    (tmp_path / "rw.py").write_text(GROUP_REWARD)
    tables = TaskTables(
        data=DataConfig(train_files=[str(data)]),
        reward=RewardConfig(fn=f"{tmp_path}/rw.py:shortest", group=True),
    )
    worker = RolloutWorker(
        str(tiny_dir),
        seed=0,
        sampling={"temperature": 1.0, "max_new_tokens": 150},  # a random model ends some turns by then
        limits={"max_turns": 1, "max_model_tokens": 256},
        task="data",
        tables=tables,
    )
    try:
        source = GroupSource(worker.task.train_stream(0, []), group_size=3)
        specs = [s for _ in range(3) for s in source.specs(source.next_group())]
        trajs = worker.rollout(specs)["trajectories"]
    finally:
        worker.close()
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    finished = [
        [t for t in trajs if t.group_id == g and t.status is EpisodeStatus.OK]
        for g in dict.fromkeys(t.group_id for t in trajs)
    ]
    finished = [g for g in finished if g]
    assert len(finished) >= 2, [t.status for t in trajs]
    assert [len(c["completion"]) for c in made] == [len(g) for g in finished]
    for call, group in zip(made, finished, strict=True):
        assert call["completion"] == [worker._final_turn(t) for t in group]
        best = min(map(len, call["completion"]))
        assert [t.reward for t in group] == [float(len(c) == best) for c in call["completion"]]


def test_a_hugging_face_dataset_gives_the_rows_its_splits_hold(tmp_path, monkeypatch):
    """``data.dataset``: a DatasetDict saved with ``save_to_disk`` and a directory of data files
    (read by ``load_dataset``, offline), with their splits; bad names and splits are errors."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    train, test = ROWS[:15], ROWS[15:]
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
    ).save_to_disk(str(saved))
    files = tmp_path / "files"
    files.mkdir()
    _write(files / "train.jsonl", train)
    _write(files / "test.jsonl", test)
    for where in (saved, files):
        task = DataTask(DataConfig(dataset=str(where), eval_split="test"), RewardConfig())
        assert [i["row"] for i in task.train] == train and [i["row"] for i in task.eval] == test
        assert task.train[3]["id"] == "train:3" and task.eval[0]["answer"] == test[0]["answer"]
    held = DataTask(DataConfig(dataset=str(saved), eval_fraction=0.2), RewardConfig())
    assert len(held.eval) == 3 and {i["id"] for i in held.eval}.isdisjoint(i["id"] for i in held.train)
    with pytest.raises(ConfigError, match=r"no split 'validation' \(it has train, test\)"):
        DataTask(DataConfig(dataset=str(saved), eval_split="validation"), RewardConfig())
    with pytest.raises(ConfigError, match=r"data.dataset 'no-such/dataset' \(split 'train'\) does not load"):
        DataTask(DataConfig(dataset="no-such/dataset"), RewardConfig())
    with pytest.raises(ValueError, match=r"two sources of rows"):
        DataConfig(dataset=str(saved), train_files=["a.jsonl"])


def _big(path: Path, n: int, pad: int = 1000) -> Path:
    return _write(path, [{"prompt": f"q{i} " + "x" * pad, "answer": str(i)} for i in range(n)])


def test_streamed_files_shuffle_in_a_buffer_and_never_sit_in_memory(tmp_path):
    """``shuffle_buffer``: each pass yields every training row once, in a seeded order; held-out
    rows (a hashed fraction) never train; a stream restarted and advanced k rows continues the
    first (what --resume relies on); peak memory is a fraction of reading the file whole."""
    import tracemalloc

    big = _big(tmp_path / "big.jsonl", 4000)
    config = DataConfig(train_files=[str(big)], shuffle_buffer=64, eval_fraction=0.1)
    task = DataTask(config, RewardConfig())
    held = {i["id"] for i in task.held_out(10**6)}  # every held-out row: the whole file scanned
    assert 300 < len(held) < 500 and task.held_out(5) == task.held_out(10**6)[:5]
    every = {f"big.jsonl:{n}" for n in range(1, 4001)}
    stream = task.train_stream(7, task.held_out(32))
    first = [next(stream)["id"] for _ in range(len(every) - len(held))]
    second = [next(stream)["id"] for _ in range(len(first))]
    assert set(first) == set(second) == every - held and len(set(first)) == len(first)
    assert first != sorted(first, key=lambda r: int(r.split(":")[1])) and first != second
    again = DataTask(config, RewardConfig()).train_stream(7, task.held_out(32))
    assert [next(again)["id"] for _ in range(100)] == first[:100]
    resumed = DataTask(config, RewardConfig()).train_stream(7, task.held_out(32))
    next(itertools.islice(resumed, 2500, 2500), None)  # the controller's skip on --resume
    assert [next(resumed)["id"] for _ in range(50)] == first[2500:2550]
    other = [x["id"] for x in itertools.islice(DataTask(config, RewardConfig()).train_stream(8, []), 100)]
    assert other != first[:100]

    def peak(make):
        tracemalloc.start()
        stream = make().train_stream(1, [])
        for _ in range(1000):
            next(stream)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    whole = peak(lambda: DataTask(DataConfig(train_files=[str(big)]), RewardConfig()))
    streamed = peak(lambda: DataTask(config, RewardConfig()))
    assert streamed < 0.2 * whole, (streamed, whole)


def test_streamed_parquet_and_bad_streamed_input(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(300)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=50)
    task = DataTask(
        DataConfig(
            train_files=[str(tmp_path / "d.parquet")],
            shuffle_buffer=16,
            eval_files=[str(_write(tmp_path / "e.jsonl", ROWS))],
        ),
        RewardConfig(),
    )
    ids = [x["id"] for x in itertools.islice(task.train_stream(0, []), 300)]
    assert sorted(ids) == sorted(f"d.parquet:{i}" for i in range(300)) and len(task.held_out(100)) == len(
        ROWS
    )
    with pytest.raises(
        ValueError, match=r"shuffle_buffer streams .jsonl and .parquet train_files, not a .json file"
    ):
        DataConfig(train_files=["a.json"], shuffle_buffer=8)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ROWS[0]) + "\n" + "{not json\n")
    stream = DataTask(
        DataConfig(train_files=[str(broken)], shuffle_buffer=4, eval_files=[str(tmp_path / "e.jsonl")]),
        RewardConfig(),
    ).train_stream(0, [])
    with pytest.raises(ConfigError, match=r"broken.jsonl, line 2: not valid JSON"):
        next(stream)


def test_overlong_shaping_is_dapos_soft_punishment():
    """Budget 20, buffer 8: free up to 12 tokens, then -1/8 per token, -1 (times the factor) at 20;
    a black-box episode's rows count together; failed episodes are left alone."""
    from loong_core.records import EpisodeStatus, SpanSource, TokenSpan, Trajectory
    from loong_train.tasks.shaping import overlong_penalty, shape_overlong

    assert [overlong_penalty(n, 20, 8, 1.0) for n in (5, 12, 13, 16, 20)] == [0.0, 0.0, -0.125, -0.5, -1.0]
    assert overlong_penalty(16, 20, 8, 0.5) == -0.25 and overlong_penalty(19, 20, 0, 1.0) == 0.0

    def row(sample, n, status="ok", episode=""):
        spans = [TokenSpan(token_ids=[1], source=SpanSource.PROMPT)]
        spans.append(
            TokenSpan(token_ids=[2] * n, source=SpanSource.MODEL, logprobs=[-1.0] * n, weight_version=0)
        )
        info = {"episode": episode} if episode else {}
        return Trajectory(
            sample_id=sample, group_id="g", spans=spans, reward=1.0, status=EpisodeStatus(status), info=info
        )

    trajs = [
        row("a", 10),
        row("b", 14, "truncated"),
        row("c#0", 8, episode="c"),
        row("c#1", 8, episode="c"),
        row("d", 19, "failed"),
    ]
    shape_overlong(trajs, 20, 8, 1.0)
    assert [t.reward for t in trajs] == [1.0, 0.75, 0.5, 0.5, 1.0]
    assert [t.metrics.get("overlong_penalty") for t in trajs] == [0.0, -0.25, -0.5, -0.5, None]


def test_overlong_shaping_reaches_training_rewards_only(tiny_dir, data):
    """A real RolloutWorker: training rewards carry the penalty of their own length, evaluations
    do not; a buffer as long as the budget is an error naming both keys."""
    from loong_core.records import EpisodeStatus
    from loong_train.pipeline import GroupSource
    from loong_train.tasks.shaping import overlong_penalty
    from loong_train.workers.rollout import RolloutWorker

    tables = TaskTables(data=DataConfig(train_files=[str(data)]), reward=RewardConfig(overlong_buffer=30))
    worker = RolloutWorker(
        str(tiny_dir),
        seed=0,
        sampling={"temperature": 1.0, "max_new_tokens": 40},
        limits={"max_turns": 1, "max_model_tokens": 256},
        task="data",
        tables=tables,
    )
    try:
        source = GroupSource(worker.task.train_stream(0, []), group_size=4)
        specs = source.specs(source.next_group())
        shaped = worker.rollout(specs)["trajectories"]
        plain = worker.rollout(specs, evaluation=True)["trajectories"]
    finally:
        worker.close()
    assert worker.budget == 40
    scored = [t for t in shaped if t.status in (EpisodeStatus.OK, EpisodeStatus.TRUNCATED)]
    assert scored and any(t.metrics["overlong_penalty"] < 0 for t in scored)
    answers = {s.sample_id: s.task["answer"] for s in specs}
    for t in scored:  # exact match (unset reward.fn), and nothing for a truncated episode, plus the penalty
        base = (
            float(worker._final_turn(t).strip() == answers[t.sample_id])
            if t.status is EpisodeStatus.OK
            else 0.0
        )
        assert t.reward == pytest.approx(base + overlong_penalty(t.num_model_tokens, 40, 30, 1.0))
    assert all("overlong_penalty" not in t.metrics for t in plain)
    with pytest.raises(
        ValueError,
        match=r"reward.overlong_buffer = 160 must be below the episode budget, min\(rollout.max_model_tokens",
    ):
        load_recipe("tiny-calc-agent", ["reward.overlong_buffer=160"])


def test_the_warm_start_probe_scores_a_group_reward_one_episode_at_a_time(
    tiny_dir, tmp_path, data, monkeypatch
):
    """In group mode an episode's own reward is deferred; the warm start's probe still scores its
    finished episodes (each a group of one), so its stopping rule sees real success."""
    from loong_train.models.decoder import CausalLM
    from loong_train.models.tokenizer import load_tokenizer
    from loong_train.tiny.warmstart import sampled_success

    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("LOONG_TEST_CALLS", str(calls))
    (tmp_path / "rw.py").write_text(GROUP_REWARD)
    sets = [
        'task="data"',
        f'data.train_files=["{data}"]',
        f'reward.fn="{tmp_path}/rw.py:shortest"',
        "reward.group=true",
        "rollout.max_new_tokens=150",
        "rollout.max_model_tokens=256",
    ]
    recipe = load_recipe("tiny-calc-agent", sets)
    task = build_task(recipe.task, recipe.task_tables)
    success = sampled_success(
        CausalLM.from_pretrained(tiny_dir), load_tokenizer(tiny_dir), recipe, task.held_out(2) * 4, 0, task
    )
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    assert made and all(len(c["completion"]) == 1 for c in made)  # one call per finished probe episode
    assert success == len(made) / 8  # a group of one: its only completion is the shortest
