"""check_tokenizers on real Hugging Face tokenizers built locally (tokenizers + PreTrainedTokenizerFast):
a matching pair passes, each kind of difference fails naming what differs, a mapping lets it through."""

import ast
import pathlib
import tomllib

import pytest

from loong_core import ConfigError, dump_toml, load_config
from loong_teacher import TokenizerMapping, TokenizerMismatch, check_tokenizers

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL = ["<tool_call>", "</tool_call>"]
CHARS = ["\n", *[chr(c) for c in range(32, 127)]]
A, B = len(SPECIAL + TOOL) + 1 + ord("a") - 32, len(SPECIAL + TOOL) + 1 + ord("b") - 32

TOOL_CALL = "{{- '<tool_call>{\"name\": \"' + tc.function.name + '\", \"arguments\": ' + (tc.function.arguments | tojson) + '}</tool_call>' }}"
TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}" + TOOL_CALL + "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_tokenizer(*, tokens=None, special=SPECIAL, eos="<|im_end|>", template=TEMPLATE, lowercase=False):
    tokens = tokens or SPECIAL + TOOL + CHARS
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token="<|endoftext|>"
        )
    )
    if lowercase:
        tok.normalizer = tokenizers.normalizers.Lowercase()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in special])
    plain = [t for t in SPECIAL + TOOL if t not in special]
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in plain])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>", chat_template=template
    )


def swapped(i, j):
    tokens = SPECIAL + TOOL + CHARS
    tokens[i], tokens[j] = tokens[j], tokens[i]
    return tokens


def mismatch(student, teacher, mapping=None) -> TokenizerMismatch:
    with pytest.raises(TokenizerMismatch) as info:
        check_tokenizers(student, teacher, mapping)
    assert isinstance(info.value, ValueError)
    return info.value


def test_identical_pair_passes():
    check_tokenizers(make_tokenizer(), make_tokenizer())


def test_moved_tokens_are_named_with_their_ids():
    err = mismatch(make_tokenizer(), make_tokenizer(tokens=swapped(A, B)))
    assert set(err.differences) == {"vocab", "encoding"}
    assert f"'a' student id {A} vs teacher id {B}" in str(err)
    assert f"'b' student id {B} vs teacher id {A}" in str(err)
    assert "first differing at position" in err.differences["encoding"]


def test_shifted_vocabulary_reports_sizes_first_tokens_and_count():
    err = mismatch(make_tokenizer(), make_tokenizer(tokens=["<|pad|>", *SPECIAL, *TOOL, *CHARS]))
    vocab = err.differences["vocab"]
    n = len(SPECIAL + TOOL + CHARS)
    assert f"sizes {n} (student) vs {n + 1} (teacher)" in vocab
    assert "'<|endoftext|>' student id 0 vs teacher id 1" in vocab
    assert f"({n} in all)" in vocab
    assert f"teacher tokens no student id maps to: '~' (id {n})" in vocab


def test_extra_teacher_token_is_named():
    err = mismatch(make_tokenizer(), make_tokenizer(tokens=[*SPECIAL, *TOOL, *CHARS, "<|extra|>"]))
    assert set(err.differences) == {"vocab"}
    assert f"teacher tokens no student id maps to: '<|extra|>' (id {len(SPECIAL + TOOL + CHARS)})" in str(err)


def test_different_eos_is_named():
    err = mismatch(make_tokenizer(), make_tokenizer(eos="<|endoftext|>"))
    assert err.differences == {"special_tokens": "eos_token: student '<|im_end|>' vs teacher '<|endoftext|>'"}


def test_token_special_on_one_side_only_is_named():
    err = mismatch(make_tokenizer(), make_tokenizer(special=["<|endoftext|>", "<|im_end|>"]))
    assert err.differences == {"special_tokens": "special only in student: '<|im_start|>' (id 1)"}


