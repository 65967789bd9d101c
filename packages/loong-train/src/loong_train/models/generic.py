"""Any ``transformers`` causal LM behind the interface of Loong's own decoder (the generic path).

:class:`HFCausalLM` wraps an ``AutoModelForCausalLM`` so the trainer and the embedded engine use
it exactly as they use :class:`~loong_train.models.decoder.CausalLM`: ``forward(ids)`` for
training and scoring, ``forward(ids, positions, mask, cache, start)`` for generation against
Loong's preallocated :class:`~loong_train.models.decoder.KVCache` (so continuous batching,
per-request sampling and pause/resume between decode steps work unchanged), Hugging Face
parameter names, ``save_pretrained``. Logprobs and gradients are ``transformers``' own; it is
slower than the fast family (no fused layout of our own), never wrong.

How the cache is shared: each forward hands the model a ``transformers`` ``Cache`` whose layers
write the new keys and values into the KVCache columns ``[start, start + t)`` and return columns
``[0, start + t)``, as Loong's attention does, and the engine's boolean mask goes in as an
additive 4D mask, which ``transformers`` uses as given. A model whose layers do not keep one
full-length key/value pair each (sliding-window or linear-attention layers) is refused when it
loads, naming the layer type: a full cache would silently change what it attends to.

Dropout is switched off (every ``*dropout*`` / ``*pdrop*`` config field set to 0): rollout and
training must compute the same logprobs for the same weights.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loong_train.models.decoder import KVCache
from loong_train.models.packed import PackedRows

__all__ = ["GenericConfig", "HFCausalLM"]


@dataclass
class GenericConfig:
    """What the engine reads of a model's config (cache shape, vocabulary, tying); ``hf`` is the
    checkpoint's full ``config.json``."""

    vocab_size: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    model_type: str
    hf: dict = field(default_factory=dict, repr=False)

    def to_hf(self) -> dict:
        return self.hf


