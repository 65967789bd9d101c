"""The torch backend's packed, chunked forward against the plain padded one, the chunked head's
hand-written backward against autograd, and micro-batch gradient accumulation against one step
on the whole batch."""

import copy

import pytest
import torch
from train_testkit import tiny_qwen3

from loong_core.records import TrainBatch
from loong_train.algo.config import LossConfig
from loong_train.backends import packing
from loong_train.backends.torch_backend import TorchBackend, token_logprobs
from loong_train.models.packed import common_prefixes

VOCAB = 41


def _model(seed=0):
    return tiny_qwen3(
        seed, std=0.1, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, head_dim=8
    )


def _batch(lens=(9, 4, 12, 1, 7), seed=0) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    return _train_batch([torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens], seed)


def _grouped_batch(seed=0) -> TrainBatch:
    """Rows as RL batches hold them: two groups of samples of one prompt each, the prompts sharing
    a system prompt; one sample twice, one sample a prefix of the one before it."""
    gen = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()  # noqa: E731
    system = tokens(4)
    p1, p2 = system + tokens(3), system + tokens(5)
    r1, r2 = p1 + tokens(6), p2 + tokens(7)
    rows = [r1, p1 + tokens(2), r1, r1[:9], p1 + tokens(9), r2, p2 + tokens(3), p2 + r2[9:11] + tokens(4)]
    return _train_batch(rows, seed, prompt=7)


def _train_batch(rows: list[list[int]], seed: int, prompt: int = 3) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed + 1)
    ids, mask, adv, behaviour = [], [], [], []
    for i, row in enumerate(rows):
        ids += row
        row_mask = [0] * min(prompt, len(row)) + [1] * (len(row) - prompt)
        mask += row_mask
        adv += [(0.5 - i / 4) * m for m in row_mask]
        behaviour += [(-3.0 + 0.1 * float(torch.randn(1, generator=gen))) * m for m in row_mask]
    return TrainBatch(
        token_ids=ids,
        loss_mask=mask,
        advantages=adv,
        behaviour_logprobs=behaviour,
        versions=[0 if m else -1 for m in mask],
        row_lens=[len(r) for r in rows],
        sample_ids=[str(i) for i in range(len(rows))],
        policy_version=0,
    )


@pytest.mark.parametrize("grouped", [False, True], ids=["random-rows", "shared-prefixes"])
@pytest.mark.parametrize("budget", [0, 1, 10, 16])
def test_packed_logprobs_equal_the_padded_forward(budget, grouped):
    """Rows packed end to end (no padding, positions restarting, attention inside each row, a
    prefix shared with the row before computed once), in micro-batches of any budget, give the
    logprobs of the plain padded forward."""
    model, batch = _model().double(), _grouped_batch() if grouped else _batch()
    ids = TorchBackend(copy.deepcopy(model), lr=0.0).tensors(batch)["ids"]
    with torch.no_grad():
        want = token_logprobs(model, ids, temperature=0.7)
        got = torch.zeros_like(want)
        for micro in packing.micro_batches(batch.token_ids, batch.row_lens, budget):
            lp, entropy = packing.logprobs(model, micro, 0.7, False)
            got[micro.rows, : micro.width] = lp
            logp = torch.log_softmax(model(micro.pad(micro.ids))[:, :-1] / 0.7, -1)
            h = -(logp.exp() * logp).sum(-1)
            valid = micro.valid[:, 1:]
            assert torch.allclose(entropy[:, 1:][valid], h[valid], atol=1e-12)
    valid = torch.arange(ids.shape[1]) < torch.tensor(batch.row_lens)[:, None]
    assert torch.allclose(got[valid], want[valid], atol=1e-12)
    assert (got[~valid] == 0).all()


def test_micro_batches_respect_the_budget():
    lens = [9, 4, 12, 1, 7]
    groups = [list(m.rows) for m in packing.micro_batches(list(range(sum(lens))), lens, 13)]
    assert groups == [[0, 1], [2, 3], [4]]  # 13, 13, 7 tokens; a row over budget would go alone
    assert [list(m.rows) for m in packing.micro_batches([0] * 33, lens, 0)] == [[0, 1, 2, 3, 4]]
    assert [m.ids.tolist() for m in packing.micro_batches(list(range(33)), lens, 5)][2] == list(range(13, 25))


def test_shared_prefixes_by_hand():
    """Which tokens a packed forward computes, for rows worked out by hand."""
    rows = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 9], [5, 6], [1, 2]]
    flat = [t for r in rows for t in r]
    lens = [len(r) for r in rows]
    assert common_prefixes(torch.tensor(flat), lens) == [0, 2, 3, 2, 0]
    (micro,) = packing.micro_batches(flat, lens, 0)
    layout = micro.layout
    assert layout.own == [4, 1, 0, 0, 2]  # the third row repeats the second; the fourth is a prefix
    assert micro.ids[layout.computed].tolist() == [5, 6, 7, 8, 9, 1, 2]
    assert layout.positions.tolist() == [0, 1, 2, 3, 2, 0, 1]
    # row 1 = computed 0, 1, 4; row 2 the same tokens; row 3 = computed 0, 1
    assert layout.index.tolist() == [0, 1, 2, 3, 0, 1, 4, 0, 1, 4, 0, 1, 5, 6]
    # the budget counts computed tokens: rows 0-3 compute 5, row 4 starts a group (nothing shared)
    assert [list(m.rows) for m in packing.micro_batches(flat, lens, 5)] == [[0, 1, 2, 3], [4]]
    assert [m.layout.shared for m in packing.micro_batches(flat, lens, 4)] == [(0,), (0, 3, 2), (0,)]
    unshared = packing.micro_batches(flat, lens, 0, share=False)[0].layout
    assert unshared.own == lens and unshared.index.tolist() == list(range(len(flat)))


