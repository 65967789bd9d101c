"""GGUF files as model sources: a tiny Llama written with gguf's own writer, converted through Loong,
against transformers' GGUF load and the model it was written from; and each bad file's error."""

import json
import logging

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from loong_core.config import ConfigError  # noqa: E402
from loong_train.models.auto import load_causal_lm  # noqa: E402
from loong_train.models.decoder import CausalLM  # noqa: E402
from loong_train.models.gguf import convert  # noqa: E402
from loong_train.models.source import resolve  # noqa: E402
from loong_train.models.tokenizer import end_of_turn_ids, load_tokenizer  # noqa: E402
from loong_train.tiny.tokenizer import CHAT_TEMPLATE, build_tokenizer  # noqa: E402

TEXTS = ["compute 47*38", "The answer is 1786.\n", "<|im_start|>user\nhi there<|im_end|>\n"]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's query/key row order (its converter's permute): rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, model, tokenizer, arch="llama", raw=None):
    """``model`` (a transformers Llama) and ``tokenizer`` as a GGUF file, float32 tensors, written
    the way llama.cpp's converter lays a Llama out; ``raw``: one tensor of another type instead."""
    c = model.config
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
    w.add_chat_template(CHAT_TEMPLATE)
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama with a byte-level BPE tokenizer, and its GGUF file."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("gguf")
    tok_dir = build_tokenizer(root / "tok", "bpe", TEXTS * 20, vocab_size=300)
    tokenizer = load_tokenizer(tok_dir)
    torch.manual_seed(0)
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
    path = write_llama_gguf(root / "tiny-llama.gguf", model, tokenizer)
    return {"root": root, "model": model, "tokenizer": tokenizer, "path": path}


def test_a_converted_gguf_runs_on_loongs_decoder_with_transformers_logits(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    out = convert(tiny["path"], tmp_path)
    model = load_causal_lm(out)
    assert isinstance(model, CausalLM)  # Loong's own Llama, not the generic path
    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny["path"].parent), gguf_file=tiny["path"].name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([tiny["tokenizer"].encode(TEXTS[0] + TEXTS[1])])
    with torch.no_grad():
        ours = model(ids).float()
        theirs = reference(ids).logits
        original = tiny["model"](ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours, original, rtol=0, atol=1e-5)  # the query/key order was undone


def test_the_converted_tokenizer_template_and_end_of_turn_are_the_files(tiny, tmp_path):
    out = convert(tiny["path"], tmp_path)
    converted, original = load_tokenizer(out), tiny["tokenizer"]
    for text in [*TEXTS, "42 + 17 = 59, isn't it?"]:
        assert converted.encode(text, add_special_tokens=False) == original.encode(
            text, add_special_tokens=False
        )
    chat = [{"role": "user", "content": "compute 2+2"}]
    assert converted.apply_chat_template(chat, tokenize=False) == original.apply_chat_template(
        chat, tokenize=False
    )
    assert end_of_turn_ids(converted, out) == [original.convert_tokens_to_ids("<|im_end|>")]
    marker = json.loads((out / "loong-gguf.json").read_text())
    assert marker["architecture"] == "llama" and marker["tensor_types"] == ["F32"]


def test_a_file_is_converted_once_and_found_by_content(tiny, tmp_path, caplog):
    out = convert(tiny["path"], tmp_path)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    copy = tmp_path / "elsewhere" / tiny["path"].name
    copy.parent.mkdir()
    copy.write_bytes(tiny["path"].read_bytes())
    with caplog.at_level(logging.INFO, logger="loong.models"):
        again = resolve(str(copy), tmp_path)  # a recipe's model.path naming the file
    assert again == out and (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert "from an earlier run" in caplog.text
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == [out.name]  # no temporary left behind


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"GGUF file .*nothing\.gguf does not exist"):
        resolve(str(tmp_path / "nothing.gguf"), tmp_path)


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"PK\x03\x04 a zip")
    with pytest.raises(ConfigError, match=r"model\.gguf is not a GGUF file: it starts with b'PK"):
        convert(tmp_path / "model.gguf", tmp_path)


def test_a_truncated_file_is_named(tiny, tmp_path):
    data = tiny["path"].read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 200):  # inside the tensor data, and inside the metadata
        short = tmp_path / f"cut-{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ConfigError, match=rf"cut-{cut}\.gguf (is truncated|cannot be read as GGUF)"):
            convert(short, tmp_path)
    assert not (tmp_path / "gguf").exists() or not any((tmp_path / "gguf").iterdir())


def test_an_architecture_transformers_cannot_load_is_named(tiny, tmp_path):
    path = write_llama_gguf(tmp_path / "odd.gguf", tiny["model"], tiny["tokenizer"], arch="rwkv6")
    with pytest.raises(ConfigError, match=r"odd\.gguf: architecture 'rwkv6' is not one transformers'"):
        convert(path, tmp_path)


def test_a_quantization_type_nothing_can_dequantize_is_named(tiny, tmp_path):
    # Q8_1 (llama.cpp uses it only for activations): the norm's 64 values as 2 blocks of 32
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[q8_1]
    blocks = np.zeros(tiny["model"].config.hidden_size // block * size, dtype=np.uint8)
    raw = ("output_norm.weight", blocks, blocks.shape, q8_1)  # the shape in bytes, as gguf's writer takes it
    path = write_llama_gguf(tmp_path / "q81.gguf", tiny["model"], tiny["tokenizer"], raw=raw)
    with pytest.raises(ConfigError, match=r"q81\.gguf: quantization type\(s\) Q8_1 cannot be dequantized"):
        convert(path, tmp_path)


def test_a_file_inside_an_installed_package(tmp_path):
    with pytest.raises(ConfigError, match=r"the Python package 'no_such_pkg' is not installed"):
        resolve("pkg:no_such_pkg/model.gguf", tmp_path)
    with pytest.raises(ConfigError, match=r"the package 'loong_train' holds no 'nothing\.gguf'"):
        resolve("pkg:loong_train/nothing.gguf", tmp_path)
    with pytest.raises(ConfigError, match=r"expected 'pkg:<top-level module>/<file inside it>'"):
        resolve("pkg:loong_train", tmp_path)
    recipes = resolve("pkg:loong_train/recipes", tmp_path)  # a directory inside a package: as it is
    assert recipes.is_dir() and (recipes / "tiny-calc-agent.toml").is_file()
