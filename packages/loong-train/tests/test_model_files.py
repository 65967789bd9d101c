"""What a checkpoint carries besides weights, and where end-of-turn ids come from."""

import json

from loong_train.models.tokenizer import copy_model_files, end_of_turn_ids


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
