"""A recipe: every knob of a run, as typed msgspec Structs loaded from TOML.

Recipes that ship with Loong live in ``loong_train/recipes/<name>.toml`` and are addressed by
name; any other TOML path works too. ``--set key=value`` overrides a dotted key.

The :class:`Recipe` composes the tables; each component's table sits next to the component and
every backend choice is a table with a ``type``:

- ``[rollout.engine]``: :mod:`loong_train.engines.config` (``embedded``, ``sglang``);
- ``[train.backend]``: :mod:`loong_train.backends.config` (``torch``, ``megatron``);
- ``[agent]``: :mod:`loong_train.workers.agent` (``whitebox``, ``blackbox``);
- ``[transport]``: :class:`loong_transfermesh.TransportConfig` (``shm``, ...);
- ``[loss]``, ``[opd]``: :mod:`loong_train.algo.config`;
- ``[curriculum]``: :mod:`loong_train.curriculum`.

Loading a recipe imports no torch. A key from an older layout is an error naming its new place
(:data:`RENAMED`).
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import msgspec

from loong_core.config import ConfigError, apply_override, load_config
from loong_train import recipe_checks
from loong_train.algo.config import LossConfig, OPDConfig
from loong_train.backends.config import (
    BackendConfig,
    FsdpBackendConfig,
    LoraConfig,
    MegatronBackendConfig,
    TorchBackendConfig,
)
from loong_train.curriculum import CurriculumConfig
from loong_train.engines.config import EmbeddedEngineConfig, EngineConfig
from loong_train.tasks import TaskTables
from loong_train.tasks.config import (
    DataConfig,
    EnvConfig,
    ReasoningGymConfig,
    RewardConfig,
    VerifiersConfig,
    get_dotted,
)
from loong_train.workers.agent import AgentConfig, WhiteboxAgentConfig
from loong_transfermesh.config import TransportConfig

__all__ = [
    "RENAMED",
    "EvalConfig",
    "LogConfig",
    "ModelConfig",
    "Recipe",
    "RolloutConfig",
    "TrainConfig",
    "WarmstartConfig",
    "load_recipe",
    "recipe_names",
]

log = logging.getLogger("loong.config")


def _at_least(section: msgspec.Struct, **minimums: int) -> None:
    for name, low in minimums.items():
        if getattr(section, name) < low:
            raise ValueError(f"{name} must be >= {low}, got {getattr(section, name)}")


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class ModelConfig(_Section):
    """An HF checkpoint directory, or (``path = ""``) a tiny Qwen3 built from these sizes with a
    ``tokenizer`` built locally: ``"char"`` (one token per character), ``"bpe"`` (byte-level BPE
    trained on the task's text to at most ``bpe_vocab_size`` tokens) or ``"bpe-bare"`` (the same
    with a space before a word a token of its own; :mod:`loong_train.tiny.tokenizer`).

    ``trust_remote_code``: run a checkpoint whose ``config.json`` names its own modeling code
    (``auto_map``), as ``transformers`` does with the same switch; off, such a checkpoint is refused.
    """

    path: str = ""
    trust_remote_code: bool = False
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    tokenizer: Literal["char", "bpe", "bpe-bare"] = "char"
    bpe_vocab_size: int = 512


class WarmstartConfig(_Section):
    """Supervised warm start on the task's demonstrations (``demonstration(item)``: the calculator's
    expert episodes, a data row's reference answer, an environment row's expert turns), stopped early once the *sampled*
    (temperature 1) success on probe tasks reaches ``target_success`` (with ``target_per_domain``:
    the success of each domain of a composite task, so the fastest-learned domain does not end it;
    ``target_domains`` narrows that to the domains it names).

    ``label_smoothing`` spreads that much target mass over the vocabulary: the policy learns the
    skill (its greedy answers become right) while its temperature-1 samples still fail often
    enough for GRPO groups to carry signal, like a pretrained model whose sampling RL sharpens.
    """

    steps: int = 0
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    label_smoothing: float = 0.0
    target_success: float = 0.15
    target_per_domain: bool = False  # true: every tags.domain of the probe set must reach the target
    eval_every: int = 100
    eval_tasks: int = 128
    threads: int = 0  # torch threads of the warm start (it runs before any actor); 0: the recipe's
    target_domains: list[
        str
    ] = []  # with target_per_domain: the domains that must reach the target (empty: all)

    def __post_init__(self) -> None:
        if self.target_domains and not self.target_per_domain:
            raise ValueError(
                f"warmstart.target_domains = {self.target_domains} names domains for warmstart.target_per_domain, "
                "which is false: set target_per_domain = true"
            )


class RolloutConfig(_Section):
    """The ``[rollout]`` table: rollout workers, sampling and episode limits.

    ``engine``: the ``[rollout.engine]`` table (:mod:`loong_train.engines.config`).
    ``max_restarts``: how often Ray restarts a rollout worker whose process died (its lost
    groups are issued again, see :mod:`loong_train.pipeline`); 0 = a dead worker ends the run.
    ``tool_latency_ms``: a simulated wait after every tool call of a white-box episode, lognormal
    with this median and ``tool_latency_sigma`` (:class:`loong_agentflow.Latency`), spent idle as
    a sandbox or web API would keep an agent waiting; 0 (the default): none. A workload knob for
    benchmarks (``tools/bench_async.py``); episodes then finish in an order that depends on timing."""

    workers: int = 1
    engine: EngineConfig = EmbeddedEngineConfig()
    max_restarts: int = 3
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    max_turns: int = 3
    max_model_tokens: int = 160
    episode_timeout_s: float = 60.0
    tool_latency_ms: float = 0.0
    tool_latency_sigma: float = 0.5

    def __post_init__(self) -> None:
        _at_least(self, workers=1, group_size=1, max_new_tokens=1, max_turns=1, max_model_tokens=1)
        _at_least(self, max_restarts=0)
        if self.tool_latency_ms < 0 or self.tool_latency_sigma < 0:
            raise ValueError(
                f"tool_latency_ms and tool_latency_sigma must be >= 0 (0 ms: no latency), got "
                f"{self.tool_latency_ms} and {self.tool_latency_sigma}"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_p != 1.0:
            raise ValueError(
                f"top_p must be 1.0 for now (the trainer recomputes untruncated logprobs), got {self.top_p}"
            )


class TrainConfig(_Section):
    """The ``[train]`` table: steps, batches, the staleness bound, the optimizer, checkpoints.

    ``backend``: the ``[train.backend]`` table (:mod:`loong_train.backends.config`); ``lora``:
    the ``[train.lora]`` table (adapters instead of the whole model; the torch backend).
    ``checkpoint_every``: write a resumable checkpoint every that many steps (0: only after the
    last step); the newest ``keep_checkpoints`` are kept (:mod:`loong_train.run.checkpoint`).
    ``threads``: the trainer's torch threads (and the CPUs Ray reserves for it); 0: the recipe's
    ``threads``. More than the rollout workers' lets training use the cores an engine leaves
    idle while its episodes wait on tools. ``borrow_idle_threads``: the trainer also runs on the
    threads of the rollout workers on its node whenever their embedded engines have nothing to
    run, and gives them back as soon as they do (:mod:`loong_train.cores`; the torch backend;
    thread counts then follow timing, so a fixed seed reproduces a run only up to rounding)."""

    steps: int = 100
    batch_groups: int = 16
    max_staleness: int = 1
    lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    backend: BackendConfig = TorchBackendConfig()
    lora: LoraConfig = LoraConfig()
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    threads: int = 0
    borrow_idle_threads: bool = False

    def __post_init__(self) -> None:
        _at_least(self, checkpoint_every=0, keep_checkpoints=1, threads=0)
        _at_least(self, steps=1, batch_groups=1, max_staleness=0, warmup_steps=0)
        if self.lora.enabled and not isinstance(self.backend, TorchBackendConfig):
            raise ValueError(
                f"lora.rank = {self.lora.rank} trains adapters on the torch backend only; "
                f"backend.type = {self.backend.type!r} trains the whole model (set lora.rank = 0, "
                "or backend.type = 'torch')"
            )


class EvalConfig(_Section):
    """The ``[eval]`` table: ``num_tasks`` held-out items, evaluated at version 0, every
    ``every`` steps and after the last (:mod:`loong_train.evaluator`)."""

    every: int = 10
    num_tasks: int = 128

    def __post_init__(self) -> None:
        _at_least(self, every=1, num_tasks=1)


class LogConfig(_Section):
    """The ``[log]`` table: where step records go besides ``metrics.jsonl`` (:mod:`loong_train.run.loggers`).

    - ``loggers``: any of ``"tensorboard"`` (event files in ``<run>/tensorboard``; the
      ``loong-train[tensorboard]`` extra) and ``"wandb"`` (Weights & Biases; ``loong-train[wandb]``).
    - ``wandb_project``; ``wandb_mode``: ``"offline"`` (the default: the run is written under
      ``<run>/wandb``, to upload later with ``wandb sync``) or ``"online"``.
    """

    loggers: list[Literal["tensorboard", "wandb"]] = []
    wandb_project: str = "loong"
    wandb_mode: Literal["offline", "online"] = "offline"


class Recipe(_Section):
    name: str
    task: str = "calc"
    seed: int = 0
    threads: int = 1
    model: ModelConfig = ModelConfig()
    warmstart: WarmstartConfig = WarmstartConfig()
    rollout: RolloutConfig = RolloutConfig()
    train: TrainConfig = TrainConfig()
    loss: LossConfig = LossConfig()
    eval: EvalConfig = EvalConfig()
    opd: OPDConfig = OPDConfig()

    @property
    def trainer_threads(self) -> int:
        """The trainer's torch threads: ``train.threads``, or the recipe's ``threads``."""
        return self.train.threads or self.threads

    @property
    def trainer_cpus(self) -> int:
        """CPUs the trainer reserves: its threads, on each rank of an ``fsdp`` or ``megatron`` backend."""
        b = self.train.backend
        if isinstance(b, FsdpBackendConfig):
            return self.trainer_threads * b.ranks
        if isinstance(b, MegatronBackendConfig):
            return self.trainer_threads * b.world
        return self.trainer_threads

    agent: AgentConfig = WhiteboxAgentConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    reasoning_gym: ReasoningGymConfig = ReasoningGymConfig()
    environment: EnvConfig = EnvConfig()
    verifiers: VerifiersConfig = VerifiersConfig()
    transport: TransportConfig = TransportConfig()
    log: LogConfig = LogConfig()
    ray_address: str = ""

    @property
    def task_tables(self) -> TaskTables:
        """The tables the recipe's task is built from (:func:`loong_train.tasks.build_task`)."""
        return TaskTables(
            data=self.data,
            reward=self.reward,
            reasoning_gym=self.reasoning_gym,
            environment=self.environment,
            verifiers=self.verifiers,
        )

    def __post_init__(self) -> None:
        for rule in recipe_checks.RULES:  # settings valid alone but not together
            if problem := rule(self):
                raise ValueError(problem)


