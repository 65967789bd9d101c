"""Shared by the Megatron backend tests: tiny random-init decoders of the families megatron-core
runs here, one three-row batch, the learning rate, and how results are compared."""

from __future__ import annotations

import torch

from loong_core.records import TrainBatch
from loong_train.models.decoder import CausalLM, DecoderConfig

__all__ = ["FAMILIES", "LR", "VOCAB", "cloned", "rel_gap", "tiny_batch", "tiny_model"]


VOCAB = 37  # odd: TP=2 pads the vocabulary by one row
LR = 2e-3
FAMILIES = {  # what differs from Qwen3 (QK-norm, no biases)
    "qwen3": {},
    "qwen2": {"model_type": "qwen2", "attention_bias": True},  # q/k/v biases, no QK-norm
    "llama": {  # no QK-norm, no biases, llama3 rope scaling with megatron-core's fixed factors
        "model_type": "llama",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
}  # fmt: skip


def tiny_model(tied: bool, layers: int = 2, family: str = "qwen3") -> CausalLM:
    cfg = DecoderConfig(
        **FAMILIES[family],
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
    )
    model = CausalLM(cfg)
    model.init_weights(seed=1, std=0.2)  # large enough for far-from-uniform logprobs
    return model


def tiny_batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    lens = [9, 6, 4]
    n = sum(lens)
    mask = [0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 1]
    adv = [a * m for a, m in zip([0.8] * 9 + [-1.1] * 6 + [0.3] * 4, mask, strict=True)]
    behaviour = (torch.randn(n, generator=gen) * 0.5 - 3.6).tolist()
    return TrainBatch(
        token_ids=torch.randint(0, VOCAB, (n,), generator=gen).tolist(),
        loss_mask=mask,
        advantages=adv,
        behaviour_logprobs=[b * m for b, m in zip(behaviour, mask, strict=True)],
        versions=[0 if m else -1 for m in mask],
        row_lens=lens,
        sample_ids=["a", "b", "c"],
        policy_version=0,
    )


def rel_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def cloned(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in weights.items()}  # named_weights() may alias the parameters
