"""``task = "reasoning_gym:<dataset>"``: the split by index range (no held-out question in
training), strict versus the dataset's partial-credit scoring, answer extraction, scorers that
raise, composites, bad names; then a short real run of a reasoning-gym task through Loong."""

import json
from collections import Counter

import pytest

pytest.importorskip("reasoning_gym")

from loong_core.config import ConfigError
from loong_train.config import load_recipe
from loong_train.controller import run
from loong_train.tasks import TaskTables, build_task
from loong_train.tasks.config import ReasoningGymConfig


def _task(name="reasoning_gym:leg_counting", **config):
    return build_task(name, TaskTables(reasoning_gym=ReasoningGymConfig(**config)))


def test_held_out_items_are_the_first_indices_and_never_trained_on():
    task = _task(eval_size=16, train_size=200, seed=5)
    held = task.held_out(100)
    assert [i["id"] for i in held] == [f"leg_counting:{k}" for k in range(16)]
    stream = task.train_stream(1, held)
    drawn = [next(stream) for _ in range(400)]
    assert all(int(i["id"].split(":")[1]) >= 16 for i in drawn)
    held_questions = {i["messages"][-1]["content"] for i in held}
    assert not held_questions & {i["messages"][-1]["content"] for i in drawn}
    again = _task(eval_size=16, train_size=200, seed=5)  # every process builds the same items
    assert again.held_out(100) == held


def test_strict_scoring_refuses_the_partial_credit_the_dataset_scorer_gives():
    strict = _task(eval_size=4, train_size=4, answer_format="plain")
    lenient = _task(eval_size=4, train_size=4, answer_format="plain", scoring="dataset")
    item = strict.held_out(1)[0]
    right = item["answer"]
    assert strict.reward(item, f" {right}\n") == lenient.reward(item, right) == 1.0
    assert strict.reward(item, f"x{right}") == 0.0 < lenient.reward(item, f"x{right}") < 1.0  # partial credit


def test_tags_extract_the_answer_and_a_missing_tag_scores_zero():
    task = _task(eval_size=4, train_size=4)
    item = task.held_out(1)[0]
    assert item["messages"][0]["role"] == "system" and "<answer>" in item["messages"][0]["content"]
    assert task.reward(item, f"I count.<answer>{item['answer']}</answer>") == 1.0
    assert task.reward(item, item["answer"]) == 0.0  # no tags, no answer


def test_a_scorer_that_raises_scores_zero_and_is_counted(monkeypatch):
    task = _task(eval_size=4, train_size=4, answer_format="plain", scoring="dataset")
    item = task.held_out(1)[0]
    monkeypatch.setattr(task.datasets["leg_counting"], "score_answer", lambda a, e: 1 / 0)
    assert task.reward(item, "12") == 0.0 and task.scorer_errors == 1


def test_a_composite_tags_each_item_with_its_dataset_in_proportion():
    task = _task("reasoning_gym", datasets={"leg_counting": 3, "gcd": 1}, eval_size=40, train_size=500)
    assert Counter(i["tags"]["domain"] for i in task.held_out(40)) == {"leg_counting": 30, "gcd": 10}
    stream = task.train_stream(0, task.held_out(40))
    counts = Counter(next(stream)["tags"]["domain"] for _ in range(2000))
    assert 0.7 < counts["leg_counting"] / 2000 < 0.8


@pytest.mark.parametrize(
    ("name", "config", "error"),
    [
        ("reasoning_gym:no_such_dataset", {}, r"reasoning_gym dataset 'no_such_dataset'"),
        ("reasoning_gym", {}, r"needs reasoning_gym\.datasets"),
        (
            "reasoning_gym:leg_counting",
            {"config": {"leg_counting": {"legs": 3}}},
            r"dataset 'leg_counting': TypeError",
        ),
    ],
)
def test_bad_names_and_configs_are_errors_before_training(name, config, error):
    with pytest.raises(ConfigError, match=error):
        _task(name, **config)


