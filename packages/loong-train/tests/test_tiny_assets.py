"""The tiny model, tokenizer and calc task: deterministic, template-exact, safe."""

import hashlib
import math

import pytest
import torch

from loong_agentflow import ChatML, ToolResult, chat_format
from loong_train.config import load_recipe
from loong_train.models.decoder import CausalLM
from loong_train.models.tokenizer import HFCodec, load_tokenizer
from loong_train.tiny import calc
from loong_train.tiny.warmstart import build_tiny, sft_loss, tokenizer_corpus


def _digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_build_is_deterministic(tmp_path, recipe, tiny_dir):
    assert _digest(build_tiny(tmp_path / "again", recipe)) == _digest(tiny_dir)
    assert (tmp_path / "again" / "tokenizer.json").read_text() == (tiny_dir / "tokenizer.json").read_text()


def test_tokenizer_round_trips_text_and_keeps_special_tokens_whole(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    text = '<|im_start|>user\ncompute 12*34<|im_end|>\n<tool_call>{"a": 1}</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    specials = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
    assert len(ids) == len(text) - sum(len(s) - 1 for s in specials)  # one id per char, one per special


def test_bpe_tokenizer_is_learned_from_the_task_and_encodes_any_text(tmp_path, bpe_dir):
    """The byte-level BPE: deterministic, within its vocabulary budget, special and tool tags
    whole, several characters per token on the task's own text, and any UTF-8 text round-trips,
    a multi-byte character spanning tokens that only decode together."""
    recipe = load_recipe("tiny-calc-agent", ['model.tokenizer="bpe"'])
    assert (build_tiny(tmp_path / "again", recipe) / "tokenizer.json").read_text() == (
        bpe_dir / "tokenizer.json"
    ).read_text()
    tok = load_tokenizer(bpe_dir)
    assert 259 < len(tok) <= recipe.model.bpe_vocab_size
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    texts = tokenizer_corpus(recipe, 200)
    chars = tokens = 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        for tag in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>"):
            assert text.count(tag) == ids.count(tok.convert_tokens_to_ids(tag))
        chars, tokens = chars + len(text), tokens + len(ids)
    assert chars / tokens > 3  # measured 4.3 characters per token on the calc transcripts
    text = "héllo wörld, 世界 🙂 <tool_call>{}</tool_call>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    emoji = tok.encode("🙂", add_special_tokens=False)
    assert len(emoji) == 4  # never in the task's text: one token per UTF-8 byte
    assert [tok.decode(emoji[:n]) for n in (1, 2, 3)] == ["\ufffd"] * 3 and tok.decode(emoji) == "🙂"


def test_bare_word_bpe_gives_a_word_one_token_wherever_it_stands(tmp_path):
    """``bpe-bare``: the space before a word is a token of its own, so a word after a space and
    the same word at a line start are the same token (with Qwen2's pattern they are two unrelated
    tokens); text still round-trips."""
    from loong_train.tiny.tokenizer import build_tokenizer

    corpus = ["Reverse this list of words: hundred, go\ngo, hundred", "Rotate:\n9 1\n4 1"] * 50
    bare = load_tokenizer(build_tokenizer(tmp_path / "bare", "bpe-bare", corpus, 400))
    qwen = load_tokenizer(build_tokenizer(tmp_path / "qwen", "bpe", corpus, 400))
    prompt, answer = "list of words: hundred, go\n", "go, hundred"
    for tok, same in ((bare, True), (qwen, False)):
        after_space = tok.encode(prompt, add_special_tokens=False)[-2]  # "go" in the prompt
        at_start = tok.encode(answer, add_special_tokens=False)[0]  # "go" starting the answer
        assert (tok.decode([at_start]) == "go") and ((after_space == at_start) is same)
        assert tok.decode(tok.encode(prompt + answer, add_special_tokens=False)) == prompt + answer


def test_a_bpe_vocabulary_too_small_for_the_bytes_is_refused_naming_the_key(tmp_path):
    recipe = load_recipe("tiny-calc-agent", ['model.tokenizer="bpe"', "model.bpe_vocab_size=200"])
    with pytest.raises(ValueError, match=r"bpe_vocab_size 200 is too small: a byte-level BPE holds 256 byte"):
        build_tiny(tmp_path, recipe)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_agent_token_layout_equals_the_chat_template(kind, tiny_dir, bpe_dir):
    """The white-box agent's pieces decode to exactly what apply_chat_template renders, and
    encoding them piece by piece gives the tokens of the whole transcript, with either tokenizer."""
    tok = load_tokenizer({"char": tiny_dir, "bpe": bpe_dir}[kind])
    task = calc.eval_tasks(1)[0]
    pieces = "".join(text for text, _ in calc.demonstration(task))
    messages = [
        *task["messages"],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "calc", "arguments": {"expr": task["expr"]}}}
            ],
        },
        {"role": "tool", "content": task["answer"]},
        {"role": "assistant", "content": task["answer"]},
    ]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert pieces + "\n" == rendered
    codec = HFCodec(tok)
    assert [i for t, _ in calc.demonstration(task) for i in codec.encode(t)] == codec.encode(pieces)
    assert ChatML.tool_turn([ToolResult(None, "7", ok=True)]).startswith(
        "\n<|im_start|>user\n<tool_response>7"
    )
    assert chat_format(tok) is ChatML  # white-box episodes on the tiny model keep ChatML's layout


def test_sft_loss_matches_float64_reference(tiny_dir):
    model = CausalLM.from_pretrained(tiny_dir)
    ids = torch.tensor([[1, 20, 30, 40, 50], [1, 21, 31, 41, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    with torch.no_grad():
        got = float(sft_loss(model, ids, mask, smoothing=0.1))
        logp = torch.log_softmax(model(ids).double(), -1)
    total, count = 0.0, 0
    for r in range(2):
        for j in range(1, 5):
            if mask[r, j]:
                nll = -float(logp[r, j - 1, ids[r, j]])
                uniform = -float(logp[r, j - 1].mean())
                total += 0.9 * nll + 0.1 * uniform
                count += 1
    assert math.isclose(got, total / count, rel_tol=1e-5)


@pytest.mark.parametrize(
    "expr,want", [("47*38", "1786"), ("10-99", "-89"), ("(2+3)*4", "20"), ("-5+2", "-3")]
)
def test_calc_tool_evaluates_integer_arithmetic(expr, want):
    assert calc.calc(expr) == want


@pytest.mark.parametrize("expr", ["__import__('os')", "2**99999", "1/0", "3.5*2", "a+b", "1" * 70])
def test_calc_tool_refuses_anything_else(expr):
    with pytest.raises((ValueError, SyntaxError)):
        calc.calc(expr)


def test_held_out_questions_never_appear_in_training():
    held_out = calc.eval_tasks(64)
    stream = calc.train_tasks(0, held_out)
    seen = {next(stream)["expr"] for _ in range(3000)}
    assert not seen & {t["expr"] for t in held_out}
    assert calc.reward(held_out[0], f" {held_out[0]['answer']} ") == 1.0
    assert calc.reward(held_out[0], "0") == 0.0
