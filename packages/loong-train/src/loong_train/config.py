"""A recipe: every knob of a run, as typed msgspec Structs loaded from TOML.

Recipes that ship with Loong live in ``loong_train/recipes/<name>.toml`` and are addressed by
name; any other TOML path works too. ``--set key=value`` overrides a dotted key.
"""

from __future__ import annotations

import importlib.util
import math
from importlib import resources
from pathlib import Path
from typing import Literal

import msgspec

from loong_core.config import ConfigError, load_config
from loong_teacher import LocalTeacherConfig, TeacherManagerConfig
from loong_train.engines.sglang.rollout import SGLangRolloutConfig
from loong_train.tasks import task_problem
from loong_transfermesh import TransportConfig

__all__ = [
    "AgentConfig",
    "LossConfig",
    "ModelConfig",
    "OPDConfig",
    "Recipe",
    "RolloutConfig",
    "TeacherBuild",
    "TrainConfig",
    "WarmstartConfig",
    "load_recipe",
    "recipe_names",
]


def _at_least(section: msgspec.Struct, **minimums: int) -> None:
    for name, low in minimums.items():
        if getattr(section, name) < low:
            raise ValueError(f"{name} must be >= {low}, got {getattr(section, name)}")


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


class ModelConfig(_Section):
    """An HF checkpoint directory, or (``path = ""``) a tiny Qwen3 built from these sizes."""

    path: str = ""
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32


