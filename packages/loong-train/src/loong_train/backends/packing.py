"""Packed micro-batches and chunked logprobs: the torch backend's forward, with no compute on
padding and no [tokens x vocab] tensor kept for backward.

Packing: a micro-batch is consecutive rows of a TrainBatch laid end to end ([tokens], no pad);
the model's ``packed_hidden`` restarts positions and keeps attention inside each row, so every row
computes what it would alone. A prefix a row shares with the row before it (a GRPO group's prompt,
a system prompt) is computed once (:mod:`loong_train.models.packed`): on the real-model recipe's
batches (4 prompts x 8 samples) a step computes about half the tokens. Rows are grouped greedily
while the tokens they compute fit ``max_tokens`` (a longer row forms its own micro-batch; 0: the
whole batch in one).

Chunked logprobs: the LM head and the log-softmax run over ``CHUNK`` positions at a time with
their own backward (the way fused linear cross-entropy kernels do it): the forward keeps only the
chunk's hidden states and log-normalisers, and the backward recomputes that chunk's logits, so at
most one chunk's [positions x vocab] logits exist at once. For token ``j`` of a row, ``log p(x_j | x_<j) = z_j - logsumexp(z)``
with ``z`` the logits at position ``j - 1`` divided by the sampling temperature; the entropy of that
distribution is ``logsumexp(z) - sum_v p_v z_v``.

Gradient accumulation equals one step on the whole batch: every loss term is an aggregate
``S / n`` (:func:`~loong_train.algo.losses.aggregate`) whose normaliser ``n`` (loss tokens, or
rows with loss tokens) splits over micro-batches, so the batch's loss is the sum of each
micro-batch's loss weighted by ``n_micro / n_batch`` (:func:`share`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loong_train.algo.config import LossConfig
from loong_train.cores import adjust_threads
from loong_train.models.packed import PackedRows, common_prefixes
from loong_train.models.prepack import Linear

__all__ = ["CHUNK", "MicroBatch", "logprobs", "micro_batches", "share"]

CHUNK = 512  # positions per LM-head chunk: 512 x 49,152 float32 logits are 100 MB


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``rows`` of a batch (a range), packed: their token ids end to end ([tokens]), laid out
    by ``layout`` (their lengths, and the prefix each shares with the row before it)."""

    rows: range
    layout: PackedRows
    ids: torch.Tensor

    @property
    def lens(self) -> list[int]:
        return list(self.layout.lens)

    @property
    def width(self) -> int:
        """The longest row: the micro-batch's padded [rows, width] layout for the loss."""
        return max(self.lens)

    @property
    def valid(self) -> torch.Tensor:
        """[rows, width]: True at each row's tokens, False at its padding."""
        return torch.arange(self.width) < torch.tensor(self.lens)[:, None]

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-token values [tokens, ...] -> [rows, width, ...], zeros after each row's end."""
        return torch.nn.utils.rnn.pad_sequence(list(flat.split(self.lens)), batch_first=True)


def micro_batches(
    token_ids: Sequence[int], lens: Sequence[int], max_tokens: int, share: bool = True
) -> list[MicroBatch]:
    """Consecutive rows grouped while the tokens they compute fit ``max_tokens`` (0: one group);
    with ``share``, a row computes only what follows the prefix it shares with the row before it
    in its group."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    common = common_prefixes(ids, lens) if share else [0] * len(lens)
    groups: list[list[int]] = []
    tokens = 0
    for i, n in enumerate(lens):
        if not groups or (max_tokens and tokens + n - common[i] > max_tokens):
            groups.append([])
            tokens = 0
        tokens += n - (common[i] if groups[-1] else 0)
        groups[-1].append(i)
    out, start = [], 0
    for group in groups:
        sizes = [lens[i] for i in group]
        layout = PackedRows(tuple(sizes), (0, *(common[i] for i in group[1:])))
        out.append(MicroBatch(range(group[0], group[-1] + 1), layout, ids[start : start + sum(sizes)]))
        start += sum(sizes)
    return out


def logprobs(
    model,
    micro: MicroBatch,
    temperature: float,
    entropy_grad: bool | None,
    wanted: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each token's logprob given its prefix, [rows, width] (column 0 and padding 0), and unless
    ``entropy_grad`` is None each position's entropy likewise (with a gradient when
    ``entropy_grad``), from one packed forward with the head in chunks. ``wanted`` ([rows, width],
    nonzero where wanted): the head runs only for those tokens (a loss mask: a prompt's tokens are
    context, not targets); the others get 0. ``hidden``: the micro-batch's
    ``model.packed_hidden``, when the caller computed it already."""
    if hidden is None:
        hidden = model.packed_hidden(micro.ids, micro.layout)
    starts = torch.tensor([0, *micro.lens[:-1]]).cumsum(0)
    predicts = torch.ones(len(micro.ids), dtype=torch.bool)
    predicts[starts] = False  # a row's first token has no prefix
    if wanted is not None:
        predicts &= wanted[micro.valid].bool()
    target = torch.nonzero(predicts).squeeze(-1)  # token j, predicted at position j - 1
    h, ids = hidden[target - 1], micro.ids[target]
    head = model.lm_head
    # split: its backward is one cat (an empty split still gives one chunk, hence the check)
    chunks = zip(h.split(CHUNK), ids.split(CHUNK), strict=True) if len(target) else ()
    if entropy_grad is None and not torch.is_grad_enabled():  # scoring only
        parts = [(_picked(head, h_c, ids_c, temperature),) for h_c, ids_c in chunks]
    else:
        parts = [
            _HeadLogprobs.apply(h_c, head.weight, head.bias, ids_c, temperature, entropy_grad)
            for h_c, ids_c in chunks
        ]

    def spread(values: list[torch.Tensor]) -> torch.Tensor:  # per target -> [rows, width]
        flat = torch.zeros(len(micro.ids), dtype=torch.promote_types(hidden.dtype, torch.float32))
        return micro.pad(flat.index_put((target,), torch.cat(values)) if values else flat)

    lp = spread([p[0] for p in parts])
    return lp, None if entropy_grad is None else spread([p[1] for p in parts])


