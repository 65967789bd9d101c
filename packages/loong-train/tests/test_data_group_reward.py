"""``reward.group = true``: one call of the user's function per group of finished episodes, in a
rollout call and in the warm start's probe, and where it is refused."""

import json

import pytest

from loong_train.config import load_recipe
from loong_train.tasks import TaskTables, build_task
from loong_train.tasks.config import DataConfig, RewardConfig
from loong_train.tasks.data import DataTask


def test_a_group_reward_with_a_black_box_agent_is_an_error():
    with pytest.raises(ValueError, match=r"reward.group = true scores the final turns of white-box episodes"):
        load_recipe(
            "tiny-calc-agent", ["task=data", "reward.group=true", 'reward.fn="r.py:f"', "agent.type=blackbox"]
        )


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
    from loong_train.source import GroupSource
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
        trajs = worker.rollout(specs).trajectories
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
