"""The recipe's cross-table rules: settings that are valid alone but not together.

Each rule is a function of the whole :class:`~loong_train.config.Recipe` that returns what is
wrong (naming every key involved and what would be accepted) or None. ``Recipe.__post_init__``
runs :data:`RULES` in order and refuses the recipe with the first problem found; a rule about one
table alone belongs in that table's own ``__post_init__``.

Two checks read the recipe as written instead (the parsed TOML with its overrides, before
defaults fill it in), since what matters there is what the user set: :func:`infer_task` (a recipe
without ``task``) and :func:`unread_tables` (a task table the chosen task never reads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from loong_train.engines.config import EmbeddedEngineConfig, SGLangEngineConfig
from loong_train.tasks import TaskTables, task_problem

if TYPE_CHECKING:
    from loong_train.config import Recipe

__all__ = ["RULES", "infer_task", "problems", "unread_tables"]


def known_task(recipe: Recipe) -> str | None:
    """``task`` names a shipped task, an adapter or an importable factory."""
    return task_problem(recipe.task)


def transport_loong_drives(recipe: Recipe) -> str | None:
    """The controller drives the ``shm`` and ``tcp`` transports, without delta updates."""
    t = recipe.transport
    if t.type in ("shm", "tcp") and not t.delta:
        return None
    return (
        f"transport: loong-train drives type 'shm' (trainer and engines on one host) and 'tcp' "
        f"without delta (across hosts), got type {t.type!r}, delta = {t.delta}"
    )


def embedded_overlap_needs_whitebox(recipe: Recipe) -> str | None:
    """Partial rollouts and concurrent calls on the embedded engine interleave white-box episodes."""
    engine, agent = recipe.rollout.engine, recipe.agent
    if not isinstance(engine, EmbeddedEngineConfig) or agent.type == "whitebox":
        return None
    if engine.partial != "off":
        return (
            f"rollout.engine.partial = {engine.partial!r} needs agent.type = 'whitebox' "
            f"(updates land between a white-box agent's decode steps), got {agent.type!r}"
        )
    if engine.concurrent_calls > 1:
        return (
            f"rollout.engine.concurrent_calls = {engine.concurrent_calls} needs agent.type = "
            f"'whitebox' (concurrent calls share the engine of white-box episodes), got {agent.type!r}"
        )
    return None


def overlong_buffer_within_budget(recipe: Recipe) -> str | None:
    """DAPO's overlong buffer is a tail of the episode's token budget, so it must be shorter."""
    r = recipe.rollout
    budget = min(r.max_model_tokens, r.max_turns * r.max_new_tokens)
    if recipe.reward.overlong_buffer < budget:
        return None
    return (
        f"reward.overlong_buffer = {recipe.reward.overlong_buffer} must be below the episode budget, "
        f"min(rollout.max_model_tokens, rollout.max_turns * rollout.max_new_tokens) = {budget}"
    )


def group_reward_needs_whitebox(recipe: Recipe) -> str | None:
    """A group reward scores the final turns the framework holds: white-box episodes only."""
    if not recipe.reward.group or recipe.agent.type == "whitebox":
        return None
    return (
        f"reward.group = true scores the final turns of white-box episodes once per group; "
        f"agent.type = {recipe.agent.type!r} episodes are scored by the agent or reward_fn one by one"
    )


def entropy_bonus_needs_torch(recipe: Recipe) -> str | None:
    """Only the torch backend computes the entropy bonus."""
    backend = recipe.train.backend.type
    if recipe.loss.entropy_coef <= 0 or backend == "torch":
        return None
    return (
        f"loss.entropy_coef = {recipe.loss.entropy_coef} is a torch-backend option; "
        f"train.backend.type = {backend!r} does not compute the entropy bonus"
    )


def gpu_weight_push_needs_trainer_gpu(recipe: Recipe) -> str | None:
    """Direct pushes over NCCL, or as CUDA tensors into real SGLang, send from the trainer's GPU."""
    engine = recipe.rollout.engine
    if not isinstance(engine, SGLangEngineConfig) or engine.weights != "direct":
        return None
    on_gpu = engine.update_backend == "nccl" or (
        engine.launcher == "sglang" and engine.update_backend == "tensor"
    )
    if not on_gpu or recipe.train.backend.gpus:
        return None
    return (
        f'rollout.engine.weights = "direct" with update_backend = "{engine.update_backend}": the trainer '
        "sends from its GPU, but train.backend.gpus = 0 (use update_backend = 'gloo' on CPU)"
    )


