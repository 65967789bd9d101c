"""The recipe layout: every backend choice is a table with a ``type``, an older key is refused with
its new place, and loading any recipe imports no torch."""

import subprocess
import sys

import pytest

from loong_core.config import ConfigError, dump_toml
from loong_train.backends.config import MegatronBackendConfig, TorchBackendConfig
from loong_train.config import RENAMED, Recipe, load_recipe
from loong_train.engines.config import EmbeddedEngineConfig, SGLangEngineConfig
from loong_train.workers.agent import BlackboxAgentConfig, WhiteboxAgentConfig


def test_defaults_are_the_cpu_choices():
    r = load_recipe("tiny-calc-agent")
    assert r.rollout.engine == EmbeddedEngineConfig(partial="off")
    assert r.train.backend == TorchBackendConfig()
    assert r.agent == WhiteboxAgentConfig()
    assert r.transport.type == "shm"


def test_type_picks_the_table_and_its_keys():
    r = load_recipe(
        "tiny-calc-agent",
        ["rollout.engine.type=sglang", "rollout.engine.port_base=31000", "agent.type=blackbox",
         "agent.max_concurrency=3", "train.backend.type=megatron", "train.backend.dp=2"],
    )  # fmt: skip
    assert r.rollout.engine == SGLangEngineConfig(port_base=31000)
    assert r.agent == BlackboxAgentConfig(max_concurrency=3)
    assert r.train.backend == MegatronBackendConfig(dp=2)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.engine.type=vllm", r"rollout\.engine.*'embedded', 'sglang'"),
        ("rollout.engine.port_base=1", r"unknown config key 'rollout\.engine\.port_base'"),
        ("agent.command=['x']", r"unknown config key 'agent\.command'"),
        ("rollout.engine.type=sglang", None),  # an sglang engine has no partial updates: fine
    ],
)
def test_a_key_of_another_type_is_unknown(override, message):
    if message is None:
        assert load_recipe("tiny-calc-agent", [override]).rollout.engine.partial == "off"
        return
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny-calc-agent", [override])


@pytest.mark.parametrize(
    ("override", "new"),
    [
        ("rollout.engine=sglang", "write rollout.engine.type = 'sglang'"),
        ("train.backend=megatron", "--set train.backend.type=megatron"),
        ("agent.kind=blackbox", "moved to agent.type"),
        ("rollout.partial=continue", "moved to rollout.engine.partial"),
        ("train.tp=2", "moved to train.backend.tp, with train.backend.type = 'megatron'"),
        ("train.gpus=1", "moved to train.backend.gpus"),
        ("sglang.port_base=1", r"moved to the \[rollout.engine\] table, with type = 'sglang'"),
    ],
)
def test_an_old_key_names_its_new_place(override, new):
    with pytest.raises(ConfigError, match=new):
        load_recipe("tiny-calc-agent", [override])


def test_an_old_recipe_file_lists_every_moved_key(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text('name = "x"\n[train]\nbackend = "megatron"\ntp = 2\n[agent]\nkind = "whitebox"\n')
    with pytest.raises(ConfigError) as err:
        load_recipe(str(old))
    message = str(err.value)
    assert message.startswith("old.toml: ")
    for key in ("'train.tp'", "'agent.kind'", "'train.backend' is now a table"):
        assert key in message
    assert set(RENAMED) >= {"train.tp", "agent.kind", "sglang"}


def test_a_resolved_recipe_round_trips_through_toml(tmp_path):
    sets = ["rollout.engine.type=sglang", "train.backend.type=megatron", "agent.type=blackbox"]
    recipe = load_recipe("tiny-calc-agent", sets)
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(recipe))
    assert load_recipe(str(path)) == recipe
    assert isinstance(recipe, Recipe)


def test_loading_every_recipe_and_listing_them_import_no_torch():
    code = (
        "import sys\n"
        "from loong_train.cli import main\n"
        "from loong_train.config import load_recipe, recipe_names\n"
        "assert main(['recipes']) == 0\n"
        "for name in recipe_names():\n"
        "    load_recipe(name)\n"
        "print(sorted(m for m in ('torch', 'ray', 'numpy', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"


def test_an_entropy_bonus_on_megatron_is_refused_naming_both_keys():
    from loong_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"entropy_coef = 0.1 is a torch-backend option.*'megatron'"):
        load_recipe("tiny-calc-agent", ["loss.entropy_coef=0.1", "train.backend.type=megatron"])


def test_direct_weights_over_nccl_need_a_trainer_gpu():
    sets = [
        "rollout.engine.type=sglang",
        "rollout.engine.weights=direct",
        "rollout.engine.update_backend=nccl",
    ]
    with pytest.raises(ConfigError, match=r"update_backend = \"nccl\".*train.backend.gpus = 0"):
        load_recipe("tiny-calc-agent", sets)
    assert load_recipe("tiny-calc-agent", sets[:2]).rollout.engine.weights == "direct"


def test_a_negative_tool_latency_is_refused():
    with pytest.raises(ConfigError, match="tool_latency_ms and tool_latency_sigma must be >= 0"):
        load_recipe("tiny-calc-agent", ["rollout.tool_latency_ms=-5"])
    assert load_recipe("tiny-calc-agent", ["rollout.tool_latency_ms=200"]).rollout.tool_latency_ms == 200


def test_tool_latency_with_a_black_box_agent_fails_before_any_work_naming_both_keys(tmp_path):
    """A black-box agent runs its own tools, so Loong's simulated latency could not apply."""
    from loong_train.controller import run

    recipe = load_recipe("tiny-calc-agent", ["agent.type=blackbox", "rollout.tool_latency_ms=100"])
    with pytest.raises(ConfigError) as err:
        run(recipe, tmp_path / "run", tmp_path / "cache")
    assert "rollout.tool_latency_ms = 100.0" in str(err.value) and "agent.type = 'blackbox'" in str(err.value)
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_the_trainer_may_have_threads_of_its_own():
    assert load_recipe("tiny-calc-agent").trainer_threads == 1
    assert load_recipe("tiny-calc-agent", ["threads=2"]).trainer_threads == 2
    assert load_recipe("tiny-calc-agent", ["train.threads=2"]).trainer_threads == 2
    with pytest.raises(ConfigError, match="threads"):
        load_recipe("tiny-calc-agent", ["train.threads=-1"])
