"""Typed TOML configuration: load a TOML file into a msgspec Struct, apply overrides, write it back.

Every Loong component declares its settings as a msgspec ``Struct`` with ``forbid_unknown_fields=True``
and ``kw_only=True``; this module is the single place where TOML meets those structs. It exists so that a
typo or a wrong type in a recipe fails at start-up with a message that names the dotted key and what was
expected, instead of surfacing hours into a run:

    config key 'train.lr': expected float, got str ('abc')
    unknown config key 'train.lrr' (did you mean 'lr'? known keys in [train]: batch_size, lr)
    could not parse recipe.toml: Invalid value (at line 3, column 6)

Pipeline of :func:`load_config`: read TOML (or take a parsed dict) -> apply ``dotted.key=value`` overrides
(values parsed as TOML, falling back to a plain string) -> ``msgspec.convert`` -> translate any
``msgspec.ValidationError`` into :class:`ConfigError`. Cross-field checks belong to the struct's
``__post_init__`` (raise ``ValueError``); they surface here as ``ConfigError`` naming the table.

:func:`dump_toml` writes a resolved config (the ``config.toml`` of a run directory) such that
``load_config(tomllib.loads(dump_toml(x)), type(x)) == x``.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import ipaddress
import pathlib
import re
import tomllib
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
import msgspec.inspect

__all__ = ["ConfigError", "apply_override", "dump_toml", "is_loopback", "load_config"]

S = TypeVar("S", bound=msgspec.Struct)

# A path segment: a field name, a list index, or "..." for "some key of a dict".
Segment = str | int


class ConfigError(ValueError):
    """A configuration could not be read or does not match its Struct; the message names the key."""


# --------------------------------------------------------------------------------------------- loading


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP address) is this machine's loopback. Loong's servers bind
    loopback by default and refuse any other address without a key; this is the one check."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_config(
    source: str | pathlib.Path | dict[str, Any], kind: type[S], overrides: Sequence[str] = ()
) -> S:
    """Load ``source`` (a TOML file path, or an already-parsed dict) into the Struct type ``kind``.

    ``overrides`` are ``"dotted.key=value"`` strings applied in order before conversion, e.g.
    ``["train.lr=1e-4", "rollout.engine.type=sglang"]``. A dict ``source`` is not mutated.
    Raises :class:`ConfigError` for unreadable or malformed TOML, bad overrides, wrong types,
    unknown or missing keys, and ``ValueError`` raised by a struct's ``__post_init__``.
    """
    data = copy.deepcopy(source) if isinstance(source, dict) else _read_toml(pathlib.Path(source))
    for override in overrides:
        apply_override(data, override)
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, data, kind)) from exc


def _read_toml(path: pathlib.Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"could not parse {path}: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"could not read config file {path}: {exc.strerror or exc}") from exc


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set ``"a.b.c=value"`` into the nested dict ``data``, creating tables as needed.

    ``value`` is parsed as a TOML value (``1e-4`` -> float, ``true`` -> bool, ``[1, 2]`` -> list,
    ``"x"`` -> str); anything that is not valid TOML is kept as a plain string (``sglang`` -> ``"sglang"``).
    """
    key, sep, raw = override.partition("=")
    parts = [p.strip() for p in key.split(".")]
    if not sep or not all(parts):
        raise ConfigError(f"bad override {override!r}: expected 'dotted.key=value'")
    table = data
    for i, part in enumerate(parts[:-1]):
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"bad override {override!r}: config key '{where}' is not a table")
    table[parts[-1]] = _parse_value(raw.strip())


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


# ------------------------------------------------------------------------------- error translation

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_EXPECTED = re.compile(r"^Expected `(?P<exp>[^`]+)`(?P<extra>[^,]*?)(?:, got `(?P<got>[^`]+)`)?$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<key>[^`]+)`$")
_BAD_ENUM = re.compile(r"^Invalid enum value (?P<value>.+)$")
_BAD_TAG = re.compile(r"^Invalid value (?P<value>.+)$")
_TOML_NAMES = {"object": "table", "null": "nothing", "array": "array"}


