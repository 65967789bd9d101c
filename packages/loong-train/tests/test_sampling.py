"""The embedded engine's draw: the first token whose cumulative weight exceeds ``u * total``,
checked against float64 cumulative sums."""

import torch

from loong_train.engines.embedded.batching import _inverse_cdf


def test_the_draw_picks_the_first_token_past_u_times_the_total():
    """Most weights zero (as top-p leaves them), rows whose only token is the first or the very
    last one, and ``u`` at 0 (a row opening with zero weights) and just under 1. Wherever
    ``u * total`` is not within float32 rounding of a boundary the token is the float64 one; no
    draw is ever a token of zero weight."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 256, 1000
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


def test_a_draw_at_the_top_of_a_row_never_passes_its_last_weighted_token():
    """``u`` just under 1 with zero weights closing the vocabulary (top-p's tail at its end): the
    draw stops at the last token of positive weight, whatever the rounding of the sums."""
    gen = torch.Generator().manual_seed(1)
    rows, vocab = 2048, 512
    w = torch.rand(rows, vocab, generator=gen) ** 8 * 1000
    w[:, -7:] = 0.0
    got = _inverse_cdf(w, torch.full((rows,), 1.0 - 2.0**-24))
    assert (got < vocab - 7).all() and (w.gather(-1, got[:, None]) > 0).all()
