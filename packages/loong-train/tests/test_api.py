"""The Python API: rows, a reward function, an environment class or a task factory given as
objects. Unit tests of what they build and refuse, then one real run from a user's script whose
reward function is defined in the script itself (it reaches the Ray workers by value)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loong_core.config import ConfigError
from loong_train.api import code_task
from loong_train.config import load_recipe
from loong_train.tasks import build_task

EXAMPLE = Path(__file__).parents[3] / "examples" / "shop"
ROWS = [{"prompt": f"what is {i}+1?", "answer": str(i + 1)} for i in range(20)]


def _recipe(*sets):
    return load_recipe("tiny-calc-agent", list(sets), task="data")  # as train() loads it for rows


def test_rows_and_a_reward_function_become_a_data_task_named_by_their_content():
    seen = []

    def score(completion, answer, row):
        seen.append(row["prompt"])
        return float(completion == answer)

    recipe = code_task(_recipe("data.eval_fraction=0.25"), rows=iter(ROWS), reward=score)
    assert recipe.task.startswith("python:data-")
    task = build_task(recipe.task, recipe.task_tables)
    held = task.held_out(100)
    assert len(held) == 5 and {i["id"] for i in held}.isdisjoint(i["id"] for i in task.train)
    assert sorted(int(i["id"].split(":")[1]) for i in task.train + held) == list(range(20))
    item = held[0]
    assert task.reward(item, item["answer"]) == 1.0 and seen == [item["row"]["prompt"]]
    # the name follows the content: the same rows and code give the same name (and warm-start cache)
    assert code_task(_recipe("data.eval_fraction=0.25"), rows=ROWS, reward=score).task == recipe.task
    assert code_task(_recipe("data.eval_fraction=0.25"), rows=ROWS[:19], reward=score).task != recipe.task
    assert code_task(_recipe("data.eval_fraction=0.5"), rows=ROWS, reward=score).task != recipe.task


def test_held_out_rows_an_environment_class_and_a_task_factory():
    recipe = code_task(_recipe(), rows=ROWS[:4], eval_rows=ROWS[4:6])
    task = build_task(recipe.task, recipe.task_tables)
    assert [i["id"] for i in task.held_out(8)] == ["eval_rows:0", "eval_rows:1"] and len(task.train) == 4
    sys.path.insert(0, str(EXAMPLE))
    try:
        from env import Shop  # the shop example's environment, as a user's own class

        shop_rows = [json.loads(line) for line in (EXAMPLE / "data.jsonl").read_text().splitlines()[:20]]
        recipe = code_task(_recipe(), rows=shop_rows, environment=Shop)
        task = build_task(recipe.task, recipe.task_tables)
        assert recipe.task.startswith("python:env-") and type(task.make().env) is Shop
    finally:
        sys.path.remove(str(EXAMPLE))
    made = code_task(_recipe(), task=lambda: build_task("calc"))
    assert type(build_task(made.task)).__name__ == "CalcTask"


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({}, r"give rows= \(with reward= or environment=\), or task="),
        ({"rows": []}, r"rows is empty"),
        ({"rows": [{"question": "x"}]}, r"rows:0: the row has no prompt key 'prompt' \(keys: question\)"),
        ({"rows": ROWS, "reward": lambda completion, shots: 0.0}, r"parameter 'shots' is none of"),
        ({"rows": ROWS, "environment": dict, "reward": len}, r"drop reward="),
        ({"rows": ROWS, "task": lambda: None}, r"task= is a whole task"),
    ],
)
def test_bad_objects_are_errors_naming_what_is_wrong(kwargs, error):
    with pytest.raises(ConfigError, match=error):
        recipe = code_task(_recipe(), **kwargs)
        build_task(recipe.task, recipe.task_tables)


SCRIPT = """
import json, sys
from pathlib import Path
from loong_train.api import train

def score(completion, answer, row):
    with open("calls.jsonl", "a") as f:  # runs in a rollout worker: it came there by value
        f.write(json.dumps({"prompt": row["prompt"], "answer": answer}) + "\\n")
    return float(completion.strip() == answer)

rows = [{"prompt": f"compute {i}+{i}", "answer": str(2 * i)} for i in range(40)]
sets = ["train.steps=2", "train.batch_groups=2", "rollout.group_size=2", "eval.every=1",
        "eval.num_tasks=4", "warmstart.steps=0"]
out = train("tiny-calc-agent", rows=rows, reward=score, sets=sets, out=Path("run"), cache=Path("cache"))
print("RUN", out)
"""


@pytest.mark.integration
def test_a_script_trains_its_own_rows_and_reward_function(tmp_path):
    (tmp_path / "train_me.py").write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run(
        [sys.executable, "train_me.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["failed"] == 0 for m in metrics)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    rows = {f"compute {i}+{i}": str(2 * i) for i in range(40)}
    # episodes that hit max_new_tokens are not scored; a random model ends some turns on its own
    assert calls and all(rows[c["prompt"]] == c["answer"] for c in calls)