def adapter_updates_go_through_workers(recipe: Recipe) -> str | None:
    """Adapter-only updates reach an SGLang server through its rollout worker; direct weights have none."""
    engine, lora = recipe.rollout.engine, recipe.train.lora
    if not (lora.enabled and lora.sync == "adapter" and isinstance(engine, SGLangEngineConfig)):
        return None
    if engine.weights != "direct":
        return None
    return (
        'train.lora.sync = "adapter" has each rollout worker load the adapters into its server '
        '(SGLang\'s LoRA API), and rollout.engine.weights = "direct" has the trainer push instead: '
        'set train.lora.sync = "merged" (the trainer pushes merged weights into the servers) or '
        'rollout.engine.weights = "worker"'
    )


def cuda_ipc_needs_real_sglang(recipe: Recipe) -> str | None:
    """CUDA IPC handles from a GPU trainer open only in a server on a GPU."""
    engine = recipe.rollout.engine
    if not (
        isinstance(engine, SGLangEngineConfig)
        and engine.weights == "direct"
        and engine.update_backend == "tensor"
        and engine.launcher == "loong"
        and recipe.train.backend.gpus
    ):
        return None
    return (
        'rollout.engine.update_backend = "tensor" from a trainer on a GPU hands over CUDA IPC handles, '
        "which launcher = 'loong' (a CPU server) cannot open: use launcher = 'sglang' or update_backend = 'gloo'"
    )


def groups_of_two_for_task_reward(recipe: Recipe) -> str | None:
    """A group-relative advantage needs two samples a prompt; teacher-only distillation does not."""
    teacher_only = recipe.opd.enabled and recipe.opd.mode == "teacher_only"
    if recipe.rollout.group_size >= 2 or teacher_only:
        return None
    return (
        f"rollout.group_size = {recipe.rollout.group_size}: the task reward's advantage compares a prompt's "
        "samples, so a group needs at least 2 (only teacher-only distillation, opd.enabled = true with "
        "opd.mode = 'teacher_only', trains on one sample per prompt)"
    )


def dense_distillation_needs_torch(recipe: Recipe) -> str | None:
    """Only the torch backend computes the dense distillation losses."""
    opd, backend = recipe.opd, recipe.train.backend.type
    if not opd.enabled or opd.objective == "advantage" or backend == "torch":
        return None
    return (
        f'opd.objective = "{opd.objective}" is a torch-backend option; train.backend.type = '
        f'{backend!r} does not compute the distillation loss (use "advantage")'
    )


def borrowed_threads_from_embedded_engines(recipe: Recipe) -> str | None:
    """Embedded engines lend their CPU threads, to the torch backend's one trainer process, while
    no agent program of theirs runs on them."""
    engine, backend = recipe.rollout.engine, recipe.train.backend.type
    if not recipe.train.borrow_idle_threads:
        return None
    if not isinstance(engine, EmbeddedEngineConfig):
        return (
            f"train.borrow_idle_threads = true borrows the CPU threads of embedded engines; "
            f"rollout.engine.type = {engine.type!r} lends none (set it to false)"
        )
    if backend != "torch":
        return (
            f"train.borrow_idle_threads = true lends threads to the torch backend's trainer, "
            f"not train.backend.type = {backend!r} (set it to false, or train.backend.type = 'torch')"
        )
    if recipe.agent.type != "whitebox":
        return (
            f"train.borrow_idle_threads = true lends a worker's threads while its engine rests, but "
            f"agent.type = {recipe.agent.type!r} runs agent programs on them then (set it to false)"
        )
    return None