class WarmstartConfig(_Section):
    """Supervised warm start on synthetic demonstrations, stopped early once the *sampled*
    (temperature 1) success on probe tasks reaches ``target_success``.

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
    eval_every: int = 100
    eval_tasks: int = 128


class RolloutConfig(_Section):
    """``max_restarts``: how often Ray restarts a rollout worker whose process died (its lost
    groups are issued again, see :mod:`loong_train.pipeline`); 0 = a dead worker ends the run.
    ``engine``: ``"embedded"`` (torch, in the worker) or ``"sglang"`` (a supervised server per
    worker, configured by the ``[sglang]`` table: :mod:`loong_train.engines.sglang.rollout`).
    ``partial``: what a weight update does to a running rollout call (:mod:`loong_train.engines.embedded.host`):
    ``"off"`` waits for the call to end (no generation sees two versions), ``"continue"`` pauses
    the engine between decode steps, swaps and goes on (tokens keep per-token versions),
    ``"restart"`` also reruns, from the prompt, episodes older than the window can still train
    (embedded engine, white-box agent)."""

    workers: int = 1
    engine: Literal["embedded", "sglang"] = "embedded"
    partial: Literal["off", "continue", "restart"] = "off"
    max_restarts: int = 3
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    max_turns: int = 3
    max_model_tokens: int = 160
    episode_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _at_least(self, workers=1, group_size=2, max_new_tokens=1, max_turns=1, max_model_tokens=1)
        _at_least(self, max_restarts=0)
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_p != 1.0:
            raise ValueError(
                f"top_p must be 1.0 for now (the trainer recomputes untruncated logprobs), got {self.top_p}"
            )


class TrainConfig(_Section):
    """``backend``: ``"torch"`` (one process, CPU or one GPU) or ``"megatron"`` (megatron-core
    with ``tp``-way tensor, ``pp``-way pipeline and ``dp``-way data parallelism over
    ``tp * pp * dp`` processes, batches split into micro-batches of ``micro_batch_rows`` rows,
    0 = one micro-batch per data-parallel rank; needs the ``loong-train[megatron]`` extra).
    ``gpus``: GPUs Ray reserves for the trainer actor (0: CPU; Megatron on GPU: ``tp * pp * dp``,
    its ranks use the reserved GPUs in order; a fraction shares one GPU with a rollout worker).
    ``checkpoint_every``: write a resumable checkpoint every that many steps (0: only after the
    last step); the newest ``keep_checkpoints`` are kept (:mod:`loong_train.checkpoint`)."""

    steps: int = 100
    batch_groups: int = 16
    max_staleness: int = 1
    lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    backend: Literal["torch", "megatron"] = "torch"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_rows: int = 0
    gpus: float = 0.0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2

    def __post_init__(self) -> None:
        _at_least(self, checkpoint_every=0, keep_checkpoints=1)
        _at_least(
            self,
            steps=1,
            batch_groups=1,
            max_staleness=0,
            warmup_steps=0,
            tp=1,
            pp=1,
            dp=1,
            micro_batch_rows=0,
        )
        if self.backend == "torch" and (self.tp * self.pp * self.dp > 1 or self.micro_batch_rows):
            raise ValueError("tp, pp, dp and micro_batch_rows need backend = 'megatron'")
        if self.backend == "torch" and self.gpus:
            raise ValueError("gpus needs backend = 'megatron' (the torch backend trains on CPU)")
        if self.gpus < 0 or (self.gpus > 1 and self.gpus % 1):
            raise ValueError(f"gpus must be a fraction of one GPU or a whole number, got {self.gpus}")
        if self.backend == "megatron" and not _have_megatron_core():
            raise ValueError(
                "backend = 'megatron' needs megatron-core, which is not installed "
                "(install the extra: pip install 'loong-train[megatron]')"
            )


def _have_megatron_core() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:  # no ``megatron`` package at all
        return False


AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class LossConfig(_Section):
    """The ``[loss]`` table: advantages, policy loss, KL penalty, train-inference corrections.

    The formulas are in :mod:`loong_train.algorithms`. The defaults are GRPO with std scaling and
    PPO clipping against the behaviour (rollout) logprobs, averaged over all loss tokens; every
    other term is off: its cap or bound is the identity (``inf``, ``0``) or its coefficient is 0.

    - ``scale_adv_by_std``: divide group-centred rewards by the group std (false: Dr. GRPO).
    - ``clip_eps`` (eps), ``dual_clip`` (c > 1, e.g. 3.0; ``inf`` = off).
    - ``agg_mode``: verl's ``loss_agg_mode`` names; ``norm_length`` is Dr. GRPO's constant
      divisor, required by ``"seq-mean-token-sum-norm"`` (e.g. ``rollout.max_model_tokens``).
    - ``kl_coef`` (beta, 0 = off; a frozen copy of the initial model is the reference) and
      ``kl_estimator``.
    - ``decoupled``: AReaL's decoupled PPO (clip against the proximal policy, IS-weight by
      proximal / behaviour); ``tis_cap`` (C) truncates that weight and needs ``decoupled``.
    - ``mis_low``/``mis_high``: masked IS band for the proximal / behaviour ratio, per token
      or per sequence (``mis_level``); ``0``/``inf`` = off.
    """

    scale_adv_by_std: bool = True
    clip_eps: float = 0.2
    dual_clip: float = math.inf
    agg_mode: AggMode = "token-mean"
    norm_length: int = 0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    decoupled: bool = False
    tis_cap: float = math.inf
    mis_low: float = 0.0
    mis_high: float = math.inf
    mis_level: Literal["token", "sequence"] = "token"

    def __post_init__(self) -> None:
        if problems := _loss_problems(self):
            raise ValueError("; ".join(problems))


def _loss_problems(c: LossConfig) -> list[str]:
    checks = [
        (0 < c.clip_eps < 1, f"clip_eps must be in (0, 1), got {c.clip_eps}"),
        (c.dual_clip > 1, f"dual_clip must be > 1 (e.g. 3.0; inf = off), got {c.dual_clip}"),
        (
            c.norm_length > 0 or c.agg_mode != "seq-mean-token-sum-norm",
            f"norm_length must be > 0 with agg_mode = 'seq-mean-token-sum-norm' "
            f"(the constant each sequence's token sum is divided by), got {c.norm_length}",
        ),
        (c.kl_coef >= 0, f"kl_coef must be >= 0 (0 = off), got {c.kl_coef}"),
        (c.tis_cap > 0, f"tis_cap must be > 0 (inf = off), got {c.tis_cap}"),
        (
            c.decoupled or c.tis_cap == math.inf,
            "tis_cap needs decoupled = true: the truncated weight min(exp(p - b), C) is applied "
            "on top of a PPO ratio taken against the proximal logprobs p",
        ),
        (
            0 <= c.mis_low < 1 < c.mis_high,
            f"mis_low and mis_high must satisfy 0 <= mis_low < 1 < mis_high (off: 0 and inf), "
            f"got {c.mis_low} and {c.mis_high}",
        ),
    ]
    return [msg for ok, msg in checks if not ok]


class EvalConfig(_Section):
    every: int = 10
    num_tasks: int = 128

    def __post_init__(self) -> None:
        _at_least(self, every=1, num_tasks=1)


class AgentConfig(_Section):
    """The ``[agent]`` table: how rollout workers run the task's agent.

    - ``kind = "whitebox"``: :class:`~loong_agentflow.ToolAgent` episodes in process (token buffer).
    - ``kind = "blackbox"``: each worker hosts an AgentFlow proxy (OpenAI API on 127.0.0.1) over its
      engine and runs every episode as a subprocess of ``command`` (the contract of
      :mod:`loong_agentflow.blackbox`; ``LOONG_MAX_TURNS`` holds ``rollout.max_turns``), at most
      ``max_concurrency`` at a time per worker. An empty ``command`` is the task's own agent
      program (``Task.agent_command``; the calc tasks': :mod:`loong_train.tiny.calc_agent`, an
      ``openai``-SDK program run by this interpreter).
    - ``preload``: modules a Python ``command`` imports; episodes are then forked from a warm
      process that imported them once (:mod:`loong_agentflow.forkserver`), instead of paying an
      interpreter start and the imports (about a second for ``openai``) per episode. Unset: the
      task's agent preloads what it declares (the calc agent: ``openai``), another ``command`` runs
      as plain subprocesses; ``[]`` turns forking off.
    """

    kind: Literal["whitebox", "blackbox"] = "whitebox"
    command: list[str] = []
    max_concurrency: int = 16
    preload: list[str] | None = None

    def __post_init__(self) -> None:
        _at_least(self, max_concurrency=1)


class TeacherBuild(_Section):
    """One ``[[opd.build]]`` entry: how a tiny recipe makes the local teacher ``teacher`` (whose
    ``path`` is empty): supervised training on ``task`` (a one-domain task set), started from the
    student's warm-started checkpoint, with these settings over the recipe's ``[warmstart]``
    (stopping at the first probe whose sampled success reaches ``target_success``). Cached."""

    teacher: str
    task: str
    steps: int = 1000
    lr: float = 1e-3
    label_smoothing: float = 0.0
    target_success: float = 0.9


class OPDConfig(_Section):
    """The ``[opd]`` table: on-policy distillation; formulas and metrics in :mod:`loong_train.opd`.

    - ``enabled``: score every batch with the teachers before the loss (false: the task reward
      alone, the same run otherwise; teachers are still built, so both runs can be compared).
    - ``mode``: ``"teacher_only"`` (A_t = -lambda (logp_student - logp_teacher)) or ``"mixed"``
      (plus ``task_coef`` times the GRPO advantage of the row).
    - ``teachers``: a ``loong_teacher.TeacherManagerConfig`` (routing tag, default teacher, memory
      budget, and the teachers with their coefficients lambda).
    - ``build``: how to make local teachers whose ``path`` is empty (see :class:`TeacherBuild`).
    - ``baseline_run``: a run directory (e.g. the same recipe with ``opd.enabled=false``) whose
      per-domain eval success is plotted beside this run's; skipped until it has a summary.
    """

    enabled: bool = False
    mode: Literal["teacher_only", "mixed"] = "teacher_only"
    task_coef: float = 1.0
    teachers: TeacherManagerConfig | None = None
    build: list[TeacherBuild] = []
    baseline_run: str = ""

    def __post_init__(self) -> None:
        if problems := _opd_problems(self):
            raise ValueError("; ".join(problems))


def _opd_problems(c: OPDConfig) -> list[str]:
    teachers = c.teachers.teachers if c.teachers is not None else []
    names = [t.name for t in teachers]
    unbuilt = [t.name for t in teachers if isinstance(t, LocalTeacherConfig) and not t.path]
    built = [b.teacher for b in c.build]
    checks = [
        (not c.enabled or teachers, "enabled = true needs [opd.teachers] with at least one teacher"),
        (c.task_coef >= 0, f"task_coef must be >= 0, got {c.task_coef}"),
        (set(built) <= set(names), f"build names teachers {sorted(set(built) - set(names))} not in {names}"),
        (
            set(unbuilt) <= set(built),
            f"local teachers {sorted(set(unbuilt) - set(built))} need a path or a build",
        ),
        *((not task_problem(b.task), f"build: {task_problem(b.task)}") for b in c.build),
    ]
    return [msg for ok, msg in checks if not ok]


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
    agent: AgentConfig = AgentConfig()
    sglang: SGLangRolloutConfig = SGLangRolloutConfig()
    transport: TransportConfig = TransportConfig()
    ray_address: str = ""

    def __post_init__(self) -> None:
        if problem := task_problem(self.task):
            raise ValueError(problem)
        if self.transport.type != "shm":
            raise ValueError(
                f"transport.type {self.transport.type!r}: loong-train drives 'shm' (trainer and "
                "engines on one host) for now"
            )
        r, kind = self.rollout, self.agent.kind
        if r.partial != "off" and (r.engine != "embedded" or kind != "whitebox"):
            raise ValueError(
                f"rollout.partial = {r.partial!r} needs rollout.engine = 'embedded' and "
                f"agent.kind = 'whitebox', got {r.engine!r} and {kind!r}"
            )


def recipe_names() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml")
        for p in resources.files("loong_train.recipes").iterdir()
        if p.name.endswith(".toml")
    )


def load_recipe(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a shipped recipe by name (names may hold dots: ``qwen3-0.6b-...``), or a TOML file by path."""
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
    return load_config(path, Recipe, overrides)
