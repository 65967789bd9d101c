"""KL, generalized JSD and top-k+tail KL against float64 references written as plain Python loops,
hand-worked numbers, and the limits: beta 0/1, k = vocab, identical distributions, masking."""

import math
import random

import pytest
import torch

from loong_teacher import generalized_jsd, kl_divergence, topk_forward_kl, topk_tail_logprobs

# ----------------------------------------------------------------------------- plain-Python references


def ref_softmax(logits):
    top = max(logits)
    exps = [math.exp(z - top) for z in logits]
    total = sum(exps)
    return [e / total for e in exps]


def ref_kl(p, q):
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def ref_jsd(student, teacher, beta):
    if beta == 0:
        return ref_kl(teacher, student)
    if beta == 1:
        return ref_kl(student, teacher)
    mix = [beta * t + (1 - beta) * s for s, t in zip(student, teacher, strict=True)]
    return beta * ref_kl(teacher, mix) + (1 - beta) * ref_kl(student, mix)


def ref_buckets(student_logits, topk_ids, teacher_topk_probs):
    """Student and teacher probabilities over [top-k ids..., tail], tails summed directly."""
    q = ref_softmax(student_logits)
    student = [q[i] for i in topk_ids] + [sum(qv for v, qv in enumerate(q) if v not in topk_ids)]
    teacher = [*teacher_topk_probs, 1 - sum(teacher_topk_probs)]
    return student, teacher


def random_logits(rng, vocab, scale=3.0):
    return [rng.gauss(0, scale) for _ in range(vocab)]


def _logprobs(probs):
    return torch.tensor(probs, dtype=torch.float64).log()


ONE = torch.ones(1, 1)

# ---------------------------------------------------------------------------------------- full KL


def test_kl_by_hand():
    # KL((.5,.5) || (.25,.75)) = .5 ln 2 + .5 ln(2/3)
    got = kl_divergence(_logprobs([[[0.5, 0.5]]]), _logprobs([[[0.25, 0.75]]]), ONE)
    assert got.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), abs=1e-15)


def test_kl_zero_mass_terms_vanish_even_against_zero():
    # P(2) = 0 and Q(2) = 0: the term is 0, not nan; KL((.5,.5,0) || (.5,.5,0)) = 0
    p = _logprobs([[[0.5, 0.5, 0.0]]])
    assert kl_divergence(p, p.clone(), ONE).item() == 0.0
    assert kl_divergence(p, _logprobs([[[0.25, 0.25, 0.5]]]), ONE).item() == pytest.approx(math.log(2))


def test_kl_against_reference_and_masking():
    rng = random.Random(0)
    rows = [[ref_softmax(random_logits(rng, 7)) for _ in range(3)] for _ in range(2)]
    cols = [[ref_softmax(random_logits(rng, 7)) for _ in range(3)] for _ in range(2)]
    mask = [[1, 0, 1], [1, 1, 0]]
    got = kl_divergence(_logprobs(rows), _logprobs(cols), torch.tensor(mask))
    for b in range(2):
        for t in range(3):
            want = ref_kl(rows[b][t], cols[b][t]) if mask[b][t] else 0.0
            assert got[b, t].item() == pytest.approx(want, abs=1e-12)


# ------------------------------------------------------------------------------------------- JSD


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_jsd_against_reference(beta):
    rng = random.Random(1)
    s = [ref_softmax(random_logits(rng, 11)) for _ in range(4)]
    t = [ref_softmax(random_logits(rng, 11)) for _ in range(4)]
    got = generalized_jsd(_logprobs([s]), _logprobs([t]), torch.ones(1, 4), beta)
    for i in range(4):
        assert got[0, i].item() == pytest.approx(ref_jsd(s[i], t[i], beta), abs=1e-12)


def test_jsd_endpoints_are_forward_and_reverse_kl():
    s, t = _logprobs([[[0.7, 0.2, 0.1]]]), _logprobs([[[0.2, 0.2, 0.6]]])
    assert generalized_jsd(s, t, ONE, 0.0).item() == pytest.approx(ref_kl([0.2, 0.2, 0.6], [0.7, 0.2, 0.1]))
    assert generalized_jsd(s, t, ONE, 1.0).item() == pytest.approx(ref_kl([0.7, 0.2, 0.1], [0.2, 0.2, 0.6]))


