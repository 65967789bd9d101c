"""The shipped code example (examples/code): a model writes Python functions, the reward runs
hidden unit tests in the sandbox. Two steps from a copy of its directory; every reward call ran
sandboxed (the scored program was the init of its own PID namespace), and the reward function
itself scores a reference solution 1 and a wrong one 0."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[3] / "examples" / "code"


@pytest.fixture
def example(tmp_path):
    from loong_agentflow import Sandbox, SandboxUnavailable

    try:
        Sandbox()
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    work = tmp_path / "code"
    shutil.copytree(EXAMPLE, work)
    return work


def test_the_reward_runs_hidden_tests_in_the_sandbox(example):
    spec = importlib.util.spec_from_file_location("code_example_reward", example / "reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)

    row = json.loads((example / "data.jsonl").read_text().splitlines()[0])
    good = reward.score(row["answer"], row["metadata"])
    wrong = reward.score(row["answer"].replace("return", "return -1 +"), row["metadata"])
    garbage = reward.score("def (:", row["metadata"])  # a model's garbage does not compile
    fenced = reward.score(f"```python\n{row['answer']}\n```", row["metadata"])
    assert good == fenced == {"score": 1.0, "sandboxed": 1.0}
    assert wrong == garbage == {"score": 0.0, "sandboxed": 1.0}


@pytest.mark.integration
def test_the_code_example_trains_with_its_rewards_in_the_sandbox(example):
    sets = [
        "train.steps=2",
        "train.batch_groups=2",
        "rollout.group_size=2",
        "eval.every=1",
        "eval.num_tasks=4",
        "warmstart.steps=2",
        "warmstart.eval_every=2",
        "warmstart.eval_tasks=4",
    ]
    cmd = [sys.executable, "-m", "loong_train.cli", "run", "recipe.toml", "--cache", "cache"]
    cmd += [a for s in sets for a in ("--set", s)]
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    done = subprocess.run(cmd, cwd=example, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        json.loads(line) for line in (example / "runs" / "code" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [1, 2] and all(r["failed"] == 0 for r in rows)
    assert all(r["reward/sandboxed"] == 1.0 for r in rows)  # every reward call ran in the sandbox