_MEGATRON_KEYS = ("tp", "pp", "dp", "micro_batch_rows", "gpus")
RENAMED: dict[str, str] = {
    "sglang": "the [rollout.engine] table, with type = 'sglang'",
    "rollout.partial": "rollout.engine.partial (an embedded-engine setting)",
    "agent.kind": "agent.type",
    **{f"train.{k}": f"train.backend.{k}, with train.backend.type = 'megatron'" for k in _MEGATRON_KEYS},
}
"""Keys of the earlier recipe layout and where they live now; a recipe using one is refused."""
_NOW_TABLES = ("rollout.engine", "train.backend")


def _renamed_keys(data: dict[str, Any]) -> list[str]:
    """What is wrong with the keys of ``data`` (a parsed recipe) that moved, naming their new place."""
    problems = [f"config key '{old}' moved to {new}" for old, new in RENAMED.items() if get_dotted(data, old)]
    for table in _NOW_TABLES:
        if isinstance(value := get_dotted(data, table), str):
            problems.append(
                f"config key '{table}' is now a table: write {table}.type = {value!r} "
                f"(in TOML: [{table}] type = {value!r}; on the command line: --set {table}.type={value})"
            )
    return problems


def _default_types(data: dict[str, Any]) -> None:
    """A ``[rollout.engine]`` or ``[train.backend]`` table that leaves out ``type`` is of the
    default type (``--set rollout.engine.dtype=bfloat16`` alone sets the embedded engine's dtype)."""
    defaults = {"rollout.engine": RolloutConfig().engine, "train.backend": TrainConfig().backend}
    for table, default in defaults.items():
        if isinstance(value := get_dotted(data, table), dict):
            value.setdefault("type", default.type)


