"""``task = "data"``: the user's rows. Their sources (JSON lines, JSON, parquet, a Hugging Face
dataset, streamed files), the split, every bad input and the warm start's use of them, then one
real run started from a user's own directory."""

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from train_testkit import DATA_ROWS, write_jsonl

from loong_core.config import ConfigError
from loong_train.config import load_recipe
from loong_train.tasks import TaskTables, build_task
from loong_train.tasks.config import DataConfig, RewardConfig
from loong_train.tasks.data import DataTask


def test_rows_become_items_and_the_split_is_disjoint_and_seeded(data):
    task = DataTask(DataConfig(train_files=[str(data)], eval_fraction=0.25, split_seed=3), RewardConfig())
    again = DataTask(DataConfig(train_files=[str(data)], eval_fraction=0.25, split_seed=3), RewardConfig())
    held = task.held_out(100)
    assert len(held) == 5 and held == again.held_out(100)
    assert {i["id"] for i in held}.isdisjoint(i["id"] for i in task.train)
    assert len(task.train) + len(held) == len(DATA_ROWS)
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
    train, held = write_jsonl(tmp_path / "t.jsonl", verl), tmp_path / "e.json"
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


def test_a_hugging_face_dataset_gives_the_rows_its_splits_hold(tmp_path, monkeypatch):
    """``data.dataset``: a DatasetDict saved with ``save_to_disk`` and a directory of data files
    (read by ``load_dataset``, offline), with their splits; bad names and splits are errors."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    train, test = DATA_ROWS[:15], DATA_ROWS[15:]
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "test": datasets.Dataset.from_list(test)}
    ).save_to_disk(str(saved))
    files = tmp_path / "files"
    files.mkdir()
    write_jsonl(files / "train.jsonl", train)
    write_jsonl(files / "test.jsonl", test)
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
    return write_jsonl(path, [{"prompt": f"q{i} " + "x" * pad, "answer": str(i)} for i in range(n)])


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
            eval_files=[str(write_jsonl(tmp_path / "e.jsonl", DATA_ROWS))],
        ),
        RewardConfig(),
    )
    ids = [x["id"] for x in itertools.islice(task.train_stream(0, []), 300)]
    assert sorted(ids) == sorted(f"d.parquet:{i}" for i in range(300)) and len(task.held_out(100)) == len(
        DATA_ROWS
    )
    with pytest.raises(
        ValueError, match=r"shuffle_buffer streams .jsonl and .parquet train_files, not a .json file"
    ):
        DataConfig(train_files=["a.json"], shuffle_buffer=8)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(DATA_ROWS[0]) + "\n" + "{not json\n")
    stream = DataTask(
        DataConfig(train_files=[str(broken)], shuffle_buffer=4, eval_files=[str(tmp_path / "e.jsonl")]),
        RewardConfig(),
    ).train_stream(0, [])
    with pytest.raises(ConfigError, match=r"broken.jsonl, line 2: not valid JSON"):
        next(stream)


def test_the_warm_start_demonstrates_a_rows_answer_and_refuses_a_row_without_one(tmp_path, data):
    from loong_agentflow import ChatML

    task = DataTask(DataConfig(train_files=[str(data)]), RewardConfig())
    item = task.train[0]
    assert task.demonstration(item) == [
        (ChatML.prompt(item["messages"]), False),
        (f"{item['answer']}<|im_end|>", True),
    ]
    rows = write_jsonl(tmp_path / "bare.jsonl", [{"prompt": "hi"}] * 4)
    bare = DataTask(DataConfig(train_files=[str(rows)], answer_key="solution"), RewardConfig(fn=""))
    with pytest.raises(ConfigError, match=r"bare\.jsonl:\d: no answer at data\.answer_key 'solution'"):
        bare.demonstration(bare.train[0])


def test_a_cached_warm_start_is_keyed_by_what_the_task_files_hold(tmp_path, data, monkeypatch):
    from loong_train.tiny.warmstart import _file_digests

    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.toml").write_text('name = "t"\ntask = "data"\n[data]\ntrain_files = ["data.jsonl"]\n')
    before = _file_digests(load_recipe(str(tmp_path / "recipe.toml")))
    assert list(before) == [str(data)]
    write_jsonl(data, DATA_ROWS[:-1])  # one row fewer: another warm start
    assert _file_digests(load_recipe(str(tmp_path / "recipe.toml"))) != before


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
    write_jsonl(tmp_path / "data.jsonl", DATA_ROWS)
    (tmp_path / "reward.py").write_text(USER_REWARD)
    (tmp_path / "recipe.toml").write_text(USER_RECIPE)
    cmd = [sys.executable, "-m", "loong_train.cli", "run", "recipe.toml", "--cache", "cache"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # as a user's shell
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # the recipe names no task: its [data] and [reward] make it the data task, and the run says so
    assert "recipe.toml: task = 'data' (inferred from [data], [reward])" in done.stderr
    assert "Token authentication is enabled" not in done.stderr  # chosen, not announced
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
    pairs = {(r["prompt"], r["answer"]) for r in DATA_ROWS}
    assert calls and all((c["prompt"], c["answer"]) in pairs for c in calls)
    # the reward raised on the rows whose answer is even: those episodes failed, were
    # counted, and each was logged with its row (line n of data.jsonl holds answer n); the run went on
    raised = {c["answer"] for c in calls if int(c["answer"]) % 2 == 0}
    trained_failures = sum(r["failed"] for r in rows)
    assert raised and trained_failures > 0
    logged = set(re.findall(r"\(row data\.jsonl:(\d+)\) failed: ValueError: no score for (\d+)", done.stderr))
    assert logged and all(line == answer for line, answer in logged)
    assert {answer for _, answer in logged} <= raised
