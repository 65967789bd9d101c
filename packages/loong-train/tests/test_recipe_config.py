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


def test_a_table_without_type_is_of_the_default_type():
    r = load_recipe(
        "tiny-calc-agent", ["rollout.engine.dtype=bfloat16", "train.backend.max_tokens_per_micro_batch=512"]
    )
    assert r.rollout.engine == EmbeddedEngineConfig(dtype="bfloat16")
    assert r.train.backend == TorchBackendConfig(max_tokens_per_micro_batch=512)
    with pytest.raises(
        ConfigError, match=r"rollout\.engine\.dtype.*'float16'.*'auto', 'bfloat16', 'float32'"
    ):
        load_recipe("tiny-calc-agent", ["rollout.engine.dtype=float16"])


def test_an_override_of_type_replaces_the_recipes_table():
    """smollm2-arithmetic's [rollout.engine] sets the embedded engine's dtype: switching the type
    drops it, and a key given for the new type on the command line is kept."""
    assert load_recipe("smollm2-arithmetic").rollout.engine == EmbeddedEngineConfig(dtype="auto")
    sglang = ["rollout.engine.type=sglang", "train.borrow_idle_threads=false"]  # an SGLang engine lends none
    r = load_recipe("smollm2-arithmetic", [*sglang, "rollout.engine.port_base=31000"])
    assert r.rollout.engine == SGLangEngineConfig(port_base=31000)
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.engine\.dtype'"):
        load_recipe("smollm2-arithmetic", [*sglang, "rollout.engine.dtype=bfloat16"])


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


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["train.backend.type=fsdp", "train.backend.tp=2"], r"'train\.backend\.tp' \(type 'megatron' has it"),
        (["train.backend.type=megatron", "train.backend.tp=2", "train.backend.gpus=1"], r"one GPU per rank"),
        (["train.backend.type=megatron", "train.backend.placement=WIDE"], r"placement"),
        (["train.backend.type=megatron", "train.backend.gpus=2"], r"one GPU per rank"),
    ],
)
def test_parallel_layouts_a_backend_cannot_run_are_refused(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe("tiny-calc-agent", sets)


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


# -- cross-table rules (loong_train.recipe_checks) ----------------------------------------------

_SGLANG_DIRECT = ["rollout.engine.type='sglang'", "rollout.engine.weights='direct'"]
_MEGATRON = ["train.backend.type='megatron'"]
RULE_CASES = {
    "known_task": ("tiny-calc-agent", ["task='no-such-task'"], r"no-such-task"),
    "transport_loong_drives": ("tiny-calc-agent", ["transport.type='nccl'"], r"drives type 'shm'"),
    "embedded_overlap_needs_whitebox": (
        "tiny-calc-agent",
        ["agent.type='blackbox'", "rollout.engine.partial='continue'"],
        r"rollout.engine.partial = 'continue' needs agent.type = 'whitebox'",
    ),
    "overlong_buffer_within_budget": (
        "tiny-calc-agent",
        ["reward.overlong_buffer=100000"],
        r"reward.overlong_buffer = 100000 must be below the episode budget",
    ),
    "group_reward_needs_whitebox": (
        "tiny-calc-agent",
        ["task='data'", "reward.group=true", "reward.fn='r.py:f'", "agent.type='blackbox'"],
        r"reward.group = true scores the final turns of white-box episodes",
    ),
    "entropy_bonus_needs_torch": (
        "tiny-calc-agent",
        ["loss.entropy_coef=0.1", *_MEGATRON],
        r"loss.entropy_coef = 0.1 is a torch-backend option",
    ),
    "gpu_weight_push_needs_trainer_gpu": (
        "tiny-calc-agent",
        [*_SGLANG_DIRECT, "rollout.engine.update_backend='nccl'"],
        r'update_backend = "nccl": the trainer sends from its GPU, but train.backend.gpus = 0',
    ),
    "adapter_updates_go_through_workers": (
        "tiny-calc-agent",
        [*_SGLANG_DIRECT, "rollout.engine.update_backend='gloo'", "train.lora.rank=4"],
        r'train.lora.sync = "adapter" has each rollout worker load the adapters into its server',
    ),
    "cuda_ipc_needs_real_sglang": (
        "tiny-calc-agent",
        [*_SGLANG_DIRECT, "rollout.engine.update_backend='tensor'", *_MEGATRON, "train.backend.gpus=1"],
        r"hands over CUDA IPC handles, which launcher = 'loong' \(a CPU server\) cannot open",
    ),
    "groups_of_two_for_task_reward": (
        "tiny-calc-agent",
        ["rollout.group_size=1"],
        r"rollout.group_size = 1: .* a group needs at least 2",
    ),
    "dense_distillation_needs_torch": (
        "tiny-multi-teacher-opd",
        _MEGATRON,
        r'opd.objective = "jsd" is a torch-backend option',
    ),
    "borrowed_threads_from_embedded_engines": (
        "tiny-calc-agent",
        ["train.borrow_idle_threads=true", "rollout.engine.type='sglang'"],
        r"borrows the CPU threads of embedded engines; rollout.engine.type = 'sglang' lends none",
    ),
}


def test_every_cross_table_rule_has_a_case():
    from loong_train import recipe_checks

    assert [rule.__name__ for rule in recipe_checks.RULES] == list(RULE_CASES)


@pytest.mark.parametrize("rule", list(RULE_CASES))
def test_each_cross_table_rule_refuses_its_recipe_and_only_that_rule_fires(rule):
    from loong_train import recipe_checks

    name, sets, message = RULE_CASES[rule]
    with pytest.raises(ConfigError, match=message):
        load_recipe(name, sets)
    # the rule alone finds it: the same settings minus the rule's own are consistent
    base = load_recipe(name)
    assert recipe_checks.problems(base) == []
    fired = [r.__name__ for r in recipe_checks.RULES if r(_unchecked(name, sets))]
    assert fired == [rule]


def _unchecked(name: str, sets: list[str]):
    """The recipe with ``sets`` applied, built without running the cross-table rules."""
    from unittest import mock

    from loong_train import recipe_checks

    with mock.patch.object(recipe_checks, "RULES", ()):
        return load_recipe(name, sets)
