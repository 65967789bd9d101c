"""Refuse a student/teacher pair whose tokenizers or chat templates differ.

A teacher scores the student's own token ids. If the two tokenizers disagree on what an id means,
on special tokens, or on how a conversation is rendered, the teacher scores text it would never
have produced and the distillation signal is silently biased (one report measured a +0.29
nats/token bias). :func:`check_tokenizers` compares four aspects:

- ``vocab``: size and token -> id of ``get_vocab()`` (added tokens included);
- ``special_tokens``: the named roles (``special_tokens_map``: eos, pad, ...), the set of special
  tokens (``all_special_tokens`` plus added tokens flagged special) and their ids;
- ``chat_template``: ``apply_chat_template(probe, tokenize=False)`` of a probe conversation (system,
  user, an assistant tool call, the tool's answer, an assistant reply, with a tool schema) and of
  a generation prompt;
- ``encoding``: the ids both tokenizers give the student's rendering of the probe.

It raises :class:`TokenizerMismatch` naming every difference: first differing tokens and ids,
the differing roles, a diff excerpt of the rendered probe. Tokenizers are duck-typed Hugging Face
tokenizers (``get_vocab``, ``special_tokens_map``, ``all_special_tokens``, ``added_tokens_decoder``,
``apply_chat_template``, ``encode``); this module never imports transformers.

A pair that differs on purpose passes with an explicit :class:`TokenizerMapping`, declared in
config next to the teacher (TOML)::

    [teachers.math.tokenizer_mapping]
    token_ids = [[151643, 128001], [151645, 128009]]   # student id -> teacher id
    accept = ["chat_template"]                         # reviewed differences

``token_ids`` lists student ids that mean a teacher id other than themselves; the scorer sends
``mapping.teacher_ids(ids)`` for the student's ids. Listed ids need only exist on the teacher side; every
other student token must sit at the same id in the teacher's vocabulary, and teacher tokens that
no student id reaches count as a vocabulary difference. ``accept`` names aspects whose remaining
differences the user has reviewed and accepts.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec

__all__ = ["TokenizerMapping", "TokenizerMismatch", "check_tokenizers"]

Aspect = Literal["vocab", "special_tokens", "chat_template", "encoding"]
IdPair = Annotated[list[int], msgspec.Meta(min_length=2, max_length=2)]  # [student id, teacher id]

_SHOWN = 5  # differing items quoted per aspect
_CANNOT = "cannot render the probe: "

_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
_CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
PROBE = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "", "tool_calls": [_CALL]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "2 + 3 = 5."},
]


class TokenizerMapping(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A declared, reviewed difference between a student's and a teacher's tokenizer.

    ``token_ids``: (student id, teacher id) pairs for ids whose meaning moves; ``accept``: aspects
    (``vocab``, ``special_tokens``, ``chat_template``, ``encoding``) whose differences are accepted.
    """

    token_ids: list[IdPair] = []
    accept: frozenset[Aspect] = frozenset()

    def teacher_ids(self, student_ids: Sequence[int]) -> list[int]:
        """The teacher ids that student ids stand for (each itself unless listed)."""
        ids = self._ids()
        return [ids.get(i, i) for i in student_ids]

    def _ids(self) -> dict[int, int]:
        return dict(self.token_ids)


class TokenizerMismatch(ValueError):
    """Student and teacher tokenizers differ; ``differences`` maps each aspect to what differs."""

    def __init__(self, differences: dict[str, str]):
        self.differences = differences
        lines = [f"- {aspect}: {what}" for aspect, what in differences.items()]
        super().__init__(
            "student and teacher tokenizers differ, so the teacher would score the student's tokens "
            "wrongly; use a matching pair or declare the difference in a TokenizerMapping:\n"
            + "\n".join(lines)
        )


def check_tokenizers(student: Any, teacher: Any, mapping: TokenizerMapping | None = None) -> None:
    """Raise :class:`TokenizerMismatch` unless the pair matches, up to what ``mapping`` declares."""
    mapping = mapping or TokenizerMapping()
    ids = mapping._ids()
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    rendered = _render(student)
    found = {
        "vocab": _vocab_difference(s_vocab, t_vocab, ids),
        "special_tokens": _special_difference(student, teacher, s_vocab, t_vocab, ids),
        "chat_template": _template_difference(rendered, _render(teacher)),
        "encoding": _encoding_difference(student, teacher, rendered[0], ids),
    }
    differences = {aspect: what for aspect, what in found.items() if what and aspect not in mapping.accept}
    if differences:
        raise TokenizerMismatch(differences)


# ----------------------------------------------------------------------------------------- vocab


def _vocab_difference(s_vocab: Mapping[str, int], t_vocab: Mapping[str, int], ids: dict[int, int]) -> str:
    """Student tokens at another teacher id (or absent), and teacher ids no student id reaches."""
    t_ids = set(t_vocab.values())
    moved, missing, reached = [], [], set()
    for token, i in sorted(s_vocab.items(), key=lambda kv: kv[1]):
        want = ids.get(i, i)
        reached.add(want)
        if i in ids:
            if want not in t_ids:
                missing.append(f"{token!r} (id {i} -> {want})")
        elif token not in t_vocab:
            missing.append(f"{token!r} (id {i})")
        elif t_vocab[token] != want:
            moved.append(f"{token!r} student id {want} vs teacher id {t_vocab[token]}")
    unreached = sorted((i, t) for t, i in t_vocab.items() if i not in reached)
    parts = []
    if len(s_vocab) != len(t_vocab):
        parts.append(f"sizes {len(s_vocab)} (student) vs {len(t_vocab)} (teacher)")
    parts += _listed("tokens at different ids", moved)
    parts += _listed("student tokens missing from the teacher", missing)
    parts += _listed("teacher tokens no student id maps to", [f"{t!r} (id {i})" for i, t in unreached])
    return "; ".join(parts)


