"""GGUF files as model sources: a tiny Llama written with gguf's own writer, converted through Loong,
against transformers' GGUF load and the model it was written from; and each bad file's error."""

import json
import logging

import gguf
import numpy as np
import pytest
import torch
from gguf_testkit import tiny_llama_gguf, write_llama_gguf

from loong_core.config import ConfigError
from loong_train.models.auto import load_causal_lm
from loong_train.models.decoder import CausalLM
from loong_train.models.gguf import convert
from loong_train.models.source import resolve
from loong_train.models.tokenizer import end_of_turn_ids, load_tokenizer

TEXTS = ["compute 47*38", "The answer is 1786.\n", "<|im_start|>user\nhi there<|im_end|>\n"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny Llama with a byte-level BPE tokenizer, and its GGUF file."""
    return tiny_llama_gguf(tmp_path_factory.mktemp("gguf"), TEXTS * 20)


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
