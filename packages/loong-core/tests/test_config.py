"""Tests for loong_core.config: loading, overrides, error messages and the TOML writer."""

from __future__ import annotations

import enum
import math
import pathlib
import tomllib
from typing import Annotated, Literal

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from loong_core.config import ConfigError, apply_override, dump_toml, load_config


class Engine(enum.StrEnum):
    EMBEDDED = "embedded"
    SGLANG = "sglang"


class Optim(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lr: float = 1e-3
    betas: list[float] = msgspec.field(default_factory=lambda: [0.9, 0.999])


class Train(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    batch_size: int = 8
    lr: float = 1e-4
    optim: Optim = msgspec.field(default_factory=Optim)
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] = 1
    mini_batches: int = 1

    def __post_init__(self) -> None:
        if self.batch_size % self.mini_batches:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by mini_batches {self.mini_batches}"
            )


class Teacher(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    tags: list[str] = []
    weight: float = 1.0


class Rollout(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    engine: Engine = Engine.EMBEDDED
    dtype: Literal["float32", "bfloat16"] = "float32"
    sampling: dict[str, float] = {}


class Recipe(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    seed: int = 0
    use_teacher: bool = False
    note: str | None = None
    train: Train = msgspec.field(default_factory=Train)
    rollout: Rollout = msgspec.field(default_factory=Rollout)
    teachers: list[Teacher] = []


GOOD = """
name = "tiny-grpo"
seed = 3

[train]
batch_size = 16
lr = 2e-5

[train.optim]
lr = 0.5

[[teachers]]
name = "math"
tags = ["math", "gsm8k"]

[[teachers]]
name = "code"
weight = 0.5
"""


def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def load_error(source: str | dict, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, Recipe, overrides)
    return str(info.value)


# ------------------------------------------------------------------------------------------- loading


def test_good_file_loads_with_nested_defaults(tmp_path: pathlib.Path) -> None:
    recipe = load_config(write(tmp_path, GOOD), Recipe)
    assert recipe.name == "tiny-grpo" and recipe.seed == 3
    assert recipe.train.batch_size == 16 and recipe.train.lr == 2e-5
    assert recipe.train.optim == Optim(lr=0.5, betas=[0.9, 0.999])  # betas from the default
    assert recipe.train.max_staleness == 1
    assert recipe.rollout == Rollout()  # whole table absent -> defaults
    assert recipe.teachers == [Teacher(name="math", tags=["math", "gsm8k"]), Teacher(name="code", weight=0.5)]


def test_str_path_and_dict_sources(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, GOOD)
    assert load_config(str(path), Recipe) == load_config(path, Recipe)
    data = {"name": "d", "train": {"lr": 1}}
    recipe = load_config(data, Recipe, ["train.lr=2.0"])
    assert recipe.train.lr == 2.0 and isinstance(recipe.train.lr, float)
    assert data == {"name": "d", "train": {"lr": 1}}  # the caller's dict is untouched


def test_enum_and_literal_fields() -> None:
    recipe = load_config({"name": "x", "rollout": {"engine": "sglang", "dtype": "bfloat16"}}, Recipe)
    assert recipe.rollout.engine is Engine.SGLANG and recipe.rollout.dtype == "bfloat16"


# ------------------------------------------------------------------------------------------- errors


def test_bad_toml_names_file_and_line(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, 'name = "x"\n\n[train]\nlr = = 3\n')
    msg = load_error(str(path))
    assert msg.startswith(f"could not parse {path}: ")
    assert "line 4" in msg


def test_missing_file() -> None:
    assert "could not read config file" in load_error("/nonexistent/recipe.toml")


def test_wrong_type_names_dotted_key_expected_type_and_value() -> None:
    msg = load_error({"name": "x", "train": {"lr": "abc"}})
    assert msg == "config key 'train.lr': expected float, got str ('abc')"


def test_wrong_type_deep_and_in_arrays() -> None:
    assert load_error({"name": "x", "train": {"optim": {"betas": [0.9, "b"]}}}) == (
        "config key 'train.optim.betas[1]': expected float, got str ('b')"
    )
    assert load_error({"name": "x", "teachers": [{"name": "a"}, {"name": 7}]}) == (
        "config key 'teachers[1].name': expected str, got int (7)"
    )
    assert load_error({"name": "x", "train": 5}) == "config key 'train': expected table, got int (5)"
    assert (
        load_error({"name": "x", "use_teacher": 1}) == "config key 'use_teacher': expected bool, got int (1)"
    )


def test_constraint_and_choice_errors() -> None:
    assert load_error({"name": "x", "train": {"max_staleness": -1}}) == (
        "config key 'train.max_staleness': expected int >= 0, got -1"
    )
    assert load_error({"name": "x", "rollout": {"engine": "vllm"}}) == (
        "config key 'rollout.engine': invalid value 'vllm' (expected one of: 'embedded', 'sglang')"
    )
    assert "expected one of: 'bfloat16', 'float32'" in load_error({"name": "x", "rollout": {"dtype": "fp8"}})


def test_unknown_key_lists_known_keys_of_its_table() -> None:
    msg = load_error({"name": "x", "train": {"lrr": 1e-4}})
    assert msg == (
        "unknown config key 'train.lrr' (did you mean 'lr'? known keys in [train]: "
        "batch_size, lr, max_staleness, mini_batches, optim)"
    )
    msg = load_error({"name": "x", "teachers": [{"name": "a", "wieght": 2.0}]})
    assert msg.startswith("unknown config key 'teachers[0].wieght' (did you mean 'weight'?")
    assert "known keys in [teachers[0]]: name, tags, weight" in msg


def test_unknown_top_level_key() -> None:
    msg = load_error({"name": "x", "zzz": 1})
    assert msg == (
        "unknown config key 'zzz' (known keys at top level: "
        "name, note, rollout, seed, teachers, train, use_teacher)"
    )


def test_missing_required_key() -> None:
    assert load_error({}) == "missing required config key 'name'"
    assert load_error({"name": "x", "teachers": [{}]}) == "missing required config key 'teachers[0].name'"


def test_post_init_value_error_becomes_config_error() -> None:
    msg = load_error({"name": "x", "train": {"batch_size": 10, "mini_batches": 4}})
    assert msg == "invalid config [train]: batch_size 10 is not divisible by mini_batches 4"


def test_bad_override_syntax() -> None:
    assert load_error({"name": "x"}, ("train.lr",)) == "bad override 'train.lr': expected 'dotted.key=value'"
    assert "bad override 'train..lr=1'" in load_error({"name": "x"}, ("train..lr=1",))
    assert "config key 'name' is not a table" in load_error({"name": "x"}, ("name.first=1",))


def test_error_from_override_names_key() -> None:
    assert load_error({"name": "x"}, ("train.batch_size=abc",)) == (
        "config key 'train.batch_size': expected int, got str ('abc')"
    )


# ----------------------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("seed=42", 42),
        ("seed = 7", 7),
        ("train.lr=1e-4", 1e-4),
        ("train.lr=3", 3),
        ("use_teacher=true", True),
        ("name=plain words", "plain words"),
        ('name="quoted=x"', "quoted=x"),
        ("name=a=b", "a=b"),
        ("train.optim.betas=[0.5, 0.6]", [0.5, 0.6]),
        ("rollout.sampling={ temperature = 0.7 }", {"temperature": 0.7}),
    ],
)
def test_override_values_are_parsed_as_toml(override: str, expected: object) -> None:
    data: dict = {"train": {"optim": {}}}
    apply_override(data, override)
    key = override.partition("=")[0].strip().split(".")
    value = data
    for part in key:
        value = value[part]
    assert value == expected and type(value) is type(expected)


def test_overrides_apply_in_order_and_create_tables(tmp_path: pathlib.Path) -> None:
    recipe = load_config(
        write(tmp_path, GOOD),
        Recipe,
        ["seed=1", "seed=2", "train.optim.lr=0.25", "rollout.engine=sglang", "rollout.sampling.top_p=0.9"],
    )
    assert recipe.seed == 2
    assert recipe.train.optim.lr == 0.25 and recipe.train.batch_size == 16  # siblings kept
    assert recipe.rollout.engine is Engine.SGLANG  # [rollout] did not exist in the file
    assert recipe.rollout.sampling == {"top_p": 0.9}


# -------------------------------------------------------------------------------------- dump / load


def test_dump_round_trip_full(tmp_path: pathlib.Path) -> None:
    recipe = Recipe(
        name='quote " back \\ tab \t newline \n del \x7f ünï',
        seed=-5,
        use_teacher=True,
        train=Train(batch_size=12, lr=3e-7, optim=Optim(lr=math.inf, betas=[]), mini_batches=3),
        rollout=Rollout(engine=Engine.SGLANG, sampling={"temperature": 0.7, "top p": 1.0}),
        teachers=[Teacher(name="a", tags=["x", "y"]), Teacher(name="b", weight=0.5)],
    )
    text = dump_toml(recipe)
    assert "note" not in text  # None is skipped
    assert "[[teachers]]" in text and "[train.optim]" in text
    assert load_config(tomllib.loads(text), Recipe) == recipe
    path = tmp_path / "config.toml"
    path.write_text(text)
    assert load_config(path, Recipe) == recipe


def test_dump_round_trip_defaults_and_empty_tables() -> None:
    recipe = Recipe(name="d")
    assert load_config(tomllib.loads(dump_toml(recipe)), Recipe) == recipe


class Scalars(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    text: str
    number: float
    count: int
    flags: list[bool]
    labels: dict[str, str]


@given(
    st.builds(
        Scalars,
        text=st.text(),
        number=st.floats(allow_nan=False),
        count=st.integers(min_value=-(2**63), max_value=2**63 - 1),
        flags=st.lists(st.booleans(), max_size=4),
        labels=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4),
    )
)
@example(Scalars(text="", number=0.0, count=0, flags=[], labels={"0\n": ""}))  # a key ending in a newline
def test_dump_round_trip_property(value: Scalars) -> None:
    assert load_config(tomllib.loads(dump_toml(value)), Scalars) == value


class _Small(
    msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="small"
):
    size: int = 1


class _Large(
    msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, tag_field="type", tag="large"
):
    size: int = 8
    shards: int = 2


class _Picks(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    engine: _Small | _Large = _Small()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"engine": {"type": "huge"}}, "config key 'engine.type': invalid value 'huge' (expected one of: 'small', 'large')"),
        ({"engine": {"size": 2}}, "missing required config key 'engine.type' (expected one of: 'small', 'large')"),
        ({"engine": {"type": "small", "shards": 4}}, "unknown config key 'engine.shards' (type 'large' has it, this is 'small'; known keys in [engine]: size, type)"),
        ({"engine": {"type": "large", "shard": 4}}, "unknown config key 'engine.shard' (did you mean 'shards'? known keys in [engine]: shards, size, type)"),
    ],
)  # fmt: skip
def test_a_tagged_union_table_names_its_types_and_the_keys_of_the_chosen_one(data, message):
    with pytest.raises(ConfigError) as err:
        load_config(data, _Picks)
    assert str(err.value) == message
    assert load_config({"engine": {"type": "large", "shards": 4}}, _Picks).engine == _Large(shards=4)