def _slot_cache(cache: KVCache, start: int) -> Any:
    """A ``transformers`` Cache over ``cache``'s tensors whose first ``start`` columns are filled."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class SlotLayer(CacheLayerMixin):
        is_sliding = False

        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.keys, self.values, self.filled = keys, values, start
            self.device, self.is_initialized = keys.device, True

        def lazy_initialization(self, key_states, value_states) -> None:
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            end = self.filled + key_states.shape[2]
            self.keys[:, :, self.filled : end] = key_states
            self.values[:, :, self.filled : end] = value_states
            self.filled = end
            return self.keys[:, :, :end], self.values[:, :, :end]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.filled + query_length, 0

        def get_seq_length(self) -> int:
            return self.filled

        def get_max_length(self) -> int:
            return self.keys.shape[2]

    return Cache(layers=[SlotLayer(k, v) for k, v in zip(cache.k, cache.v, strict=True)])


def _no_dropout(config: Any) -> dict[str, float]:
    """Set every dropout probability of ``config`` to 0; returns the values it had."""
    had = {
        name: value
        for name, value in config.to_dict().items()
        if isinstance(value, float) and value and ("dropout" in name or "pdrop" in name)
    }
    for name in had:
        setattr(config, name, 0.0)
    return had


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM with :class:`~loong_train.models.decoder.CausalLM`'s
    interface. Parameters keep the model's own names (``named_parameters``, ``state_dict`` and
    ``load_state_dict`` are the wrapped model's), so checkpoints and weight updates look exactly
    as ``transformers`` saves them."""

    shares_prefixes = False  # packed_hidden runs every row whole

    def __init__(self, inner: nn.Module, dropout: dict[str, float] | None = None) -> None:
        super().__init__()
        self.inner = inner.float()
        self._dropout = dropout or {}  # the checkpoint's dropout values, written back on save
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"
        )
        forward = inspect.signature(inner.forward).parameters
        self._keep_kwarg = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in forward), None)
        self.config = self._probe()

    @classmethod
    def from_pretrained(cls, path: str | Path, trust_remote_code: bool = False) -> HFCausalLM:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        dropout = _no_dropout(config)
        inner = AutoModelForCausalLM.from_pretrained(
            str(path), config=config, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
        return cls(inner, dropout)

    def _probe(self) -> GenericConfig:
        """The cache shape, read from one token through the model's own cache; refuses layers a
        full-length cache cannot stand in for."""
        hf = self.inner.config
        device = self.lm_head.weight.device
        with torch.no_grad():
            probe = torch.tensor([[0, 1, 2]], device=device) % self.lm_head.weight.shape[0]
            out = self.inner(input_ids=probe, use_cache=True)
            hidden = self.packed_hidden(probe[0], PackedRows.unshared([3]))
            if not torch.allclose(self.head(hidden), out.logits[0], rtol=1e-4, atol=1e-4):
                raise ValueError(
                    f"{type(self.inner).__name__}'s logits are not its LM head applied to its last hidden "
                    "state (a logit scale or soft cap, as Cohere, Granite and Gemma 2 have): the trainer "
                    "computes logits from hidden states in chunks and would compute other ones"
                )
        cache = out["cache"] if "cache" in out else out["past_key_values"]  # renamed in transformers 5
        layers = getattr(cache, "layers", None)
        if not layers:
            raise ValueError(
                f"{type(self.inner).__name__} returned no layered key/value cache; the generic path needs "
                "one (transformers' Cache with a layer per attention layer)"
            )
        odd = {type(layer).__name__ for layer in layers if type(layer).__name__ != "DynamicLayer"}
        if odd:
            raise ValueError(
                f"{type(self.inner).__name__} has cache layers of type {', '.join(sorted(odd))}: sliding-window "
                "or linear-attention layers are not supported by the generic path (a full-length cache "
                "would change what they attend to)"
            )
        shapes = {tuple(layer.keys.shape[1::2]) for layer in layers} | {
            tuple(layer.values.shape[1::2]) for layer in layers
        }
        if len(shapes) != 1:
            raise ValueError(
                f"{type(self.inner).__name__}'s layers cache keys/values of different shapes {sorted(shapes)}; "
                "the generic path needs one (heads, head_dim) for all"
            )
        ((heads, head_dim),) = shapes
        return GenericConfig(
            vocab_size=self.lm_head.weight.shape[0],
            num_hidden_layers=len(layers),
            num_key_value_heads=heads,
            head_dim=head_dim,
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 0) or 0),
            tie_word_embeddings=self.lm_head.weight is self.inner.get_input_embeddings().weight,
            model_type=hf.model_type,
            hf=hf.to_dict(),
        )

    @property
    def lm_head(self) -> nn.Module:
        return self.inner.get_output_embeddings()

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.inner.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.inner.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):
        return self.inner.load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        start: int = 0,
        last_only: bool = False,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {"use_cache": cache is not None}
        if last_only and self._keep_kwarg:
            kwargs[self._keep_kwarg] = 1
        if positions is not None:
            kwargs["position_ids"] = positions
        if mask is not None:  # boolean, True where attention is allowed -> additive
            dtype = self.lm_head.weight.dtype
            kwargs["attention_mask"] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, torch.finfo(dtype).min
            )
        if cache is not None:
            kwargs[self._cache_kwarg] = _slot_cache(cache, start)
        logits = self.inner(input_ids=input_ids, **kwargs).logits
        return logits[:, -1:] if last_only else logits

    def packed_hidden(self, ids: torch.Tensor, rows: PackedRows) -> torch.Tensor:
        """Hidden states [tokens, hidden] that ``head`` maps to logits, of rows packed end to end
        in ``ids`` [tokens] (``rows``: their lengths). ``transformers`` gets them right-padded
        (this path computes on padding and computes shared prefixes once per row; Loong's decoder
        does neither)."""
        lens = list(rows.lens)
        padded = torch.nn.utils.rnn.pad_sequence(list(ids.split(lens)), batch_first=True)
        hidden = self.inner.base_model(input_ids=padded).last_hidden_state
        keep = (
            torch.arange(padded.shape[1], device=ids.device) < torch.tensor(lens, device=ids.device)[:, None]
        )
        return hidden[keep]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head: final hidden states -> logits (the model's logits are exactly this,
        checked when it loads)."""
        return self.lm_head(hidden)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.inner.state_dict())

    def save_pretrained(self, path: str | Path) -> None:
        """``config.json`` (with the checkpoint's own dropout values) and safetensors weights as
        ``transformers`` writes them; not its ``generation_config.json``: the model directory's own
        is copied with the tokenizer."""
        path = Path(path)
        had = (path / "generation_config.json").exists()
        self.inner.save_pretrained(str(path))
        if not had:
            (path / "generation_config.json").unlink(missing_ok=True)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | self._dropout, indent=2, sort_keys=True))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