@pytest.mark.parametrize("bias", [False, True])
def test_chunked_head_backward_matches_autograd(bias):
    """The head's own backward (logits recomputed, never stored) against torch's gradient check:
    logprobs and entropies, with a temperature, in float64."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(11, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=gen, requires_grad=True) if bias else None
    ids = torch.tensor([3, 0, 10, 3, 7])
    inputs = (h, w, b) if bias else (h, w)

    def f(*x):
        return packing._HeadLogprobs.apply(x[0], x[1], x[2] if bias else None, ids, 0.7, True)

    assert torch.autograd.gradcheck(f, inputs)
    lp, entropy = f(*inputs)
    z = (h @ w.T + (b if bias else 0)) / 0.7
    logp = torch.log_softmax(z, -1)
    assert torch.allclose(lp, logp[torch.arange(5), ids]) and torch.allclose(
        entropy, -(logp.exp() * logp).sum(-1)
    )


@pytest.mark.parametrize(
    "loss",
    [
        LossConfig(),
        LossConfig(agg_mode="seq-mean-token-mean", entropy_coef=0.01),
        LossConfig(agg_mode="seq-mean-token-sum-norm", norm_length=16, kl_coef=0.1, policy="gspo"),
        LossConfig(decoupled=True, tis_cap=1.5),
    ],
    ids=["token-mean", "seq-mean+entropy", "token-sum-norm+kl+gspo", "decoupled"],
)
def test_micro_batches_accumulate_to_one_step_on_the_batch(loss):
    """A step in micro-batches of at most 10 tokens has the gradient of one step on the whole
    batch, and reports the same loss and statistics. (Gradients, not weights after the update:
    Adam's first step is about lr * sign(g), which turns rounding noise in a near-zero gradient
    component into a full-size step.)"""
    batch = _batch()
    whole = TorchBackend(_model(), lr=1e-2, loss=loss, max_tokens_per_micro_batch=0)
    split = TorchBackend(_model(), lr=1e-2, loss=loss, max_tokens_per_micro_batch=10)
    if loss.kl_coef:  # a reference away from the policy, so the KL term is not zero
        whole.reference, split.reference = _model(1).eval(), _model(1).eval()
    a, b = _step_without_update(whole, batch), _step_without_update(split, batch)
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    assert not loss.kl_coef or a["kl"] > 0
    for (name, p), q in zip(whole.model.named_parameters(), split.model.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("budget", [12, 0])
@pytest.mark.parametrize("grouped", [False, True], ids=["random-rows", "shared-prefixes"])
def test_train_step_gradient_equals_the_padded_loss_in_float64(grouped, budget):
    """The packed step's gradient against the loss written out on the padded full-vocabulary
    forward (an independent computation), float64: rows sharing prefixes get the gradient of
    separate rows."""
    batch, cfg = _grouped_batch() if grouped else _batch(), LossConfig(entropy_coef=0.05)
    model = _model().double()
    reference = copy.deepcopy(model)
    backend = TorchBackend(model, lr=0.0, loss=cfg, max_tokens_per_micro_batch=budget)
    t = {k: v.double() if v.is_floating_point() else v for k, v in backend.tensors(batch).items()}
    logp = torch.log_softmax(reference(t["ids"])[:, :-1], -1)
    lp = torch.cat([torch.zeros_like(t["mask"][:, :1]), logp.gather(-1, t["ids"][:, 1:, None])[..., 0]], 1)
    entropy = torch.cat([torch.zeros_like(t["mask"][:, :1]), -(logp.exp() * logp).sum(-1)], 1)
    ratio = torch.exp(lp - t["behaviour"])
    surr = torch.minimum(ratio * t["adv"], ratio.clamp(0.8, 1.2) * t["adv"])
    want = -(surr * t["mask"]).sum() / t["mask"].sum() - 0.05 * (entropy * t["mask"]).sum() / t["mask"].sum()
    want.backward()
    _step_without_update(backend, batch)
    for (name, p), q in zip(backend.model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-10), name


def _step_without_update(backend: TorchBackend, batch: TrainBatch) -> dict[str, float]:
    backend.opt.step = backend.sched.step = lambda: None  # keep the gradients, leave the weights
    backend.grad_clip = float("inf")
    return backend.train_step(batch)


def test_a_micro_batch_without_a_loss_token_adds_nothing():
    """Rows that are all prompt (no loss token) packed into a micro-batch of their own: the step
    runs, and its gradient is the whole batch's (float64)."""
    batch = _batch(lens=(20, 3, 3), seed=1)  # the 3-token rows are prompt only
    whole, split = (TorchBackend(_model().double(), lr=0.0, max_tokens_per_micro_batch=b) for b in (0, 20))
    assert len(packing.micro_batches(batch.token_ids, batch.row_lens, 20)) == 2
    a, b = _step_without_update(whole, batch), _step_without_update(split, batch)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-12)
    for (name, p), q in zip(whole.model.named_parameters(), split.model.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-12), name
