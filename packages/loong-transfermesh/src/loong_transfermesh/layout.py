"""Megatron-core GPT weights (Qwen2/Qwen3 architecture) to Hugging Face names and shapes.

The trainer holds tensor-parallel shards in megatron-core's layout; engines load Hugging Face
names. ``megatron_to_hf`` takes the state dicts of the ``tp`` ranks of one pipeline stage and
yields Hugging Face ``(name, tensor)`` pairs one at a time, so a sender can stream them into its
buckets. What it undoes:

- **Tensor parallelism.** Column-parallel weights (fused QKV, fused gate/up, embedding, output
  layer) are split along dim 0 across ranks; row-parallel ones (attention output, MLP down) along
  dim 1; norms are replicated.
- **Fused QKV.** ``linear_qkv.weight`` is ``[groups * (q_per_group + 2) * head_dim, hidden]``,
  ordered by query group: for each group g its ``q_per_group`` query heads, then its key head,
  then its value head (``q_per_group = heads / groups``). Each rank holds ``groups / tp`` whole
  groups. The bias of Qwen2 (``linear_qkv.bias``) follows the same order.
- **Fused gate/up.** ``linear_fc1.weight`` is ``[2 * ffn / tp, hidden]`` per rank: that rank's
  gate rows, then its up rows.
- **Vocabulary padding.** Megatron pads the vocabulary to a multiple of ``128 * tp``; rows past
  the Hugging Face ``vocab_size`` are dropped.
- **Norm names.** Transformer Engine fuses the pre-attention and pre-MLP norms into the next
  linear layer (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); the local
  spec names them ``input_layernorm`` and ``pre_mlp_layernorm``. Both are accepted.

Written here rather than taken from a bridge (mbridge, Megatron-Bridge): those convert whole
model objects and need Transformer Engine and a GPU, while a weight sync converts raw shards as
they stream, on any host.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence

import msgspec
import torch

__all__ = ["MegatronLayout", "megatron_to_hf"]


class MegatronLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Shapes needed to undo megatron-core's fusions; ``from_hf_config`` reads them from a
    Hugging Face ``config.json`` dict."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    tp: int = 1
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf_config(cls, config: Mapping, tp: int = 1) -> MegatronLayout:
        heads = config["num_attention_heads"]
        return cls(
            num_attention_heads=heads,
            num_query_groups=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab_size=config["vocab_size"],
            tp=tp,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
        )

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups or self.num_query_groups % self.tp:
            raise ValueError(
                f"heads {self.num_attention_heads}, query groups {self.num_query_groups} and tp {self.tp} "
                "must divide: heads % groups == 0 and groups % tp == 0"
            )


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_RENAME = {  # megatron suffix -> (Hugging Face suffix, tensor-parallel split dim or None)
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight", None),
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", None),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", None),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight", None),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
}


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], layout: MegatronLayout, layer_offset: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield Hugging Face ``(name, tensor)`` pairs for the TP ranks' state dicts ``shards`` of one
    pipeline stage; ``layer_offset`` is the global index of the stage's first layer.

    Raises ValueError naming any tensor it does not know (nothing is silently dropped)."""
    if len(shards) != layout.tp:
        raise ValueError(f"expected {layout.tp} tensor-parallel shards, got {len(shards)}")
    for name in shards[0]:
        if name.endswith("._extra_state"):
            continue  # Transformer Engine's FP8 metadata, not a weight
        parts = [s[name] for s in shards]
        if m := _LAYER.fullmatch(name):
            prefix, suffix = f"model.layers.{int(m[1]) + layer_offset}.", m[2]
            yield from _layer_tensor(prefix, suffix, parts, layout, name)
        elif name == "embedding.word_embeddings.weight":
            yield "model.embed_tokens.weight", torch.cat(parts)[: layout.vocab_size]
        elif name == "output_layer.weight":
            if not layout.tie_word_embeddings:
                yield "lm_head.weight", torch.cat(parts)[: layout.vocab_size]
        elif name == "decoder.final_layernorm.weight":
            yield "model.norm.weight", parts[0]
        else:
            raise ValueError(f"no Hugging Face name for megatron tensor {name!r}")


def _layer_tensor(
    prefix: str, suffix: str, parts: list[torch.Tensor], layout: MegatronLayout, name: str
) -> Iterator[tuple[str, torch.Tensor]]:
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        for proj, tensor in zip("qkv", _split_qkv(parts, layout), strict=True):
            yield f"{prefix}self_attn.{proj}_proj.{kind}", tensor
    elif suffix == "mlp.linear_fc1.weight":
        halves = [p.chunk(2, dim=0) for p in parts]
        yield f"{prefix}mlp.gate_proj.weight", torch.cat([h[0] for h in halves])
        yield f"{prefix}mlp.up_proj.weight", torch.cat([h[1] for h in halves])
    elif suffix in _RENAME:
        hf, dim = _RENAME[suffix]
        yield prefix + hf, parts[0] if dim is None else torch.cat(parts, dim=dim)
    else:
        raise ValueError(f"no Hugging Face name for megatron tensor {name!r}")


def _split_qkv(parts: list[torch.Tensor], layout: MegatronLayout) -> tuple[torch.Tensor, ...]:
    """Undo the per-group [q..., k, v] fusion of each rank, then concatenate the ranks' groups."""
    per_group = layout.num_attention_heads // layout.num_query_groups
    qs, ks, vs = [], [], []
    for part in parts:
        rows = part.reshape(-1, per_group + 2, layout.head_dim, *part.shape[1:])  # [groups/tp, q+2, d, ...]
        qs.append(rows[:, :per_group].reshape(-1, *part.shape[1:]))
        ks.append(rows[:, per_group].reshape(-1, *part.shape[1:]))
        vs.append(rows[:, per_group + 1].reshape(-1, *part.shape[1:]))
    return torch.cat(qs), torch.cat(ks), torch.cat(vs)