def _listed(title: str, items: list[str]) -> list[str]:
    if not items:
        return []
    more = f", ... ({len(items)} in all)" if len(items) > _SHOWN else ""
    return [f"{title}: " + ", ".join(items[:_SHOWN]) + more]


# -------------------------------------------------------------------------------- special tokens


def _special_difference(student: Any, teacher: Any, s_vocab, t_vocab, ids: dict[int, int]) -> str:
    """Named roles, then the sets of special tokens, compared by (translated) id."""

    def s_id(token: str) -> int | None:
        i = s_vocab.get(token)
        return None if i is None else ids.get(i, i)

    s_special = {s_id(t): t for t in _specials(student)}
    t_special = {t_vocab.get(t): t for t in _specials(teacher)}
    return "; ".join(
        _role_differences(_roles(student), _roles(teacher), s_id, t_vocab.get)
        + _listed("special only in student", _only(s_special, t_special))
        + _listed("special only in teacher", _only(t_special, s_special))
    )


def _role_differences(s_roles, t_roles, s_id, t_id) -> list[str]:
    """Roles (eos_token, pad_token, ...) set on one side only or to tokens of different ids."""
    out = []
    for role in sorted(s_roles.keys() | t_roles.keys()):
        s_tok, t_tok = s_roles.get(role), t_roles.get(role)
        if s_tok is None or t_tok is None or [s_id(t) for t in s_tok] != [t_id(t) for t in t_tok]:
            out.append(f"{role}: student {_show(s_tok)} vs teacher {_show(t_tok)}")
    return out


def _roles(tok: Any) -> dict[str, tuple[str, ...]]:
    """``special_tokens_map`` with every value as a tuple (some roles hold a list of tokens)."""
    return {
        role: tuple(value) if isinstance(value, list | tuple) else (str(value),)
        for role, value in tok.special_tokens_map.items()
    }


def _specials(tok: Any) -> set[str]:
    added = getattr(tok, "added_tokens_decoder", {}).values()
    return set(tok.all_special_tokens) | {a.content for a in added if a.special}


def _only(a: dict[int | None, str], b: dict[int | None, str]) -> list[str]:
    return sorted(f"{t!r} (id {i})" for i, t in a.items() if i not in b)


def _show(tokens: tuple[str, ...] | None) -> str:
    if tokens is None:
        return "(unset)"
    return repr(tokens[0]) if len(tokens) == 1 else repr(list(tokens))


# ------------------------------------------------------------------------- template and encoding


def _render(tok: Any) -> tuple[str, str]:
    """The probe conversation and its generation prompt, as text (a render error becomes text too)."""
    return (
        _apply(tok, PROBE, tools=[_TOOL]),
        _apply(tok, PROBE[:2], tools=[_TOOL], add_generation_prompt=True),
    )


def _apply(tok: Any, messages: list[dict], **kwargs: Any) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as exc:  # a template's own error (unset, jinja) is what we compare, not a crash
        return f"{_CANNOT}{type(exc).__name__}: {exc}"


def _template_difference(student: tuple[str, str], teacher: tuple[str, str]) -> str:
    """The first probe rendered differently: a render failure as such, else where and a diff excerpt."""
    names = ("probe conversation", "generation prompt")
    for name, s, t in zip(names, student, teacher, strict=True):
        failed = [
            f"{side} {text}" for side, text in (("student", s), ("teacher", t)) if text.startswith(_CANNOT)
        ]
        if s != t and failed:
            return "; ".join(failed)
        if s != t:
            return f"rendered {name} differs from character {_first_difference(s, t)}:\n{_diff_excerpt(s, t)}"
    return ""


def _diff_excerpt(student: str, teacher: str, lines: int = 12) -> str:
    diff = list(
        difflib.unified_diff(
            student.splitlines(), teacher.splitlines(), "student", "teacher", n=1, lineterm=""
        )
    )
    shown = diff[:lines] + (["..."] if len(diff) > lines else [])
    return "\n".join(f"    {line}" for line in shown)


def _encoding_difference(student: Any, teacher: Any, text: str, ids: dict[int, int]) -> str:
    """Ids both give the student's rendered probe (student ids translated) and where they first part."""
    s_ids = [ids.get(i, i) for i in student.encode(text, add_special_tokens=False)]
    t_ids = teacher.encode(text, add_special_tokens=False)
    if s_ids == t_ids:
        return ""
    at = _first_difference(s_ids, t_ids)
    return (
        f"the student's rendered probe encodes to {len(s_ids)} (student) vs {len(t_ids)} (teacher) ids, "
        f"first differing at position {at}: student {s_ids[at : at + 4]} vs teacher {t_ids[at : at + 4]}"
    )


def _first_difference(a: Sequence, b: Sequence) -> int:
    """Index of the first differing item (the shorter length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
