"""Rows of token ids packed end to end for one forward, shared prefixes computed once.

Under causal attention a position's hidden state depends only on the tokens up to it, so where a
row begins with the same tokens as the row before it (the samples of one prompt share the prompt;
different prompts often share a system prompt), those tokens' hidden states are equal in both
rows. :class:`PackedRows` computes each such prefix once: row ``r`` computes only its last
``lens[r] - shared[r]`` tokens, at positions ``shared[r]`` on, attending to the shared tokens where
the earlier row computed them. The result, expanded back to every row's every token, equals what
each row computes alone, to float rounding; gradients flowing into a shared position add up over
the rows that read it, as they would over the separate rows.

``tokens`` below is every row's every token end to end (``sum(lens)``); ``computed`` is the tokens
a forward actually runs (``sum(lens) - sum(shared)``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

__all__ = ["PackedRows", "common_prefixes"]


def common_prefixes(ids: torch.Tensor, lens: Sequence[int]) -> list[int]:
    """How many leading tokens each row of ``ids`` (rows end to end) shares with the row before
    it (0 for the first)."""
    rows = ids.split(list(lens))
    out = [0]
    for prev, row in itertools.pairwise(rows):
        n = min(len(prev), len(row))
        differ = torch.nonzero(prev[:n] != row[:n])
        out.append(int(differ[0]) if len(differ) else n)
    return out


@dataclass(frozen=True)
class PackedRows:
    """The layout of one packed forward: each row's length and the prefix it shares with the row
    before it (``shared[0] == 0``; all zeros: every row computes all its tokens)."""

    lens: tuple[int, ...]
    shared: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.lens) != len(self.shared) or (self.shared and self.shared[0]):
            raise ValueError(
                f"PackedRows: {len(self.lens)} lengths, shared {self.shared} (the first must be 0)"
            )
        for r in range(1, len(self.lens)):
            if not 0 <= self.shared[r] <= min(self.lens[r], self.lens[r - 1]):
                raise ValueError(
                    f"PackedRows: row {r} shares {self.shared[r]} tokens, longer than it or the row before"
                )

    @classmethod
    def unshared(cls, lens: Sequence[int]) -> PackedRows:
        return cls(tuple(lens), (0,) * len(lens))

    @cached_property
    def own(self) -> list[int]:
        """Tokens each row computes."""
        return [n - s for n, s in zip(self.lens, self.shared, strict=True)]

    @cached_property
    def index(self) -> torch.Tensor:
        """[tokens]: the computed token holding each row token's hidden state."""
        out = torch.empty(sum(self.lens), dtype=torch.long)
        start = computed = 0
        for r, (n, s) in enumerate(zip(self.lens, self.shared, strict=True)):
            if s:  # the previous row's first s tokens
                prev = start - self.lens[r - 1]
                out[start : start + s] = out[prev : prev + s]
            out[start + s : start + n] = torch.arange(computed, computed + n - s)
            start, computed = start + n, computed + n - s
        return out

    @cached_property
    def computed(self) -> torch.Tensor:
        """[computed]: which of the row tokens each computed token is."""
        keep = torch.cat([torch.arange(n) >= s for n, s in zip(self.lens, self.shared, strict=True)])
        return torch.nonzero(keep).squeeze(-1)

    @cached_property
    def positions(self) -> torch.Tensor:
        """[computed]: each computed token's position in its row."""
        return torch.cat([torch.arange(s, n) for n, s in zip(self.lens, self.shared, strict=True)])

    @cached_property
    def _attention(self) -> list[tuple[slice, torch.Tensor | None, torch.Tensor | None]]:
        """Per row that computes anything: its computed tokens (a slice), the computed tokens it
        attends to (None: only its own, causally) and the mask (None: causal)."""
        out, start, computed = [], 0, 0
        for n, s in zip(self.lens, self.shared, strict=True):
            own = slice(computed, computed + n - s)
            if n > s:
                if s == 0:
                    out.append((own, None, None))
                else:  # query j (position s + j) sees keys 0 .. s + j
                    keys = self.index[start : start + n]
                    mask = torch.ones(n - s, n, dtype=torch.bool).tril(s)
                    out.append((own, keys, mask))
            start, computed = start + n, own.stop
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        """Scaled dot-product attention of the computed tokens ``q`` [1, heads, computed, d] over
        ``k``, ``v`` [1, kv heads, computed, d], each row over its shared prefix and itself.

        Rows take their own tokens by ``split``, whose backward is one ``cat``: slicing each
        row's tokens out instead costs a zeroed full-size gradient per row and layer (as a shared
        prefix's keys and values, gathered by index, still do)."""
        sizes = [own.stop - own.start for own, _, _ in self._attention]
        rows = zip(self._attention, q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2), strict=True)
        parts = []
        for (_, keys, mask), q_own, k_own, v_own in rows:
            if keys is None:
                parts.append(
                    F.scaled_dot_product_attention(q_own, k_own, v_own, is_causal=True, enable_gqa=gqa)
                )
            else:
                mask = mask.to(q.device)
                keys = keys.to(q.device)
                parts.append(
                    F.scaled_dot_product_attention(
                        q_own, k[:, :, keys], v[:, :, keys], attn_mask=mask, enable_gqa=gqa
                    )
                )
        return torch.cat(parts, dim=2)
