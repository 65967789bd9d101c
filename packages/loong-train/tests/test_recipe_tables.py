"""A task table the recipe's task never reads is refused when the recipe loads (before Ray or a
model), naming the table, its keys and the task; a recipe without ``task`` gets the one its
tables name, or is refused. The end-to-end newcomer case (a data recipe without ``task`` trains
with the user's reward) is in ``test_data_task.py``."""

from __future__ import annotations

import logging

import pytest

from loong_core.config import ConfigError
from loong_train.config import load_recipe

DATA = '[data]\ntrain_files = ["rows.jsonl"]\n'
REWARD = '[reward]\nfn = "reward.py:score"\n'
ENV = '[environment]\ncls = "env.py:Shop"\n'
GYM = "[reasoning_gym]\ndatasets = {basic_arithmetic = 1.0}\n"
VERIFIERS = '[verifiers]\ntaskset = "reverse_text"\n'


def _load(tmp_path, body: str, **kwargs):
    path = tmp_path / "recipe.toml"
    path.write_text('name = "mine"\n' + body)
    return load_recipe(str(path), **kwargs)


@pytest.mark.parametrize(
    ("task", "tables", "refused"),
    [
        ("calc", DATA + REWARD, ["[data] (train_files)", "[reward] (fn)"]),  # the newcomer's mistake
        ("calc", "[reward]\ngroup = true\n", ["[reward] (group)"]),
        ("env", ENV + REWARD, ["[reward] (fn) is read by task 'data', not by task 'env'"]),
        ("data", DATA + GYM, ["[reasoning_gym] (datasets)"]),
        ("data", DATA + VERIFIERS, ["[verifiers] (taskset)"]),
        ("verifiers", VERIFIERS + DATA, ["[data] (train_files) is read by task 'data' or 'env'"]),
        ("reasoning_gym:basic_arithmetic", GYM + ENV, ["[environment] (cls) is read by task 'env'"]),
        ("arithmetic", GYM, ["[reasoning_gym] (datasets) is read by task 'reasoning_gym'"]),
        ("pkg.module:factory", DATA, ["not by task 'pkg.module:factory'"]),
    ],
)
def test_a_table_the_task_does_not_read_is_refused_by_name(tmp_path, task, tables, refused):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, f'task = "{task}"\n' + tables)
    for part in refused:
        assert part in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("task", "tables"),
    [
        ("data", DATA + REWARD),
        ("env", DATA + ENV),
        ("reasoning_gym", GYM),
        ("reasoning_gym:basic_arithmetic", GYM),
        ("verifiers", VERIFIERS),
        ("calc", "[reward]\noverlong_buffer = 8\noverlong_penalty = 0.5\n"),  # shaping: every task
    ],
)
def test_tables_the_task_reads_are_accepted(tmp_path, task, tables):
    assert _load(tmp_path, f'task = "{task}"\n' + tables).task == task


def test_keys_at_their_defaults_are_not_a_setting(tmp_path):
    """A resolved recipe (a run's config.toml) writes every table in full, defaults included."""
    assert (
        _load(tmp_path, 'task = "calc"\n[data]\neval_fraction = 0.1\nprompt_key = "prompt"\n').task == "calc"
    )


@pytest.mark.parametrize(
    ("tables", "inferred"),
    [
        (DATA, "data"),
        (REWARD, "data"),
        (DATA + REWARD, "data"),
        (DATA + ENV, "env"),
        (ENV, "env"),
        (GYM, "reasoning_gym"),
        (VERIFIERS, "verifiers"),
    ],
)
def test_a_recipe_without_task_gets_the_one_its_tables_name_and_says_so(tmp_path, caplog, tables, inferred):
    with caplog.at_level(logging.INFO, logger="loong.config"):
        assert _load(tmp_path, tables).task == inferred
    assert f"task = {inferred!r} (inferred from [" in caplog.text


@pytest.mark.parametrize(
    ("tables", "why"),
    [
        ("", "it sets none of [data], [environment], [reasoning_gym], [verifiers]"),
        (DATA + GYM, "its tables ([data], [reasoning_gym]) name no one task"),
        (ENV + REWARD, "its tables ([environment], [reward]) name no one task"),
    ],
)
def test_a_recipe_without_task_and_nothing_to_infer_it_from_is_refused(tmp_path, tables, why):
    with pytest.raises(ConfigError, match=r"recipe\.toml: the recipe sets no task") as e:
        _load(tmp_path, tables)
    assert why in str(e.value)


def test_the_python_apis_task_is_what_the_tables_are_checked_against(tmp_path):
    """``loong_train.api.train(recipe, rows=...)`` trains a data task made in code."""
    assert _load(tmp_path, 'task = "calc"\n' + DATA, task="data").task == "calc"  # the API replaces it
    with pytest.raises(ConfigError, match=r"\[verifiers\] \(taskset\).*not by task 'data'"):
        _load(tmp_path, 'task = "calc"\n' + VERIFIERS, task="data")