def _keys_of_a_replaced_type(
    data: dict[str, Any], recipe_tables: dict[str, dict], overrides: Sequence[str], source: str
) -> None:
    """An override that changes a table's ``type`` (``--set rollout.engine.type=sglang``) replaces
    the recipe's table: the recipe's other keys there belonged to its type and are dropped (logged),
    unless an override set them too."""
    overridden = {o.partition("=")[0].strip() for o in overrides}
    for table, before in recipe_tables.items():
        now = get_dotted(data, table)
        if not isinstance(now, dict) or now.get("type") == before.get("type"):
            continue
        for key in before.keys() - {"type"} - {k.removeprefix(f"{table}.") for k in overridden}:
            del now[key]
            log.info(
                "%s: %s.%s applies to type %r, not %r: dropped",
                source,
                table,
                key,
                before["type"],
                now["type"],
            )


def recipe_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml")
        for p in resources.files("loong_train.recipes").iterdir()
        if p.name.endswith(".toml")
    )


def load_recipe(
    name_or_path: str, overrides: list[str] | tuple[str, ...] = (), task: str | None = None
) -> Recipe:
    """Load a shipped recipe by name (names may hold dots: ``qwen3-0.6b-...``), or a TOML file by
    path. ``task``: the kind of task the caller trains instead of the recipe's own (the Python
    API's task made in code: ``"data"``, ``"env"``, or a factory's name), whose tables are checked."""
    path = Path(name_or_path)
    if name_or_path in recipe_names():
        path = Path(str(resources.files("loong_train.recipes") / f"{name_or_path}.toml"))
    elif path.suffix != ".toml" and not path.exists():
        raise ConfigError(
            f"unknown recipe {name_or_path!r} (shipped recipes: {', '.join(recipe_names())}; "
            "or give a path to a .toml file)"
        )
    elif not path.exists():
        raise ConfigError(f"recipe file {path} does not exist")
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"could not parse {path}: {exc}") from exc
    _default_types(data)
    recipe_tables = {t: dict(v) for t in _NOW_TABLES if isinstance(v := get_dotted(data, t), dict)}
    for override in overrides:
        apply_override(data, override)
    if problems := _renamed_keys(data):
        raise ConfigError(f"{path.name}: " + "; ".join(problems))
    _default_types(data)
    _keys_of_a_replaced_type(data, recipe_tables, overrides, path.name)
    _task_and_its_tables(data, path.name, task)
    if isinstance(sandbox := data.get("agent", {}).get("sandbox"), dict) and "wall_s" in sandbox:
        raise ConfigError(
            f"agent.sandbox.wall_s = {sandbox['wall_s']}: a black-box episode's wall clock is "
            "rollout.episode_timeout_s; set that instead"
        )
    return _absolute_paths(load_config(data, Recipe))