def test_tool_call_rendering_difference_shows_a_diff_excerpt():
    teacher_template = TEMPLATE.replace("'<tool_call>{", "'<tool_call>\\n{").replace(
        "}</tool_call>", "}\\n</tool_call>"
    )
    err = mismatch(make_tokenizer(), make_tokenizer(template=teacher_template))
    assert set(err.differences) == {"chat_template"}
    what = err.differences["chat_template"]
    assert what.startswith("rendered probe conversation differs from character")
    assert "--- student" in what and "+++ teacher" in what
    assert '-<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>' in what
    assert '+{"name": "add", "arguments": {"a": 2, "b": 3}}' in what


def test_generation_prompt_difference_is_caught():
    thinking = TEMPLATE.replace(
        "'<|im_start|>assistant\\n' }}{%- endif", "'<|im_start|>assistant\\n<think>\\n' }}{%- endif"
    )
    err = mismatch(make_tokenizer(), make_tokenizer(template=thinking))
    assert "rendered generation prompt differs" in err.differences["chat_template"]
    assert "+<think>" in err.differences["chat_template"]


def test_missing_template_is_a_difference():
    err = mismatch(make_tokenizer(), make_tokenizer(template=None))
    assert err.differences["chat_template"].startswith("teacher cannot render the probe: ValueError: ")


def test_same_vocabulary_different_encoding_is_caught():
    err = mismatch(make_tokenizer(), make_tokenizer(lowercase=True))
    assert set(err.differences) == {"encoding"}


def test_every_difference_is_reported_at_once():
    err = mismatch(make_tokenizer(), make_tokenizer(tokens=swapped(A, B), eos="<|endoftext|>", template=None))
    assert set(err.differences) == {"vocab", "special_tokens", "chat_template", "encoding"}
    for aspect in err.differences:
        assert f"- {aspect}: " in str(err)


# ----------------------------------------------------------------------------------------- mapping


def test_declared_id_mapping_lets_a_permuted_vocabulary_through():
    mapping = TokenizerMapping(token_ids=[[A, B], [B, A]])
    check_tokenizers(make_tokenizer(), make_tokenizer(tokens=swapped(A, B)), mapping)
    assert mapping.teacher_ids([A, B, 0]) == [B, A, 0]


def test_a_wrong_id_mapping_still_fails():
    mapping = TokenizerMapping(token_ids=[[A, B]])  # 'b' still moved
    err = mismatch(make_tokenizer(), make_tokenizer(tokens=swapped(A, B)), mapping)
    assert f"'b' student id {B} vs teacher id {A}" in err.differences["vocab"]


def test_accepting_an_aspect_lets_only_that_aspect_through():
    teacher = make_tokenizer(template=None)
    check_tokenizers(make_tokenizer(), teacher, TokenizerMapping(accept=frozenset({"chat_template"})))
    err = mismatch(
        make_tokenizer(),
        make_tokenizer(template=None, eos="<|endoftext|>"),
        TokenizerMapping(accept={"chat_template"}),
    )
    assert set(err.differences) == {"special_tokens"}


def test_mapping_loads_from_config_and_rejects_unknown_aspects():
    mapping = load_config({"token_ids": [[A, B], [B, A]], "accept": ["encoding"]}, TokenizerMapping)
    assert mapping == TokenizerMapping(token_ids=[[A, B], [B, A]], accept=frozenset({"encoding"}))
    assert load_config(tomllib.loads(dump_toml(mapping)), TokenizerMapping) == mapping
    with pytest.raises(ConfigError, match="accept"):
        load_config({"accept": ["templates"]}, TokenizerMapping)
    with pytest.raises(ConfigError, match="token_ids"):
        load_config({"token_ids": [[A, B, 3]]}, TokenizerMapping)


def test_compat_module_does_not_import_transformers():
    source = pathlib.Path(__file__).parents[1] / "src" / "loong_teacher" / "compat.py"
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert imported <= {"__future__", "collections", "difflib", "typing", "msgspec"}
