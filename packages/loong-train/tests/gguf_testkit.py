"""A tiny Llama as a GGUF file, written with gguf's own writer the way llama.cpp's converter lays
a Llama out (query/key rows permuted, tokens, merges and chat template in the metadata), for tests
that need a GGUF file without downloading one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loong_train.models.tokenizer import load_tokenizer
from loong_train.tiny.tokenizer import CHAT_TEMPLATE, build_tokenizer


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's query/key row order (its converter's permute): rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, model, tokenizer, arch="llama", raw=None, template=CHAT_TEMPLATE):
    """``model`` (a transformers Llama) and ``tokenizer`` as a GGUF file, float32 tensors, written
    the way llama.cpp's converter lays a Llama out; ``raw``: one tensor of another type instead."""
    c = model.config
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_chat_template(template)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    parts = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(c.num_hidden_layers):
        for hf, gg in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for hf, gg in names.items():
        t = sd[hf]
        if gg.endswith("attn_q.weight"):
            t = _permute(t, c.num_attention_heads)
        elif gg.endswith("attn_k.weight"):
            t = _permute(t, c.num_key_value_heads)
        if raw and gg == raw[0]:
            w.add_tensor(gg, raw[1], raw_shape=raw[2], raw_dtype=raw[3])
        else:
            w.add_tensor(gg, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_llama_gguf(
    root: Path, texts: list[str], template: str = CHAT_TEMPLATE, seed: int = 0
) -> dict[str, Any]:
    """A random tiny Llama (tied embeddings) with a byte-level BPE trained on ``texts``, written
    as ``root/tiny-llama.gguf``: ``{"path", "model", "tokenizer"}``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(build_tokenizer(root / "tok", "bpe", texts, vocab_size=300))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = LlamaForCausalLM(config).eval()
    path = write_llama_gguf(root / "tiny-llama.gguf", model, tokenizer, template=template)
    return {"path": path, "model": model, "tokenizer": tokenizer}