@pytest.mark.integration
def test_a_reasoning_gym_task_runs_through_loong(tmp_path):
    sets = [
        "task=reasoning_gym:leg_counting",
        "reasoning_gym.answer_format=plain",
        "reasoning_gym.eval_size=8",
        "reasoning_gym.train_size=100",
        "reasoning_gym.config.leg_counting={min_animals = 1, max_animals = 2}",
        "warmstart.steps=0",
        "train.steps=2",
        "train.batch_groups=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=8",
        "rollout.max_model_tokens=160",
        "eval.every=1",
        "eval.num_tasks=8",
    ]
    out = run(load_recipe("tiny-calc-agent", sets), tmp_path / "run", tmp_path / "cache")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["eval_reward_by_version"]) == {"0", "1", "2"}
    assert set(summary["eval_reward_by_domain"]) == {"leg_counting"}  # the items' dataset tag


def test_the_warm_start_demonstrates_the_datasets_own_answer_in_the_episodes_layout():
    from loong_agentflow import ChatML

    for answer_format, shown in (("plain", "{}"), ("tags", "<answer>{}</answer>")):
        task = _task(eval_size=4, train_size=20, answer_format=answer_format)
        item = task.held_out(1)[0]
        expected = [
            (ChatML.prompt(item["messages"]), False),
            (shown.format(item["answer"]) + ChatML.END, True),
        ]
        assert task.demonstration(item) == expected
        assert task.reward(item, shown.format(item["answer"])) == 1.0  # what it demonstrates scores


def test_the_tiny_reasoning_recipe_never_trains_on_a_held_out_question():
    """The shipped composite: held-out items are each dataset's first indices, and neither their
    ids nor their questions appear in what the warm start and RL draw from (the recipe's seeds)."""
    recipe = load_recipe("tiny-reasoning")
    task = build_task(recipe.task, recipe.task_tables)
    held = task.held_out(recipe.eval.num_tasks)
    assert Counter(i["tags"]["domain"] for i in held) == {"rotate_matrix": 64, "manipulate_matrix": 64}
    assert all(int(i["id"].split(":")[1]) < recipe.task_tables.reasoning_gym.eval_size for i in held)
    held_ids = {i["id"] for i in held}
    held_questions = {i["messages"][-1]["content"] for i in held}
    for seed in (recipe.seed + 1, recipe.seed + 2, recipe.seed + 7):  # warm start, RL, probes
        stream = task.train_stream(seed, held)
        drawn = [next(stream) for _ in range(3000)]
        assert not held_ids & {i["id"] for i in drawn}
        assert not held_questions & {i["messages"][-1]["content"] for i in drawn}
    assert len(held_questions) == len(held)  # no question is held out twice


def test_target_domains_name_the_tasks_the_warm_start_waits_for(tmp_path):
    """The shipped recipe waits for both matrix tasks; a domain no probe task carries stops the
    warm start at its first probe, naming the domains there are; target_domains without
    target_per_domain is a config error."""
    from loong_train.tiny.warmstart import build_tiny, warm_start

    recipe = load_recipe("tiny-reasoning")
    assert recipe.warmstart.target_per_domain and set(recipe.warmstart.target_domains) == {
        "rotate_matrix",
        "manipulate_matrix",
    }
    sets = [
        "warmstart.steps=1",
        "warmstart.eval_every=1",
        "warmstart.eval_tasks=6",
        'warmstart.target_domains=["nope"]',
    ]
    small = load_recipe(
        "tiny-reasoning", [*sets, "reasoning_gym.train_size=200", "reasoning_gym.eval_size=30"]
    )
    path = build_tiny(tmp_path / "m", small)
    with pytest.raises(
        ValueError, match=r"target_domains names \['nope'\], which no probe task is tagged with"
    ):
        warm_start(path, small)
    with pytest.raises(ValueError, match=r"set target_per_domain = true"):
        load_recipe("tiny-reasoning", ["warmstart.target_per_domain=false"])
