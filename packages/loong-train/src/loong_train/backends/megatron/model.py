"""The megatron-core model of a Hugging Face decoder config, as the Megatron backend builds it.

A Hugging Face config of a fast decoder family (Qwen3, Qwen2, Llama, Mistral) becomes a
``TransformerConfig`` + ``GPTModel`` with the local (torch-native) layer spec: RMSNorm, SwiGLU,
rotary embedding (rotate-half, ``rope_theta``, ``linear`` or Llama 3.1's ``llama3`` scaling),
tied or untied embeddings; per-head RMSNorm on queries and keys for Qwen3, q/k/v biases for
Qwen2 (:func:`megatron_problem` names what it cannot build).

Importing this module imports no megatron-core: :func:`megatron_problem` checks a config without
it, and :func:`transformer_config` and :func:`gpt_model` import it when called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loong_train.backends.megatron.cpu import cpu_compat
from loong_train.models.decoder import DecoderConfig

__all__ = ["gpt_model", "megatron_problem", "transformer_config"]

_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def megatron_problem(cfg: DecoderConfig) -> str:
    """Why the megatron backend cannot train a model of this config ('' when it can).

    It covers the fast decoder families: Qwen3 (QK-norm), Qwen2 (q/k/v biases), Llama and Mistral,
    with rope scaling ``linear`` or ``llama3`` as megatron-core implements it (its llama3 form
    fixes ``low_freq_factor`` 1, ``high_freq_factor`` 4 and ``original_max_position_embeddings``
    8192, the values of Llama 3.1 and 3.2). Other biases have no place in its layer spec here.
    """
    if cfg.mlp_bias or (cfg.attention_bias and cfg.model_type != "qwen2"):
        return (
            f"{cfg.model_type} with mlp_bias / attention_bias: the local layer spec here has q/k/v "
            "biases only (Qwen2's)"
        )
    scaling = cfg.rope_scaling or {}
    odd = {k: scaling.get(k) for k, v in _LLAMA3_FIXED.items() if scaling.get(k) != v}
    if scaling.get("rope_type", scaling.get("type")) == "llama3" and odd:
        return f"llama3 rope scaling with {odd}: megatron-core's fixes {_LLAMA3_FIXED}"
    return ""


def _rope_args(cfg: DecoderConfig) -> dict:
    """GPTModel's rope keywords for the config's rope scaling (see :func:`megatron_problem`)."""
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        return {"rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}
    if kind == "linear":  # positions divided by the factor: the same as every frequency
        return {"seq_len_interpolation_factor": float(scaling["factor"])}
    return {}


def transformer_config(cfg: DecoderConfig, tp: int, pp: int):
    """The megatron-core ``TransformerConfig`` of a decoder-family model, fused CUDA kernels off."""
    from megatron.core.transformer import TransformerConfig

    if cfg.num_hidden_layers % pp:
        raise ValueError(f"{cfg.num_hidden_layers} layers do not split evenly into {pp} pipeline stages")
    return TransformerConfig(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        qk_layernorm=cfg.qk_norm,
        add_qkv_bias=cfg.attention_bias,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
        # Overwritten by the HF weights, but megatron-core marks tensor-parallel parameters
        # (``tensor_model_parallel``, ``partition_dim``) only while initialising them.
        perform_initialization=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        batch_p2p_sync=False,
    )


def gpt_model(
    cfg: DecoderConfig, tp: int, pp: int, *, vocab_size: int, pre_process: bool, post_process: bool
):
    """One pipeline stage's ``GPTModel`` (local layer spec) with ``vocab_size`` rows of embedding,
    built under :func:`~loong_train.backends.megatron.cpu.cpu_compat`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with cpu_compat():
        return GPTModel(
            config=transformer_config(cfg, tp, pp),
            transformer_layer_spec=get_gpt_layer_local_spec(
                qk_layernorm=cfg.qk_norm, normalization="RMSNorm"
            ),
            vocab_size=vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=cfg.rope_theta,
            **_rope_args(cfg),
        )