def _picked(head: torch.nn.Module, h: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logprobs of ``ids`` [C] given hidden states ``h`` [C, d], with no gradient and no entropy:
    the logits from the head's prepacked weight where it runs (:mod:`loong_train.models.prepack`),
    and the log-normaliser taken in place, since nothing reads the logits afterwards (1.5x faster
    than ``logsumexp``'s out-of-place passes over 512 x 49,152 logits)."""
    adjust_threads()
    if isinstance(head, Linear) and head.runs_prepacked(h):
        z = head(h).T  # [vocab, C], a view of the row-major logits
        z = z.float() if z.dtype.itemsize < 4 else z
        z = z / temperature if temperature != 1.0 else z
    else:
        z = _logits(h, head.weight, head.bias, temperature)
    picked = z[ids, torch.arange(len(ids))]
    top = z.amax(0)
    return picked - z.sub_(top).exp_().sum(0).log_().add_(top)


class _HeadLogprobs(torch.autograd.Function):
    """Logprobs of ``ids`` [C] (and entropies) under ``softmax((W h + b) / T)`` for hidden states
    ``h`` [C, d], keeping only ``h`` and the log-normaliser for backward, which recomputes the
    logits. Logits are laid out [vocab, C] (``W @ h^T``: the faster product on CPU). Without an
    entropy gradient, backward turns the recomputed logits into their gradient in place: each
    fresh [vocab, C] tensor costs a pass and, above malloc's mapping threshold, its page faults."""

    @staticmethod
    def forward(ctx, h, weight, bias, ids, temperature: float, entropy_grad: bool | None):
        adjust_threads()  # no linear layer's hook runs for the head's chunks
        z = _logits(h, weight, bias, temperature)
        lse = z.logsumexp(0)
        cols = torch.arange(len(ids))
        lp = z[ids, cols] - lse
        if entropy_grad is None:
            entropy = lp.new_zeros(0)
        else:  # H = -sum_v p_v log p_v, with log p = z - lse (in place: z is not needed any more)
            logp = z.sub_(lse)
            entropy = -(logp.exp().mul_(logp)).sum(0)
        ctx.save_for_backward(h, weight, bias, ids, lse, entropy)
        ctx.temperature, ctx.entropy_grad = temperature, bool(entropy_grad)
        return lp, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_entropy):
        h, weight, bias, ids, lse, entropy = ctx.saved_tensors
        adjust_threads()
        logp = _logits(h, weight, bias, ctx.temperature).sub_(lse)
        cols = torch.arange(len(ids))
        # d lp / d z_v = [v = id] - p_v;  d H / d z_v = -p_v (log p_v + H)
        if ctx.entropy_grad and grad_entropy is not None:
            p = logp.exp()
            grad_z = p * -grad_lp
            grad_z -= p.mul_(logp.add_(entropy)).mul_(grad_entropy)
        else:
            grad_z = logp.exp_().mul_(-grad_lp)
        grad_z[ids, cols] += grad_lp
        if ctx.temperature != 1.0:
            grad_z /= ctx.temperature
        grad_h = grad_z.T @ weight
        grad_w = grad_z @ h
        grad_b = grad_z.sum(1) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_h, grad_w, grad_b, None, None, None


def _logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """``(W h + b) / T`` as [vocab, C], in float32 at least."""
    z = weight @ h.T
    if z.dtype.itemsize < 4:
        z = z.float()
    if bias is not None:
        z += bias[:, None]
    return z.div_(temperature) if temperature != 1.0 else z


def share(micro_mask: torch.Tensor, batch_mask: torch.Tensor, cfg: LossConfig) -> float:
    """The weight of a micro-batch's aggregated loss in the batch's: ``n_micro / n_batch`` with
    ``n`` the aggregate's normaliser (loss tokens for ``token-mean``, else rows with loss tokens)."""
    return _normaliser(micro_mask, cfg) / max(1.0, _normaliser(batch_mask, cfg))


def _normaliser(mask: torch.Tensor, cfg: LossConfig) -> float:
    if cfg.agg_mode == "token-mean":
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())
