"""On-policy distillation (OPD) advantages, losses and divergences on plain torch tensors.

Nothing here needs a Loong record, so any framework can call these functions. Conventions:

- Sampled-token tensors are ``[batch, seq]``: the logprob each model gave the token the student
  sampled, advantages, masks. Distributions are ``[batch, seq, support]`` log-probabilities over
  the last dim (the full vocabulary, or the k+1 top-k/tail buckets of :func:`topk_tail_logprobs`).
- ``mask`` (``[batch, seq]``, 0/1 or bool) is 1 on tokens that train. Every per-token output is
  exactly 0 where the mask is 0, whatever the inputs hold there (padding may hold -inf).
- Symbols: pi_theta is the student being trained, mu the policy that sampled the rollout (the
  inference engine, possibly some weight versions behind), pi_T a teacher, y_t the sampled token,
  m_t the mask, sg[.] stop-gradient. Student arguments come before teacher arguments.

Sampled-token signals (the teacher scores only the tokens the student sampled):

    reverse_kl_advantage   A_t = A_task_t - lambda * sg[log pi_S(y_t) - log pi_T(y_t)]
    mopd_advantage         A_t = sg[log pi_T_d(y_t) - log pi_theta(y_t)] + alpha * A_outcome_t
    importance_weights     w_t = m_t * k_t * sg[r_t],   r_t = exp(log pi_theta(y_t) - log mu(y_t))
    opd_policy_loss        L = -sum_t m_t k_t r_t sg[A_t] / sum_t m_t

with k_t = 1[ratio_low <= r_t <= ratio_high] the IS-ratio mask (MiMo's MOPD zeroes tokens whose
ratio leaves the band; the defaults 0 and inf keep every token, plain IS as in tinker-cookbook).

Distribution signals (the teacher returns a distribution per position):

    kl_divergence          KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))
    generalized_jsd        JSD_beta(T, S), GKD's interpolation between KL(T || S) and KL(S || T)
    topk_forward_kl        KL(T || S) over the teacher's top-k ids plus one tail bucket
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "generalized_jsd",
    "importance_weights",
    "kl_divergence",
    "masked_mean",
    "mopd_advantage",
    "opd_policy_loss",
    "reverse_kl_advantage",
    "topk_forward_kl",
    "topk_tail_logprobs",
]

# ------------------------------------------------------------------------ sampled-token signals


def reverse_kl_advantage(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float | torch.Tensor = 1.0,
    task_advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reverse-KL OPD advantage (tinker-cookbook, slime), per sampled token ``[batch, seq]``:

        A_t = A_task_t - lambda * sg[log pi_S(y_t) - log pi_T(y_t)]

    The second term is a one-sample estimate of -KL(pi_S || pi_T) at position t: tokens the
    teacher finds likelier than the student get a positive advantage. ``coef`` is lambda: a
    float, or a tensor broadcastable to ``[batch, seq]`` such as ``[batch, 1]`` holding the
    coefficient of the teacher each row was routed to. ``task_advantages`` (``[batch, seq]`` or
    ``[batch, 1]``; default 0, teacher-only distillation) mixes an outcome signal such as GRPO in.
    Train on it with :func:`opd_policy_loss`, whose ratio is the IS weight exp(logp_theta - logp_mu).
    """
    adv = -coef * (student_logprobs - teacher_logprobs).detach()
    if task_advantages is not None:
        adv = adv + task_advantages
    return _masked(adv, mask)


def mopd_advantage(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    outcome_advantages: torch.Tensor,
    mask: torch.Tensor,
    alpha: float,
) -> torch.Tensor:
    """Multi-teacher OPD advantage (Xiaomi MiMo-V2-Flash, "MOPD"), per token ``[batch, seq]``:

        A_t = sg[log pi_T_d(y_t) - log pi_theta(y_t)] + alpha * A_outcome_t

    where ``teacher_logprobs`` come, row by row, from the teacher of that prompt's domain d and
    ``outcome_advantages`` (``[batch, seq]`` or ``[batch, 1]``) from the outcome reward model
    (e.g. GRPO). This is :func:`reverse_kl_advantage` with lambda = 1 and A_task = alpha * A_outcome;
    MOPD's IS-ratio masking lives in :func:`opd_policy_loss` (``ratio_low``, ``ratio_high``).
    """
    return reverse_kl_advantage(
        student_logprobs, teacher_logprobs, mask, task_advantages=alpha * outcome_advantages
    )