def _task_and_its_tables(data: dict[str, Any], source: str, task: str | None) -> None:
    """Set ``task`` where the recipe leaves it out and its tables name one (logged), and refuse
    task tables the task (or the caller's ``task``) never reads (:mod:`loong_train.recipe_checks`)."""
    if task is None and "task" not in data:
        try:
            data["task"], why = recipe_checks.infer_task(data)
        except ValueError as e:
            raise ConfigError(f"{source}: {e}") from e
        log.info("%s: task = %r (%s)", source, data["task"], why)
    task = data["task"] if task is None else task
    if isinstance(task, str) and (problems := recipe_checks.unread_tables(data, task)):
        raise ConfigError(f"{source}: " + "; ".join(problems))


def _absolute_paths(recipe: Recipe) -> Recipe:
    """Data files, a reward file, an environment file and a taskset file, relative to the directory the run starts
    in, made absolute: Ray workers may run in another directory."""
    d, replace = recipe.data, msgspec.structs.replace
    data = replace(
        d,
        train_files=[str(Path(f).absolute()) for f in d.train_files],
        eval_files=[str(Path(f).absolute()) for f in d.eval_files],
        dataset=str(Path(d.dataset).absolute()) if d.dataset and Path(d.dataset).is_dir() else d.dataset,
    )
    reward = replace(recipe.reward, fn=_absolute_spec(recipe.reward.fn))
    env = replace(recipe.environment, cls=_absolute_spec(recipe.environment.cls))
    taskset = replace(recipe.verifiers, taskset=_absolute_spec(recipe.verifiers.taskset))
    return replace(recipe, data=data, reward=reward, environment=env, verifiers=taskset)


def _absolute_spec(spec: str) -> str:
    """``"file.py:name"`` with the file's path made absolute; any other spec as it is."""
    where, _, name = spec.rpartition(":")
    return f"{Path(where).absolute()}:{name}" if where.endswith(".py") else spec