RULES = (
    known_task,
    transport_loong_drives,
    embedded_overlap_needs_whitebox,
    overlong_buffer_within_budget,
    group_reward_needs_whitebox,
    entropy_bonus_needs_torch,
    gpu_weight_push_needs_trainer_gpu,
    adapter_updates_go_through_workers,
    cuda_ipc_needs_real_sglang,
    groups_of_two_for_task_reward,
    dense_distillation_needs_torch,
    borrowed_threads_from_embedded_engines,
)
"""Every cross-table rule, in the order a recipe is checked."""


def problems(recipe: Recipe) -> list[str]:
    """What every rule finds wrong with ``recipe`` (empty: it is consistent)."""
    return [p for rule in RULES if (p := rule(recipe))]


_READERS: dict[str, tuple[str, ...]] = {
    "data": ("data", "env"),
    "environment": ("env",),
    "reward": ("data",),  # an environment scores its own steps
    "reasoning_gym": ("reasoning_gym",),
    "verifiers": ("verifiers",),
}
"""Each task table and the tasks that read it (``reasoning_gym`` also as ``reasoning_gym:<dataset>``)."""
_SHAPING = ("overlong_buffer", "overlong_penalty")  # [reward] keys every task's rollouts apply


def _set_keys(data: dict[str, Any], table: str) -> list[str]:
    """The keys of task table ``table`` that ``data`` (a recipe as written) sets to other than
    their default (a resolved recipe, ``config.toml``, writes every key); ``[reward]``'s
    overlong-shaping keys left out."""
    given = data.get(table)
    if not isinstance(given, dict):
        return []
    default = msgspec.to_builtins(getattr(TaskTables(), table))
    return sorted(k for k, v in given.items() if k not in _SHAPING and v != default.get(k, object()))


def _set_tables(data: dict[str, Any]) -> list[str]:
    """The task tables ``data`` sets keys in (:func:`_set_keys`)."""
    return [table for table in _READERS if _set_keys(data, table)]


def infer_task(data: dict[str, Any]) -> tuple[str, str]:
    """The task of a recipe (as written) that sets no ``task``, and why: ``env`` with an
    ``[environment]``, ``data`` with ``[data]`` or a reward function alone, ``reasoning_gym`` or
    ``verifiers`` with their table. Raises ValueError when no table, or more than one task, is
    named."""
    tables = _set_tables(data)
    common = set.intersection(*(set(_READERS[t]) for t in tables)) if tables else set()
    if common == {"data", "env"}:
        common = {"data"}  # env needs an [environment]
    if len(common) != 1:
        found = (
            f"its tables ({', '.join(f'[{t}]' for t in tables)}) name no one task"
            if tables
            else ("it sets none of [data], [environment], [reasoning_gym], [verifiers] to infer it from")
        )
        raise ValueError(
            f'the recipe sets no task, and {found}: set task (a shipped task such as "data", '
            '"env", "reasoning_gym", "verifiers", "calc", or a factory, "pkg.module:factory")'
        )
    return common.pop(), f"inferred from {', '.join(f'[{t}]' for t in tables)}"


def unread_tables(data: dict[str, Any], task: str) -> list[str]:
    """What is wrong with task tables ``data`` (a recipe as written) sets that ``task`` never
    reads: each names the table, the task and the tasks that would read it."""
    name = "reasoning_gym" if task.startswith("reasoning_gym:") else task
    problems = []
    for table, readers in _READERS.items():
        if name not in readers and (keys := ", ".join(_set_keys(data, table))):
            problems.append(
                f"[{table}] ({keys}) is read by task {' or '.join(map(repr, readers))}, "
                f"not by task {task!r}: remove the table, or set the task that reads it"
            )
    return problems
