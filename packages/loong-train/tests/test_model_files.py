"""What a checkpoint carries besides weights, and where end-of-turn ids come from."""

import json
import shutil

import pytest
from gguf_testkit import tiny_llama_gguf
from transformers import AutoTokenizer

from loong_train.models.gguf import convert
from loong_train.models.tokenizer import _declared_backend, copy_model_files, end_of_turn_ids, load_tokenizer

TEXTS = ["compute 47*38", "The answer is 1786.\n", "<|im_start|>user\nhi <b>there</b><|im_end|>\n"]


class _Tokenizer:
    eos_token_id = 7


def test_checkpoints_keep_tokenizer_template_and_generation_config(tmp_path):
    src, dst = tmp_path / "model", tmp_path / "ckpt"
    src.mkdir(), dst.mkdir()
    names = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]
    for name in [*names, "config.json", "model.safetensors", "notes.txt"]:
        (src / name).write_text(name)
    copy_model_files(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == sorted(names)  # weights and config: the backend's


def test_end_of_turn_ids_prefer_the_generation_config(tmp_path):
    assert end_of_turn_ids(_Tokenizer(), tmp_path) == [7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert end_of_turn_ids(_Tokenizer(), tmp_path) == [151645, 151643]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert end_of_turn_ids(_Tokenizer(), tmp_path) == [3]


@pytest.fixture(params=["tiny", "bpe", "gguf"])
def tokenizer_dir(request, tiny_dir, bpe_dir, tmp_path_factory):
    """The tiny recipes' character tokenizer and byte-level BPE (declared PreTrainedTokenizerFast,
    Qwen3), and a GGUF file's tokenizer as Loong converts it (declared TokenizersBackend, Llama)."""
    if request.param == "gguf":
        made = tiny_llama_gguf(tmp_path_factory.mktemp("gguf"), TEXTS * 20)
        return convert(made["path"], tmp_path_factory.mktemp("converted"))
    return {"tiny": tiny_dir, "bpe": bpe_dir}[request.param]


def test_a_declared_tokenizers_backend_loads_as_autotokenizer_loads_it(tokenizer_dir):
    assert _declared_backend(tokenizer_dir)  # the direct load is what this compares
    ours, auto = load_tokenizer(tokenizer_dir), AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab() and len(ours) == len(auto)
    assert ours.all_special_tokens == auto.all_special_tokens
    assert (ours.eos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)
    for text in [*TEXTS, "42 + 17 = 59, isn't it?"]:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == auto.encode(
                text, add_special_tokens=special
            )
        ids = auto.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == auto.decode(ids)
    chat = [{"role": "user", "content": "compute 2+2"}, {"role": "assistant", "content": "4"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)


def test_a_tokenizer_with_code_or_a_listed_model_type_goes_through_autotokenizer(tiny_dir, tmp_path):
    from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

    for change in ("auto_map", "model_type"):
        where = tmp_path / change
        shutil.copytree(tiny_dir, where)
        if change == "auto_map":
            declared = json.loads((where / "tokenizer_config.json").read_text())
            declared["auto_map"] = {"AutoTokenizer": [None, "tokenization_mine.MyTokenizer"]}
            (where / "tokenizer_config.json").write_text(json.dumps(declared))
        else:
            config = json.loads((where / "config.json").read_text())
            config["model_type"] = sorted(MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)[0]
            (where / "config.json").write_text(json.dumps(config))
        assert not _declared_backend(where)
    assert not _declared_backend(tmp_path / "nothing here")
