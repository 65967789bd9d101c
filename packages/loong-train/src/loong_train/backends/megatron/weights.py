"""Hugging Face decoder-family weights <-> megatron-core GPTModel shards (local layer spec).

:func:`gather_hf_weights` exports: it all-gathers each tensor-parallel parameter over the TP
group, converts the stage with :func:`loong_transfermesh.megatron_to_hf`, and broadcasts every
stage's tensors over the pipeline group, so each rank ends with the whole model.

:func:`hf_to_megatron` is the inverse of ``megatron_to_hf``: given the full Hugging Face state
dict, build the state dict of one (tensor-parallel rank, pipeline stage) of a GPTModel built
with ``get_gpt_layer_local_spec(qk_layernorm=..., normalization="RMSNorm")`` (QK-norm for Qwen3,
q/k/v biases for Qwen2, neither for Llama and Mistral). What it does,
per tensor (``G`` query groups, ``P = heads / G`` query heads per group, ``d`` head dim):

- ``linear_qkv.weight`` (and ``.bias``): per group g the rows of its P query heads, then its key head, then its
  value head; rank r keeps groups ``[r G / tp, (r + 1) G / tp)``.
- ``linear_fc1.weight``: rank r's slice of gate rows, then its slice of up rows.
- ``linear_proj`` and ``linear_fc2`` (row parallel): column slice r of ``o_proj`` / ``down_proj``.
- Embedding and output layer (vocabulary parallel): rows padded with zeros to ``padded_vocab``
  (a multiple of tp), then row slice r. With tied embeddings the last stage of a pipeline keeps
  its own copy as ``output_layer.weight``; one stage holding both uses the embedding only.
- Norms are replicated; layer ``i`` of the stage is global layer ``first_layer + i``.

Written here rather than taken from mbridge/Megatron-Bridge for the reason given in
:mod:`loong_transfermesh.layout`; a round-trip test through ``megatron_to_hf`` checks it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loong_transfermesh import MegatronLayout, megatron_to_hf

__all__ = ["gather_hf_weights", "hf_to_megatron"]

_REPLICATED = {  # megatron suffix <- Hugging Face suffix
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_ROW_PARALLEL = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    layout: MegatronLayout,
    *,
    tp_rank: int,
    first_layer: int,
    num_layers: int,
    pre_process: bool,
    post_process: bool,
    padded_vocab: int,
) -> dict[str, torch.Tensor]:
    """The state dict of tensor-parallel rank ``tp_rank`` of the pipeline stage that holds
    global layers ``[first_layer, first_layer + num_layers)``."""
    out: dict[str, torch.Tensor] = {}
    vocab = _VocabSlicer(layout.tp, tp_rank, padded_vocab)
    if pre_process:
        out["embedding.word_embeddings.weight"] = vocab(hf["model.embed_tokens.weight"])
    for i in range(num_layers):
        out |= _layer(hf, layout, tp_rank, f"model.layers.{first_layer + i}.", f"decoder.layers.{i}.")
    if post_process:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not layout.tie_word_embeddings:
            out["output_layer.weight"] = vocab(hf["lm_head.weight"])
        elif not pre_process:
            out["output_layer.weight"] = vocab(hf["model.embed_tokens.weight"])
    return {k: v.contiguous() for k, v in out.items()}


class _VocabSlicer:
    def __init__(self, tp: int, rank: int, padded_vocab: int) -> None:
        self.tp, self.rank, self.padded = tp, rank, padded_vocab

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        return F.pad(w, (0, 0, 0, self.padded - w.shape[0])).chunk(self.tp)[self.rank]


def _layer(
    hf: Mapping[str, torch.Tensor], layout: MegatronLayout, rank: int, src: str, dst: str
) -> dict[str, torch.Tensor]:
    tp = layout.tp
    out = {dst + m: hf[src + h] for m, h in _REPLICATED.items() if src + h in hf}  # QK-norm: Qwen3 only
    out |= {dst + m: hf[src + h].chunk(tp, dim=1)[rank] for m, h in _ROW_PARALLEL.items()}
    gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
    out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    for kind in ("weight", "bias"):
        if src + f"self_attn.q_proj.{kind}" in hf:
            qkv = [hf[src + f"self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[dst + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(*qkv, layout, rank)
    return out


def _fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: MegatronLayout, rank: int
) -> torch.Tensor:
    """[heads*d, ...], [G*d, ...], [G*d, ...] -> rank's [G/tp * (P + 2) * d, ...]."""
    groups, d = layout.num_query_groups, layout.head_dim
    per_group, rest = layout.num_attention_heads // groups, q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
        dim=1,
    )
    return fused.chunk(layout.tp)[rank].reshape(-1, *rest)


def gather_hf_weights(
    named_params: Iterable[tuple[str, torch.Tensor]],
    layout: MegatronLayout,
    *,
    first_layer: int,
    tp_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup,
) -> dict[str, torch.Tensor]:
    """The whole model in HF naming from this rank's parameters (a collective over the model-
    parallel ranks). Replicated tensors may alias the parameters, as the torch backend's do."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.tp)]
    for name, p in named_params:
        parts = [p.detach()] * layout.tp
        if getattr(p, "tensor_model_parallel", False) and layout.tp > 1:
            parts = [torch.empty_like(p) for _ in range(layout.tp)]
            dist.all_gather(parts, p.detach().contiguous(), group=tp_group)
        for shard, part in zip(shards, parts, strict=True):
            shard[name] = part
    stage = dict(megatron_to_hf(shards, layout, layer_offset=first_layer))
    return stage if pp_group.size() == 1 else _from_every_stage(stage, pp_group)


def _from_every_stage(stage: dict[str, torch.Tensor], group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    device = next(iter(stage.values())).device
    for s in range(group.size()):
        src = dist.get_global_rank(group, s)
        meta = [[(k, v.shape, v.dtype) for k, v in stage.items()]]
        dist.broadcast_object_list(meta, src=src, group=group)
        for name, shape, dtype in meta[0]:
            mine = src == dist.get_rank()
            tensor = stage[name].contiguous() if mine else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=src, group=group)
            out[name] = tensor
    return out
