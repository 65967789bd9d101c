"""The ``[loss]`` recipe table: shipped defaults, validation messages, TOML round trip."""

import tomllib

import pytest

from loong_core.config import ConfigError, dump_toml, load_config
from loong_train.algo.config import LossConfig
from loong_train.config import Recipe, load_recipe


def test_shipped_recipe_uses_the_default_loss_with_dual_clip():
    assert load_recipe("tiny-calc-agent").loss == LossConfig(dual_clip=3.0)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("loss.dual_clip=0.5", "[loss]: dual_clip must be > 1"),
        ("loss.clip_eps=1.5", "[loss]: clip_eps must be in (0, 1)"),
        ("loss.agg_mode='seq-sum'", "'loss.agg_mode': invalid value 'seq-sum' (expected one of:"),
        ("loss.agg_mode='seq-mean-token-sum-norm'", "[loss]: norm_length must be > 0"),
        ("loss.kl_estimator='k4'", "'loss.kl_estimator': invalid value 'k4'"),
        ("loss.kl_coef=-1.0", "[loss]: kl_coef must be >= 0"),
        ("loss.tis_cap=2.0", "[loss]: tis_cap needs decoupled = true"),
        ("loss.mis_high=0.9", "[loss]: mis_low and mis_high must satisfy"),
        ("loss.mis_level='row'", "'loss.mis_level': invalid value 'row'"),
        ("loss.decoupled=3", "'loss.decoupled': expected bool, got int (3)"),
        ("loss.kl_coeff=0.1", "unknown config key 'loss.kl_coeff' (did you mean 'kl_coef'?"),
    ],
)
def test_bad_loss_settings_name_the_key_and_what_was_expected(override, message):
    with pytest.raises(ConfigError) as err:
        load_recipe("tiny-calc-agent", [override])
    assert message in str(err.value)


def test_loss_table_round_trips_through_toml_with_infinities():
    recipe = load_recipe(
        "tiny-calc-agent",
        ["loss.decoupled=true", "loss.tis_cap=2.0", "loss.mis_low=0.5", "loss.kl_coef=0.01"],
    )
    again = load_config(tomllib.loads(dump_toml(recipe)), Recipe)
    assert again == recipe and again.loss.mis_high == float("inf")
