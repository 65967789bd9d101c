"""The ``[loss]`` and ``[opd]`` tables: the policy loss of :mod:`loong_train.algo.losses` and the
on-policy distillation of :mod:`loong_train.algo.opd`. Pure msgspec (no torch)."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from loong_teacher.config import LocalTeacherConfig, TeacherManagerConfig
from loong_train.tasks import task_problem

__all__ = ["LossConfig", "OPDConfig", "TeacherBuild"]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    pass


AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class LossConfig(_Section):
    """The ``[loss]`` table: advantages, policy loss, KL penalty, train-inference corrections.

    The formulas are in :mod:`loong_train.algo.losses`. The defaults are GRPO with std scaling and
    PPO clipping against the behaviour (rollout) logprobs, averaged over all loss tokens; every
    other term is off: its cap or bound is the identity (``inf``, ``0``) or its coefficient is 0.

    - ``estimator``: ``"grpo"`` (default), ``"rloo"``, ``"reinforce++"`` or
      ``"reinforce++-baseline"``.
    - ``policy``: the objective, ``"ppo"`` (default), ``"gspo"``, ``"gspo-token"`` or ``"cispo"``.
    - ``scale_adv_by_std``: divide group-centred rewards by the group std (false: Dr. GRPO);
      ``std``: ``"population"`` (Loong's default, / G) or ``"unbiased"`` (/ (G - 1), verl's and
      TRL's ``torch.std``: the same rewards give about 13% smaller advantages at G = 4).
    - ``clip_eps`` (eps), ``clip_eps_high`` (the upper clip, eps_high; 0 = ``clip_eps``, a
      symmetric clip; DAPO's clip-higher is 0.28 over 0.2), ``dual_clip`` (c > 1, e.g. 3.0;
      ``inf`` = off).
    - ``agg_mode``: verl's ``loss_agg_mode`` names; ``norm_length`` is Dr. GRPO's constant
      divisor, required by ``"seq-mean-token-sum-norm"`` (e.g. ``rollout.max_model_tokens``).
    - ``entropy_coef``: an entropy bonus, minus coef * agg(H) with H_t the policy's entropy
      at each loss token (0 = off; the torch backend; every step logs ``entropy``, its token mean).
    - ``kl_coef`` (beta, 0 = off; a frozen copy of the initial model is the reference) and
      ``kl_estimator``.
    - ``decoupled``: AReaL's decoupled PPO (clip against the proximal policy, IS-weight by
      proximal / behaviour); ``tis_cap`` (C) truncates that weight and needs ``decoupled``.
    - ``mis_low``/``mis_high``: masked IS band for the proximal / behaviour ratio, per token
      or per sequence (``mis_level``); ``0``/``inf`` = off.
    - ``overlong_filter``: DAPO's overlong filtering, no loss on truncated episodes (they still
      count in their group's advantage statistics); with ``reward.overlong_buffer``, its shaping.
    - ``dynamic_sampling``: DAPO's dynamic sampling. A group whose trainable episodes all scored
      the same (every row's GRPO or RLOO advantage is 0) is dropped when it comes back, never
      trained, and another group is admitted in its place, so each batch holds ``batch_groups``
      groups that carry signal. Only trained groups count against the staleness bound; each
      ``ledger.jsonl`` line lists the groups dropped since the previous one (``dropped``) and
      ``metrics.jsonl`` counts them (``dropped_groups``). ``dynamic_sampling_max_rounds``: the
      run finishes early (final evaluation and checkpoint, ``summary.json``'s ``stopped`` says
      why, exit 0) once ``rounds * batch_groups`` groups in a row were dropped without a train
      step (every prompt solved, or failed, by all its samples; DAPO's
      ``max_num_gen_batches``, whose recipe's 10 batches of 3x over-sampled prompts make the
      default 30). Dropping costs generation: on ``tiny-reasoning`` with a third task the model
      never solves (word reversal), once the matrix tasks were solved 26 rounds (seed 0) and
      over 48 (seed 1) passed between late steps, and seed 1 stopped at step 184 with
      ``max_rounds = 50``.
    """

    policy: Literal["ppo", "gspo", "gspo-token", "cispo"] = "ppo"
    estimator: Literal["grpo", "rloo", "reinforce++", "reinforce++-baseline"] = "grpo"
    scale_adv_by_std: bool = True
    std: Literal["population", "unbiased"] = "population"
    clip_eps: float = 0.2
    clip_eps_high: float = 0.0
    dual_clip: float = math.inf
    agg_mode: AggMode = "token-mean"
    norm_length: int = 0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    decoupled: bool = False
    tis_cap: float = math.inf
    mis_low: float = 0.0
    mis_high: float = math.inf
    mis_level: Literal["token", "sequence"] = "token"
    overlong_filter: bool = False
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 30

    def __post_init__(self) -> None:
        if problems := _loss_problems(self):
            raise ValueError("; ".join(problems))

    @property
    def clip_high(self) -> float:
        """eps_high: ``clip_eps_high``, or ``clip_eps`` when it is 0 (a symmetric clip)."""
        return self.clip_eps_high or self.clip_eps


def _loss_problems(c: LossConfig) -> list[str]:
    checks = [
        (0 < c.clip_eps < 1, f"clip_eps must be in (0, 1), got {c.clip_eps}"),
        (c.clip_eps_high >= 0, f"clip_eps_high must be >= 0 (0 = clip_eps), got {c.clip_eps_high}"),
        (c.dual_clip > 1, f"dual_clip must be > 1 (e.g. 3.0; inf = off), got {c.dual_clip}"),
        (
            c.policy == "ppo" or c.dual_clip == math.inf,
            f"dual_clip applies to policy = 'ppo' only, got policy = {c.policy!r}",
        ),
        (
            c.norm_length > 0 or c.agg_mode != "seq-mean-token-sum-norm",
            f"norm_length must be > 0 with agg_mode = 'seq-mean-token-sum-norm' "
            f"(the constant each sequence's token sum is divided by), got {c.norm_length}",
        ),
        (c.kl_coef >= 0, f"kl_coef must be >= 0 (0 = off), got {c.kl_coef}"),
        (c.entropy_coef >= 0, f"entropy_coef must be >= 0 (0 = off), got {c.entropy_coef}"),
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
        (
            not c.dynamic_sampling or c.estimator in ("grpo", "rloo"),
            f"dynamic_sampling needs estimator = 'grpo' or 'rloo', got estimator = {c.estimator!r}: "
            "its batch-whitened advantages are not 0 on a group whose rewards are all equal, so "
            "dropping such a group would discard signal",
        ),
        (
            c.dynamic_sampling_max_rounds >= 1,
            f"dynamic_sampling_max_rounds must be >= 1, got {c.dynamic_sampling_max_rounds}",
        ),
    ]
    return [msg for ok, msg in checks if not ok]


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
    """The ``[opd]`` table: on-policy distillation; formulas and metrics in :mod:`loong_train.algo.opd`.

    - ``enabled``: score every batch with the teachers before the loss (false: the task reward
      alone, the same run otherwise; teachers are still built, so both runs can be compared).
    - ``objective``: how the teachers' scores enter the loss. ``"advantage"``: as the per-token
      advantage of the policy loss, the sampled-token estimate of the reverse KL. ``"forward_kl"``:
      a dense loss term, the forward KL(teacher || student) over each position's teacher top-k
      (``teachers.top_k``, which must be > 0) plus a tail bucket, weighted by lambda; the policy
      loss then has no teacher advantage. ``"jsd"``: the same with GKD's generalized JSD of
      ``jsd_beta`` in place of the forward KL (0: forward KL, 1: reverse KL(student || teacher),
      between: the JSD against the mixture beta T + (1 - beta) S).
    - ``mode``: ``"teacher_only"`` (advantage: A_t = -lambda (logp_student - logp_teacher);
      forward_kl and jsd: no task reward, the advantages are 0) or ``"mixed"`` (plus ``task_coef`` times
      the GRPO advantage of the row).
    - ``teachers``: a ``loong_teacher.TeacherManagerConfig`` (routing tag, default teacher, memory
      budget, and the teachers with their coefficients lambda).
    - ``build``: how to make local teachers whose ``path`` is empty (see :class:`TeacherBuild`).
    - ``baseline_run``: a run directory (e.g. the same recipe with ``opd.enabled=false``) whose
      per-domain eval success is plotted beside this run's; skipped until it has a summary.
    """

    enabled: bool = False
    objective: Literal["advantage", "forward_kl", "jsd"] = "advantage"
    mode: Literal["teacher_only", "mixed"] = "teacher_only"
    task_coef: float = 1.0
    jsd_beta: float = 0.5
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
        (
            c.objective == "advantage" or (c.teachers is not None and c.teachers.top_k > 0),
            f'objective = "{c.objective}" needs [opd.teachers] top_k > 0 (the teacher ids it is taken over)',
        ),
        (
            0 <= c.jsd_beta <= 1,
            f"jsd_beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {c.jsd_beta}",
        ),
        (set(built) <= set(names), f"build names teachers {sorted(set(built) - set(names))} not in {names}"),
        (
            set(unbuilt) <= set(built),
            f"local teachers {sorted(set(unbuilt) - set(built))} need a path or a build",
        ),
        *((not task_problem(b.task), f"build: {task_problem(b.task)}") for b in c.build),
    ]
    return [msg for ok, msg in checks if not ok]
