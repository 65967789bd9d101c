"""``task = "data"``'s reward: a user's function (the parameters it names, sync or async, verl's and
TRL's conventions, failures), a reward service over HTTP, and DAPO's overlong shaping."""

import json
import math
import textwrap

import pytest
from train_testkit import write_jsonl

from loong_core.config import ConfigError
from loong_train.config import load_recipe
from loong_train.tasks import TaskTables
from loong_train.tasks.config import DataConfig, RewardConfig
from loong_train.tasks.data import DataTask
from loong_train.tasks.reward import load_reward


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
    data = write_jsonl(tmp_path / "d.jsonl", [verl_row] * 4)
    config = DataConfig(train_files=[str(data)], answer_key="reward_model.ground_truth")

    def task(fn, style):
        return DataTask(config, RewardConfig(fn=f"{tmp_path / fn}", style=style))

    verl = task("verl_rw.py:compute_score", "verl")
    item = verl.held_out(1)[0]
    assert verl.reward(item, " 4") == 1.0 and verl.reward(item, "5") == 0.0
    trl = task("trl_rw.py:exact", "trl")
    assert trl.reward(item, "4") == 1.0 and trl.reward(item, "44") == 0.0
    text_rows = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi", "answer": "x"}] * 4)
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


def test_episode_numbers_become_step_means_over_the_episodes_that_carry_them():
    from loong_core.records import SpanSource, TokenSpan, Trajectory
    from loong_train.run.rows import _episode_metrics

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


def test_an_unset_key_variable_is_an_error_before_training(data, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    reward = RewardConfig(url="http://127.0.0.1:1/s", api_key_env="NO_SUCH_KEY_VAR")
    with pytest.raises(ConfigError, match=r"'NO_SUCH_KEY_VAR', which is not set"):
        DataTask(DataConfig(train_files=[str(data)]), reward)


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
    from loong_train.source import GroupSource
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
        shaped = worker.rollout(specs).trajectories
        plain = worker.rollout(specs, evaluation=True).trajectories
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