def test_normalized_jsd_tends_to_the_endpoint_kls():
    s, t = [0.7, 0.2, 0.1], [0.2, 0.2, 0.6]
    eps = 1e-5
    near0 = generalized_jsd(_logprobs([[s]]), _logprobs([[t]]), ONE, eps).item() / eps
    near1 = generalized_jsd(_logprobs([[s]]), _logprobs([[t]]), ONE, 1 - eps).item() / eps
    assert near0 == pytest.approx(ref_kl(t, s), rel=1e-3)
    assert near1 == pytest.approx(ref_kl(s, t), rel=1e-3)


@pytest.mark.parametrize("beta", [0.25, 0.5])
def test_jsd_of_disjoint_distributions_is_the_binary_entropy_of_beta(beta):
    # T = (1, 0), S = (0, 1): M = (beta, 1 - beta); beta ln(1/beta) + (1 - beta) ln(1/(1 - beta))
    got = generalized_jsd(_logprobs([[[0.0, 1.0]]]), _logprobs([[[1.0, 0.0]]]), ONE, beta).item()
    assert got == pytest.approx(-beta * math.log(beta) - (1 - beta) * math.log(1 - beta), abs=1e-15)
    if beta == 0.5:
        assert got == pytest.approx(math.log(2))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_jsd_of_identical_distributions_is_zero_and_masked_is_zero(beta):
    p = torch.log_softmax(torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(2)), -1)
    got = generalized_jsd(p, p.clone(), torch.ones(2, 3), beta)
    assert got.abs().max().item() < 1e-6
    garbage = torch.full((1, 1, 4), -math.inf)
    assert generalized_jsd(garbage, garbage, torch.zeros(1, 1), beta).item() == 0.0


# ---------------------------------------------------------------------------------- top-k + tail


def test_topk_forward_kl_by_hand():
    # student uniform over 4 tokens; teacher top-2 = ids 0 (p .5), 1 (p .3), tail .2
    # student buckets (.25, .25, .5): KL = .5 ln 2 + .3 ln 1.2 + .2 ln .4
    got = topk_forward_kl(
        torch.zeros(1, 1, 4, dtype=torch.float64),
        torch.tensor([[[0, 1]]]),
        _logprobs([[[0.5, 0.3]]]),
        ONE,
    )
    assert got.item() == pytest.approx(
        0.5 * math.log(2) + 0.3 * math.log(1.2) + 0.2 * math.log(0.4), abs=1e-15
    )


def _random_topk_case(seed, batch=2, seq=3, vocab=9, k=3):
    rng = random.Random(seed)
    logits = [[random_logits(rng, vocab) for _ in range(seq)] for _ in range(batch)]
    ids = [[rng.sample(range(vocab), k) for _ in range(seq)] for _ in range(batch)]
    probs = []
    for b in range(batch):
        row = []
        for t in range(seq):
            p = ref_softmax(random_logits(rng, vocab))
            row.append([p[i] for i in ids[b][t]])
        probs.append(row)
    return logits, ids, probs


def test_topk_buckets_and_kl_against_reference():
    logits, ids, probs = _random_topk_case(3)
    mask = [[1, 1, 0], [0, 1, 1]]
    z, k_ids, k_lp = torch.tensor(logits, dtype=torch.float64), torch.tensor(ids), _logprobs(probs)
    student, teacher = topk_tail_logprobs(z, k_ids, k_lp)
    got = topk_forward_kl(z, k_ids, k_lp, torch.tensor(mask))
    for b in range(2):
        for t in range(3):
            s_ref, t_ref = ref_buckets(logits[b][t], ids[b][t], probs[b][t])
            assert student[b, t].exp().tolist() == pytest.approx(s_ref, abs=1e-14)
            assert teacher[b, t].exp().tolist() == pytest.approx(t_ref, abs=1e-14)
            want = ref_kl(t_ref, s_ref) if mask[b][t] else 0.0
            assert got[b, t].item() == pytest.approx(want, abs=1e-12)