def importance_weights(
    logp_theta: torch.Tensor,
    logp_rollout: torch.Tensor,
    mask: torch.Tensor,
    ratio_low: float = 0.0,
    ratio_high: float = math.inf,
) -> torch.Tensor:
    """Detached IS weights ``[batch, seq]`` for frameworks with their own per-token loss:

        w_t = m_t * 1[ratio_low <= r_t <= ratio_high] * sg[r_t],   r_t = exp(logp_theta_t - logp_rollout_t)

    The band test runs in log space, so a token masked out for a huge ratio never overflows.
    """
    log_ratio = (logp_theta - logp_rollout).detach()
    keep = _kept(log_ratio, mask, ratio_low, ratio_high)
    return torch.where(keep, torch.exp(torch.where(keep, log_ratio, 0.0)), 0.0)


def opd_policy_loss(
    logp_theta: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ratio_low: float = 0.0,
    ratio_high: float = math.inf,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance-sampled policy-gradient loss for OPD advantages; inputs ``[batch, seq]``:

        r_t = exp(logp_theta_t - logp_rollout_t),   k_t = 1[ratio_low <= r_t <= ratio_high]
        L   = -sum_t m_t k_t r_t sg[A_t] / sum_t m_t

    Its gradient, -sum_t m_t k_t r_t A_t grad log pi_theta(y_t) / sum_t m_t, is MiMo's MOPD
    gradient (weight sg[r_t] inside the band, 0 outside) and, with the default band [0, inf),
    tinker-cookbook's importance-sampling loss. The denominator counts every loss token, masked
    out by the band or not. Returns (loss, stats) with ``is_masked_frac``, the fraction of loss
    tokens whose ratio left the band.
    """
    log_ratio = logp_theta - logp_rollout
    keep = _kept(log_ratio.detach(), mask, ratio_low, ratio_high)
    ratio = torch.exp(torch.where(keep, log_ratio, 0.0))
    n = mask.sum().clamp(min=1)
    loss = -torch.where(keep, ratio * advantages.detach(), 0.0).sum() / n
    masked_out = mask.bool() & ~keep
    return loss, {"is_masked_frac": float(masked_out.sum() / n)}


def _kept(log_ratio: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    log_low = math.log(low) if low > 0 else -math.inf
    return mask.bool() & (log_ratio >= log_low) & (log_ratio <= math.log(high))


# ------------------------------------------------------------------------- distribution signals


def kl_divergence(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per position ``[batch, seq]`` from log-probabilities ``[batch, seq, support]``:

        KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))

    Terms with P(v) = 0 are 0 (so log P(v) = -inf is allowed), including where log Q(v) = -inf too.
    Masked positions are 0 and pass no gradient, whatever their inputs (padding may hold -inf).
    """
    p = p_logprobs.exp()
    counted = (p > 0) & mask.bool().unsqueeze(-1)
    terms = p * torch.where(counted, p_logprobs - q_logprobs, 0.0)
    return _masked(terms.sum(-1), mask)


def generalized_jsd(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence (GKD, Agarwal et al. 2024) per position ``[batch, seq]``
    from normalized log-probabilities ``[batch, seq, support]`` (full vocabulary, or the top-k+tail
    buckets of :func:`topk_tail_logprobs`). With teacher T, student S and 0 < beta < 1:

        M          = beta * T + (1 - beta) * S          (log M by logsumexp)
        JSD_beta   = beta * KL(T || M) + (1 - beta) * KL(S || M)

    Convention (TRL's GKD): the endpoints are defined as the two KLs,

        JSD_0 = KL(T || S)   (forward KL, mass-covering)
        JSD_1 = KL(S || T)   (reverse KL, mode-seeking)

    which are the limits of the normalized divergence: JSD_beta / beta -> KL(T || S) as beta -> 0
    and JSD_beta / (1 - beta) -> KL(S || T) as beta -> 1 (JSD_beta itself tends to 0 at both ends).

    The reverse KL (beta = 1) floors the teacher's probabilities at the dtype's eps: below it a
    probability is rounding (a top-k tail is 1 minus the top-k mass, an empty tail is -inf), and a
    zero would make the KL, and every gradient, infinite.
    """
    if beta == 0:
        return kl_divergence(teacher_logprobs, student_logprobs, mask)
    if beta == 1:
        floor = math.log(torch.finfo(teacher_logprobs.dtype).eps)
        return kl_divergence(student_logprobs, teacher_logprobs.clamp(min=floor), mask)
    mixture = torch.logaddexp(teacher_logprobs + math.log(beta), student_logprobs + math.log1p(-beta))
    return beta * kl_divergence(teacher_logprobs, mixture, mask) + (1 - beta) * kl_divergence(
        student_logprobs, mixture, mask
    )


def topk_tail_logprobs(
    student_logits: torch.Tensor, teacher_topk_ids: torch.Tensor, teacher_topk_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher log-probabilities ``[batch, seq, k+1]`` over the teacher's top-k ids
    (``[batch, seq, k]``, as a server returns them) plus one tail bucket for all other tokens.

    With z the student logits ``[batch, seq, vocab]`` (logits or logprobs) and K the top-k ids:

        log T_i    = teacher_topk_logprobs_i                        i = 1..k
        log T_tail = log(1 - sum_i exp(log T_i))                    log1mexp(logsumexp_i log T_i)
        log S_i    = log_softmax(z)[K_i]
        log S_tail = logsumexp_{v not in K} log_softmax(z)_v        summed directly, no 1 - sum

    A teacher top-k that rounds to more than all the mass leaves an empty tail (log T_tail = -inf).
    log S_tail is floored at log(finfo.tiny): when K is the whole vocabulary the teacher's tail is
    rounding noise and must meet a finite student tail, not an infinite KL term.
    """
    student = torch.log_softmax(student_logits, dim=-1)
    student_top = student.gather(-1, teacher_topk_ids)
    rest = student.scatter(-1, teacher_topk_ids, -math.inf)
    floor = math.log(torch.finfo(student.dtype).tiny)
    student_tail = rest.logsumexp(-1, keepdim=True).clamp(min=floor)
    teacher_mass = teacher_topk_logprobs.logsumexp(-1, keepdim=True).clamp(max=0.0)
    teacher_tail = _log1mexp(teacher_mass)
    return (
        torch.cat([student_top, student_tail], dim=-1),
        torch.cat([teacher_topk_logprobs, teacher_tail], dim=-1),
    )


def topk_forward_kl(
    student_logits: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Forward KL(T || S) over the k+1 buckets of :func:`topk_tail_logprobs`, ``[batch, seq]``:

        KL = sum_{i=1..k} T_i (log T_i - log S_i) + T_tail (log T_tail - log S_tail)

    When k is the vocabulary size (empty tail) this is the full-vocabulary KL(T || S). For the
    generalized JSD on the same buckets: ``generalized_jsd(*topk_tail_logprobs(...), mask, beta)``.
    """
    student, teacher = topk_tail_logprobs(student_logits, teacher_topk_ids, teacher_topk_logprobs)
    return kl_divergence(teacher, student, mask)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level mean sum_t m_t x_t / sum_t m_t (0 for an empty mask); reduces a per-token signal."""
    return _masked(values, mask).sum() / mask.sum().clamp(min=1)


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` where the mask is set, exactly 0 elsewhere (even if ``values`` is inf or nan there)."""
    return torch.where(mask.bool(), values, 0.0)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, stable at both ends (Maechler 2012: expm1 near 0, log1p far)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