def _explain(exc: msgspec.ValidationError, data: Any, kind: type) -> str:
    """Turn msgspec's ``"Expected `float`, got `str` - at `$.train.lr`"`` into a message about keys."""
    match = _AT.match(str(exc))
    assert match is not None  # the pattern matches any string
    msg, path = match["msg"], _parse_path(match["path"] or "")
    if isinstance(exc.__cause__, ValueError | TypeError):  # raised by a __post_init__
        return f"invalid config{_table_label(path, ' ')}: {exc.__cause__}"
    if m := _UNKNOWN.match(msg):
        return _unknown_key(path, m["key"], kind, data)
    if m := _MISSING.match(msg):
        tags = _tags(_type_at(kind, path, data), m["key"])
        return f"missing required config key '{_dotted([*path, m['key']])}'{tags}"
    where = f"config key '{_dotted(path)}'" if path else "config"
    if m := _EXPECTED.match(msg):
        return f"{where}: expected {_expected(m)}{_got(m['got'], data, path)}"
    if m := _BAD_ENUM.match(msg):
        return f"{where}: invalid value {m['value']}{_choices(_type_at(kind, path))}"
    if (m := _BAD_TAG.match(msg)) and path and (tags := _tags(_type_at(kind, path[:-1], data), path[-1])):
        return f"{where}: invalid value {m['value']}{tags}"
    return f"{where}: {msg.replace('`', '')}"


def _parse_path(text: str) -> list[Segment]:
    segments: list[Segment] = []
    for name, index in _SEGMENT.findall(text):
        segments.append(name if name else (index if index == "..." else int(index)))
    return segments


def _dotted(path: Sequence[Segment]) -> str:
    out = ""
    for seg in path:
        out += f"[{seg}]" if isinstance(seg, int) or seg == "..." else (f".{seg}" if out else seg)
    return out


def _table_label(path: Sequence[Segment], lead: str = "") -> str:
    return f"{lead}[{_dotted(path)}]" if path else ""


def _expected(m: re.Match[str]) -> str:
    names = " | ".join(_TOML_NAMES.get(t, t) for t in m["exp"].split(" | "))
    return names + m["extra"].replace("`", "")


def _got(got: str | None, data: Any, path: Sequence[Segment]) -> str:
    """``", got str ('abc')"``; the value is shown when it is a scalar found at ``path``."""
    value = _value_at(data, path)
    shown = None if value is _MISSING_VALUE or isinstance(value, dict | list) else repr(value)
    if shown is not None and len(shown) > 60:
        shown = shown[:57] + "..."
    if got is None:
        return f", got {shown}" if shown is not None else ""
    got = _TOML_NAMES.get(got, got)
    return f", got {got} ({shown})" if shown is not None else f", got {got}"


_MISSING_VALUE = object()


def _value_at(data: Any, path: Sequence[Segment]) -> Any:
    for seg in path:
        try:
            data = data[seg]
        except (KeyError, IndexError, TypeError):
            return _MISSING_VALUE
    return data


def _unknown_key(path: Sequence[Segment], key: str, kind: type, data: Any) -> str:
    info = _type_at(kind, path, data)
    struct = _struct_type(info, _value_at(data, path))
    msg = f"unknown config key '{_dotted([*path, key])}'"
    if struct is None:
        return msg
    known = sorted([f.encode_name for f in struct.fields] + ([struct.tag_field] if struct.tag_field else []))
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    owners = [  # in a union of tagged Structs: the types that do have the key
        repr(o.tag)
        for o in _options(info, None)
        if isinstance(o, msgspec.inspect.StructType)
        and o is not struct
        and key in {f.encode_name for f in o.fields}
    ]
    if owners:
        hint = f"{struct.tag_field} {' or '.join(owners)} has it, this is {struct.tag!r}; "
    table = f"in {_table_label(path)}" if path else "at top level"
    return f"{msg} ({hint}known keys {table}: {', '.join(known)})"


def _tags(info: msgspec.inspect.Type | None, field: Segment) -> str:
    """``" (expected one of: 'a', 'b')"`` when ``info`` is a union of Structs tagged by ``field``."""
    options = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    tags = [o.tag for o in options if isinstance(o, msgspec.inspect.StructType) and o.tag_field == field]
    return f" (expected one of: {', '.join(repr(t) for t in tags)})" if tags else ""


