"""``task = "verifiers"``: a verifiers v1 taskset (a user's file, as the verifiers docs write one)
becomes items, is split without overlap and is scored by the taskset's own weighted rewards,
compared with the weights by hand; bad tasksets are errors before training; one real run."""

import json

import pytest

from loong_core.config import ConfigError
from loong_train.config import load_recipe
from loong_train.controller import run as run_recipe
from loong_train.tasks import TaskTables, build_task
from loong_train.tasks.config import VerifiersConfig

pytest.importorskip("verifiers.v1")

TASKSET = """
import verifiers.v1 as vf

ROWS = [(f"What is {a} + {b}?", str(a + b)) for a in range(5) for b in range(4)]


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.reward(weight=0.25)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 2)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for i, (q, a) in enumerate(ROWS):
            yield SumTask(SumData(id=f"sum-{i}", prompt=q, answer=a), self.config.task)


class BrokenTask(SumTask):
    @vf.reward
    async def boom(self, trace: vf.Trace) -> float:
        raise ValueError("no score")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        yield from (BrokenTask(SumData(id=f"b-{i}", prompt="hi", answer="1"), self.config.task) for i in range(4))


__all__ = ["SumTaskset"]
"""


@pytest.fixture
def taskset(tmp_path, monkeypatch):
    (tmp_path / "sums.py").write_text(TASKSET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _task(**kw):
    return build_task("verifiers", TaskTables(verifiers=VerifiersConfig(**kw)))


def test_tasks_become_items_split_without_overlap_and_score_by_their_weights(taskset):
    (taskset / "system.txt").write_text("Add.")  # verifiers reads a system prompt from a file
    task = _task(taskset="sums.py:SumTaskset", eval_fraction=0.25, config={"system_prompt": "system.txt"})
    held = task.held_out(100)
    assert len(held) == 5 and len(task.train) == 15
    assert not {i["id"] for i in held} & {i["id"] for i in task.train}
    item = next(i for i in held + task.train if i["id"] == "sum-6")  # a = 1, b = 2
    assert item["messages"] == [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "What is 1 + 2?"},
    ]
    assert task.reward(item, "3") == pytest.approx(1.0 + 0.25)  # exact and short
    assert task.reward(item, "12").metrics == {"exact": 0.0, "short": 1.0}  # each, for reward/<name>
    assert task.reward(item, " 3 ") == pytest.approx(1.25)  # verifiers strips the reply
    assert task.reward(item, "4") == pytest.approx(0.25)
    assert task.reward(item, "three") == 0.0
    streamed = [next(s) for s in [task.train_stream(1, held)] for _ in range(30)]
    assert {i["id"] for i in streamed} == {i["id"] for i in task.train}
    # a module name works too: its __all__ exports the one taskset
    assert len(_task(taskset="sums").held_out(100)) == 2


def test_a_reward_that_raises_fails_the_episode(taskset):
    task = _task(taskset="sums.py:BrokenTaskset", eval_fraction=0.25)
    with pytest.raises(RuntimeError, match="verifiers scoring of task b-"):
        task.reward(task.train[0], "1")


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("", "needs verifiers.taskset"),
        ("nowhere_at_all", "cannot import it"),
        ("sums.py:SumData", "not a verifiers.v1.Taskset subclass"),
        ("sums.py:Missing", "Missing"),
    ],
)
def test_bad_tasksets_are_errors_naming_them(taskset, spec, error):
    with pytest.raises(ConfigError, match=error):
        _task(taskset=spec)


RECIPE = """
name = "vf-sums"
task = "verifiers"

[verifiers]
taskset = "sums.py:SumTaskset"
eval_fraction = 0.2

[warmstart]
steps = 0

[train]
steps = 2
batch_groups = 2

[rollout]
group_size = 4
max_new_tokens = 8
max_model_tokens = 16

[eval]
every = 1
num_tasks = 4
"""


@pytest.mark.integration
def test_a_verifiers_taskset_trains_through_loong(taskset):
    (taskset / "recipe.toml").write_text(RECIPE)
    run = run_recipe(load_recipe(str(taskset / "recipe.toml")), taskset / "run", taskset / "cache")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["failed"] == 0 and r["samples"] == 8 for r in rows)
    # every held-out reward is a sum of the taskset's weights (0, 0.25, 1 or 1.25), so 4 items' mean
    # times 4 is a multiple of 0.25
    evals = json.loads((run / "summary.json").read_text())["eval_reward_by_version"]
    assert sorted(map(int, evals)) == [0, 1, 2]
    assert all(abs(4 * r / 0.25 - round(4 * r / 0.25)) < 1e-9 for r in evals.values())
