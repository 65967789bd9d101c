"""White-box episodes in a model's own chat template: a Llama-3-style template (its own control
tokens, a tools block, no ChatML anywhere) against ``apply_chat_template`` itself.

Reference: the tokenizer's rendering of the finished transcript. A token-level engine replays a
scripted reply, so the subject is the layout (prompt, tool list, tool turns, end tokens), not
sampling."""

from __future__ import annotations

import asyncio

import pytest
from agentflow_testkit import CHARS

from loong_agentflow import (
    ChatML,
    TemplateChat,
    ToolAgent,
    ToolRegistry,
    chat_format,
    function_tool,
    run_episodes,
)
from loong_agentflow.agent import EpisodeSpec
from loong_core.protocols import SamplingParams
from loong_core.records import SpanSource, TokenSpan

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA_TEMPLATE = (
    "<|begin_of_text|>"
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nYou may call: "
    "{% for t in tools %}{{ t.function.name }}{{ t.function.parameters | tojson }} {% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _tokenizer(specials, template, eos):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {t: i for i, t in enumerate([*specials, *CHARS])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token=specials[-1]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    fast.chat_template = template
    return fast


class Codec:
    def __init__(self, tok):
        self.tok = tok
        self.special_tokens = [t.content for t in tok.added_tokens_decoder.values() if t.special]

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def encode_literal(self, text):
        return self.tok.encode(text, add_special_tokens=False, split_special_tokens=True)

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


class ReplayEngine:
    """Emits the next scripted reply's tokens and the end-of-turn token, whatever the prompt."""

    def __init__(self, codec, replies, end):
        self.codec, self.replies, self.end, self.prompts = codec, list(replies), end, []

    @property
    def weight_version(self):
        return 0

    async def generate(self, input_ids, sampling):
        self.prompts.append(list(input_ids))
        await asyncio.sleep(0)
        ids = self.codec.encode(self.replies.pop(0)) + self.codec.encode(self.end)
        return TokenSpan(token_ids=ids, source=SpanSource.MODEL, logprobs=[-0.5] * len(ids), weight_version=0)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_a_tool_episode_in_a_llama_template_is_the_templates_rendering_token_for_token():
    tok = _tokenizer(LLAMA_SPECIALS, LLAMA_TEMPLATE, "<|eot_id|>")
    chat, codec = chat_format(tok), Codec(tok)
    assert isinstance(chat, TemplateChat) and chat.END == "<|eot_id|>"
    tools = ToolRegistry([function_tool(add)])
    agent = ToolAgent(tools, lambda task, answer: float(answer == "5"), chat)
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+3? <|eot_id|>"}]
    engine = ReplayEngine(codec, [CALL, "5"], chat.END)
    sampling = SamplingParams(max_new_tokens=200, stop_token_ids=codec.encode(chat.END))
    [traj] = asyncio.run(
        run_episodes(agent, [EpisodeSpec("s", "g", {"messages": messages})], engine, codec, sampling)
    )
    assert traj.reward == 1.0 and traj.status.value == "ok"
    transcript = [*messages, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "5"}]
    schemas = tools.schemas()
    # the prompt the engine saw first is the template's rendering, tool list included
    assert codec.decode(engine.prompts[0]) == tok.apply_chat_template(
        messages, tools=schemas, add_generation_prompt=True, tokenize=False
    )
    assert 'You may call: add{"type": "object", "properties": {"a"' in codec.decode(engine.prompts[0])
    # the second prompt extends the first with the model's tokens and the template's tool turn
    assert codec.decode(engine.prompts[1]) == tok.apply_chat_template(
        transcript, tools=schemas, add_generation_prompt=True, tokenize=False
    )
    full = [*transcript, {"role": "assistant", "content": "5"}]
    assert codec.decode(traj.token_ids) == tok.apply_chat_template(full, tools=schemas, tokenize=False)
    # the user's "<|eot_id|>" is text, not the control token: it appears as its characters
    eot = codec.encode("<|eot_id|>")
    prompt = traj.spans[0].token_ids
    assert prompt.count(eot[0]) == 3  # the tools block's, the system turn's and the user turn's own ends only
    assert "ChatML" not in repr(type(chat)) and "<|im_start|>" not in codec.decode(traj.token_ids)


def test_a_template_that_renders_as_chatml_keeps_the_chatml_layout():
    from test_proxy_render import hf_tokenizer

    assert chat_format(hf_tokenizer()) is ChatML
    no_template = _tokenizer(LLAMA_SPECIALS, None, "<|eot_id|>")
    assert chat_format(no_template) is ChatML


def test_a_template_that_does_not_end_turns_with_the_stop_token_is_refused():
    tok = _tokenizer(
        LLAMA_SPECIALS, "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "<|eot_id|>"
    )
    with pytest.raises(ValueError, match=r"does not end an assistant turn with '<\|eot_id\|>'"):
        TemplateChat(tok)


def test_a_template_that_refuses_the_probe_keeps_chatml_with_a_warning(caplog):
    strict = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('roles must alternate') }}"
        "{% endif %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>{% endfor %}"
    )
    with caplog.at_level("WARNING"):
        assert chat_format(_tokenizer(LLAMA_SPECIALS, strict, "<|eot_id|>")) is ChatML
    assert "roles must alternate" in caplog.text