def _choices(info: msgspec.inspect.Type | None) -> str:
    if isinstance(info, msgspec.inspect.EnumType):
        values = [member.value for member in info.cls]
    elif isinstance(info, msgspec.inspect.LiteralType):
        values = list(info.values)
    else:
        return ""
    return f" (expected one of: {', '.join(repr(v) for v in values)})"


def _type_at(kind: type, path: Sequence[Segment], data: Any = None) -> msgspec.inspect.Type | None:
    """The msgspec type description found by following ``path`` from the Struct ``kind``; in a
    union of tagged Structs, the member whose tag ``data`` holds at that point."""
    info: msgspec.inspect.Type | None = msgspec.inspect.type_info(kind)
    for depth, seg in enumerate(path):
        info = _child_type(info, seg, _value_at(data, path[:depth]))
    return info


def _child_type(info: msgspec.inspect.Type | None, seg: Segment, value: Any) -> msgspec.inspect.Type | None:
    i = msgspec.inspect
    options = _options(info, value)
    for option in options:
        if isinstance(seg, str) and seg != "..." and isinstance(option, i.StructType):
            return next((f.type for f in option.fields if f.encode_name == seg), None)
        if seg == "..." and isinstance(option, i.DictType):
            return option.value_type
        if isinstance(seg, int) and isinstance(option, i.ListType | i.VarTupleType | i.SetType):
            return option.item_type
        if isinstance(seg, int) and isinstance(option, i.TupleType) and seg < len(option.item_types):
            return option.item_types[seg]
    return None


def _struct_type(info: msgspec.inspect.Type | None, value: Any) -> msgspec.inspect.StructType | None:
    return next((o for o in _options(info, value) if isinstance(o, msgspec.inspect.StructType)), None)


def _options(info: msgspec.inspect.Type | None, value: Any) -> tuple[msgspec.inspect.Type | None, ...]:
    """The members of a union ``info`` (first the tagged Struct whose tag ``value`` names)."""
    if not isinstance(info, msgspec.inspect.UnionType):
        return (info,)
    tagged = [
        o
        for o in info.types
        if isinstance(o, msgspec.inspect.StructType)
        and o.tag_field is not None
        and isinstance(value, dict)
        and value.get(o.tag_field) == o.tag
    ]
    return (*tagged, *(o for o in info.types if o not in tagged))


# --------------------------------------------------------------------------------------------- writing

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_DATETIME_TYPES = (datetime.datetime, datetime.date, datetime.time)


def dump_toml(struct: msgspec.Struct) -> str:
    """Write a (resolved) config Struct as TOML text.

    Nested structs and dicts of dicts become ``[tables]``; lists of structs become ``[[arrays of
    tables]]``; other values (str, int, float, bool, dates, lists, dicts of scalars) are written inline.
    ``None`` values in tables are skipped, so optional fields must default to ``None`` to round-trip.
    """
    data = msgspec.to_builtins(struct, builtin_types=_DATETIME_TYPES)
    out: list[str] = []
    _emit_table(data, [], None, out)
    return "\n".join(out).lstrip("\n") + "\n"


def _emit_table(table: dict[str, Any], path: list[str], header: str | None, out: list[str]) -> None:
    inline = {k: v for k, v in table.items() if v is not None and not _is_table(v) and not _is_aot(v)}
    has_children = any(_is_table(v) or _is_aot(v) for v in table.values())
    if header is not None and (header.startswith("[[") or inline or not has_children):
        out.extend(["", header])
    out.extend(f"{_key(k)} = {_inline(v)}" for k, v in inline.items())
    for key, value in table.items():
        if _is_table(value):
            sub = [*path, key]
            _emit_table(value, sub, f"[{'.'.join(map(_key, sub))}]", out)
    for key, value in table.items():
        if _is_aot(value):
            sub = [*path, key]
            for item in value:
                _emit_table(item, sub, f"[[{'.'.join(map(_key, sub))}]]", out)


def _is_table(value: Any) -> bool:
    return isinstance(value, dict)


def _is_aot(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)  # fullmatch: "$" matches before a final "\n"


def _inline(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, _DATETIME_TYPES):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{_key(k)} = {_inline(v)}" for k, v in value.items() if v is not None)
        return "{ " + items + " }" if items else "{}"
    raise ConfigError(f"cannot write {type(value).__name__} value {value!r} as TOML")


def _string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
