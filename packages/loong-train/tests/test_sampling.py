"""The embedded engine's draw: the first token whose cumulative weight exceeds ``u * total``,
checked against float64 cumulative sums, over vocabularies drawn in one scan and in two levels
(whole blocks, and a last block cut short)."""

import pytest
import torch

from loong_train.engines.embedded.batching import CDF_BLOCK, _inverse_cdf

VOCABS = [1000, 4 * CDF_BLOCK, 5 * CDF_BLOCK + 37]


@pytest.mark.parametrize("vocab", VOCABS)
def test_the_draw_picks_the_first_token_past_u_times_the_total(vocab):
    """Most weights zero (as top-p leaves them), rows whose only token is the first or the very
    last one, and ``u`` at 0 (a row opening with zero weights) and just under 1. Wherever
    ``u * total`` is not within float32 rounding of a boundary the token is the float64 one; no
    draw is ever a token of zero weight."""
    gen = torch.Generator().manual_seed(0)
    rows = 256
    w = torch.rand(rows, vocab, generator=gen) ** 4
    w[w < 0.2] = 0.0
    w[0], w[1] = 0.0, 0.0
    w[0, vocab - 1] = 0.5
    w[1, 0] = 2.0
    u = torch.rand(rows, generator=gen)
    u[2], u[3] = 0.0, 1.0 - 2.0**-24
    w[2, :5] = 0.0

    got = _inverse_cdf(w, u)

    assert (w.gather(-1, got[:, None]) > 0).all()
    assert got[0] == vocab - 1 and got[1] == 0
    cdf = w.double().cumsum(-1)
    target = u.double() * cdf[:, -1]
    want = (cdf <= target[:, None]).sum(-1)  # the first index whose cumulative weight exceeds it
    margin = (cdf - target[:, None]).abs().min(-1).values / cdf[:, -1]
    clear = margin > 1e-5
    assert clear.sum() > 0.9 * rows
    assert torch.equal(got[clear], want[clear])


@pytest.mark.parametrize("vocab", [512, 4 * CDF_BLOCK, 5 * CDF_BLOCK + 37])
def test_a_draw_at_the_top_of_a_row_never_passes_its_last_weighted_token(vocab):
    """``u`` just under 1 with zero weights closing the vocabulary (top-p's tail at its end): the
    draw stops at the last token of positive weight, whatever the rounding of the sums."""
    gen = torch.Generator().manual_seed(1)
    rows = 2048
    w = torch.rand(rows, vocab, generator=gen) ** 8 * 1000
    w[:, -7:] = 0.0
    got = _inverse_cdf(w, torch.full((rows,), 1.0 - 2.0**-24))
    assert (got < vocab - 7).all() and (w.gather(-1, got[:, None]) > 0).all()


@pytest.mark.parametrize("vocab", VOCABS)
def test_integer_weights_draw_exactly_the_hand_counted_token(vocab):
    """Small integer weights sum exactly in float32, so the draw must be exactly the token a
    count over the float64 cumulative sum gives, for every ``u`` on a grid, with whole blocks of
    zeros (top-p's tail) in between."""
    gen = torch.Generator().manual_seed(2)
    rows = 64
    w = torch.randint(0, 4, (rows, vocab), generator=gen).float()
    w[:, CDF_BLOCK : 2 * CDF_BLOCK] = 0.0
    w[:, -CDF_BLOCK // 2 :] = 0.0
    w[0] = 0.0
    w[0, vocab // 2] = 1.0
    u = (torch.arange(rows) + 0.5) / rows
    got = _inverse_cdf(w, u)
    cdf = w.double().cumsum(-1)
    want = (cdf <= (u.double() * cdf[:, -1])[:, None]).sum(-1)
    assert torch.equal(got, want)
    assert got[0] == vocab // 2


def test_a_draw_in_a_block_cut_short_stays_inside_the_vocabulary():
    """The last block of a two-level draw is cut short by the vocabulary's end. Its weights, one
    large and many tiny ones (about half a float32 step of their running sum each), make the
    block's total exceed the running sum inside it by rounding: a draw with ``u`` just under 1
    must still stop at a weighted token of the vocabulary."""
    vocab = 5 * CDF_BLOCK + 37
    w = torch.zeros(4, vocab)
    w[:, 5 * CDF_BLOCK :] = 6e-8
    w[:, 5 * CDF_BLOCK] = 1.0
    tail = w[:, 5 * CDF_BLOCK :]
    assert (tail.sum(-1) > tail.cumsum(-1)[:, -1]).all()  # the rounding this test needs
    got = _inverse_cdf(w, torch.full((4,), 1.0 - 2.0**-24))
    assert (got < vocab).all() and (w.gather(-1, got[:, None]) > 0).all()