def test_topk_jsd_on_buckets_against_reference():
    logits, ids, probs = _random_topk_case(4, batch=1, seq=2)
    buckets = topk_tail_logprobs(
        torch.tensor(logits, dtype=torch.float64), torch.tensor(ids), _logprobs(probs)
    )
    got = generalized_jsd(*buckets, torch.ones(1, 2), beta=0.4)
    for t in range(2):
        s_ref, t_ref = ref_buckets(logits[0][t], ids[0][t], probs[0][t])
        assert got[0, t].item() == pytest.approx(ref_jsd(s_ref, t_ref, 0.4), abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_topk_with_k_equal_vocab_is_the_full_kl(dtype):
    g = torch.Generator().manual_seed(5)
    z = torch.randn(2, 3, 16, generator=g, dtype=dtype) * 3
    teacher = torch.log_softmax(torch.randn(2, 3, 16, generator=g, dtype=dtype) * 3, -1)
    k_lp, k_ids = teacher.topk(16, dim=-1)  # every id, in the teacher's order
    got = topk_forward_kl(z, k_ids, k_lp, torch.ones(2, 3))
    full = kl_divergence(teacher, torch.log_softmax(z, -1), torch.ones(2, 3))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert (got - full).abs().max().item() < tol
    assert torch.isfinite(got).all()


def test_topk_kl_is_zero_when_the_student_matches_the_teacher():
    z = torch.randn(1, 2, 10, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    k_lp, k_ids = torch.log_softmax(z, -1).topk(4, dim=-1)
    assert topk_forward_kl(z, k_ids, k_lp, torch.ones(1, 2)).abs().max().item() < 1e-14


def test_topk_teacher_mass_rounding_above_one_leaves_an_empty_tail():
    # exp(-.69) + exp(-.69) = 1.0031 > 1: no tail bucket mass, finite KL
    student, teacher = topk_tail_logprobs(
        torch.zeros(1, 1, 3), torch.tensor([[[0, 1]]]), torch.full((1, 1, 2), -0.69)
    )
    assert teacher[0, 0, 2].item() == -math.inf
    assert torch.isfinite(kl_divergence(teacher, student, ONE)).all()


def test_topk_gradient_wrt_student_logits_matches_the_analytic_form():
    # d KL / d z_v = q_v - T_v for v in top-k ;  q_v - T_tail * q_v / Q_tail for v outside
    logits, ids, probs = _random_topk_case(7, batch=1, seq=1, vocab=6, k=2)
    z = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    topk_forward_kl(z, torch.tensor(ids), _logprobs(probs), ONE).sum().backward()
    q = ref_softmax(logits[0][0])
    top, t_probs = ids[0][0], probs[0][0]
    t_tail = 1 - sum(t_probs)
    q_tail = sum(qv for v, qv in enumerate(q) if v not in top)
    want = [q[v] - (t_probs[top.index(v)] if v in top else t_tail * q[v] / q_tail) for v in range(6)]
    assert z.grad[0, 0].tolist() == pytest.approx(want, abs=1e-14)


def test_topk_masked_padding_stays_zero_with_minus_inf_teacher():
    got = topk_forward_kl(
        torch.zeros(1, 2, 5),
        torch.zeros(1, 2, 2, dtype=torch.long),
        torch.full((1, 2, 2), -math.inf),
        torch.tensor([[0, 0]]),
    )
    assert got.tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergence_gradients_are_finite_with_padding_and_an_empty_teacher_tail(beta):
    """Padding rows hold -inf teacher logprobs and a confident teacher's tail rounds to empty: the
    loss and every gradient stay finite, and padding passes no gradient."""
    z = torch.randn(1, 3, 6, generator=torch.Generator().manual_seed(3), requires_grad=True)
    ids = torch.tensor([[[0, 1], [2, 3], [0, 1]]])
    teacher = torch.tensor(
        [[[-0.69, -0.69], [-0.1, -2.5], [-math.inf, -math.inf]]]
    )  # empty tail; a tail; padding
    mask = torch.tensor([[1, 1, 0]])
    loss = generalized_jsd(*topk_tail_logprobs(z, ids, teacher), mask, beta).sum()
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(z.grad).all()
    assert z.grad[0, 2].abs().max().item() == 0.0


def test_reverse_kl_floors_an_empty_teacher_tail_at_eps():
    # student (0.5, 0.25, 0.25) over top-2 + tail; the teacher's top 2 hold all the mass
    student = _logprobs([[[0.5, 0.25, 0.25]]])
    teacher = torch.tensor([[[math.log(0.5), math.log(0.5), -math.inf]]], dtype=torch.float64)
    eps = torch.finfo(torch.float64).eps
    want = 0.5 * math.log(1.0) + 0.25 * math.log(0.25 / 0.5) + 0.25 * math.log(0.25 / eps)
    assert generalized_jsd(student, teacher, ONE, 1.0).item() == pytest.approx(want, rel=1e-12)
