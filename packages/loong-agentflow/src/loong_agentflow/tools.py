"""Tools for white-box agents: a typed registry, the Hermes tool-call parser, safe execution.

Tool calls use the Qwen/Hermes format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
a completion may hold several (parallel calls). A tool that raises or times out does not end
the episode: its error text becomes the observation.

A registry may add a simulated :class:`Latency` to every call that returns a result
(``ToolRegistry.with_latency``; an unknown, failing or timed-out call answers at once): the
call's result comes back after a lognormal wait spent in ``asyncio.sleep``, so the episode waits
as it would on a sandbox or a web API while the event loop, and the engine's batch, go on with
other episodes. This is how a benchmark models agents that idle (it costs no CPU).

:func:`function_tool` makes a :class:`Tool` of a typed Python function (a bound method too, so a
per-episode environment's tools share its state), its JSON schema read from the signature and a
Google-style docstring, as the OpenAI SDK, ``transformers.get_json_schema`` and TRL read them::

    def stock(item: str, warehouse: int = 1) -> int:
        '''How many of an item are in stock.

        Args:
            item: the item's name
            warehouse: which warehouse to look in
        '''
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import random
import re
import types
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Latency", "Tool", "ToolCall", "ToolRegistry", "ToolResult", "function_tool", "parse_tool_calls"]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    call: ToolCall | None
    content: str
    ok: bool


def parse_tool_calls(text: str) -> list[ToolCall | ToolResult]:
    """Every ``<tool_call>`` block in order: a ToolCall, or a failed ToolResult naming the problem."""
    out: list[ToolCall | ToolResult] = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            out.append(ToolResult(None, f"error: tool call is not valid JSON ({e.msg})", ok=False))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.append(
                ToolResult(None, 'error: tool call needs {"name": str, "arguments": object}', ok=False)
            )
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            out.append(ToolResult(None, "error: tool call arguments must be a JSON object", ok=False))
            continue
        out.append(ToolCall(obj["name"], args))
    return out


@dataclass
class Tool:
    """An async (or sync) function exposed to the model under ``name``.

    A sync function runs in a worker thread under the registry's timeout, so a slow one cannot
    stall other episodes. ``inline = True`` runs it on the event loop instead, with no thread hop
    and no timeout: for fast, bounded, pure functions (a calculator), whose episodes then go on in
    the same loop iteration, so when a batching engine admits their next requests does not depend
    on thread scheduling (runs with a fixed seed reproduce bit for bit).
    """

    name: str
    fn: Callable[..., Awaitable[str] | str]
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    inline: bool = False


@dataclass(frozen=True)
class Latency:
    """A tool call's simulated wait: lognormal, ``median_s * exp(sigma * z)`` with z standard normal
    (so half the calls wait less than ``median_s``; sigma 0.5 puts 5% above 2.3x the median)."""

    median_s: float
    sigma: float = 0.5

    def __post_init__(self) -> None:
        if not (self.median_s > 0 and self.sigma >= 0):
            raise ValueError(
                f"Latency needs median_s > 0 and sigma >= 0, got {self.median_s} and {self.sigma}"
            )

    def draw(self, rng: random.Random) -> float:
        return rng.lognormvariate(math.log(self.median_s), self.sigma)


class ToolRegistry:
    """Named tools, each call bounded by ``timeout_s``."""

    def __init__(self, tools: list[Tool], timeout_s: float = 10.0) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.latency: Latency | None = None
        self._rng = random.Random(0)

    def with_latency(self, latency: Latency | None, seed: int = 0) -> ToolRegistry:
        """This registry with every call that returns a result followed by a wait drawn from
        ``latency`` (seeded); None: no wait."""
        out = ToolRegistry(list(self.tools.values()), self.timeout_s)
        out.latency, out._rng = latency, random.Random(seed)
        return out

    def schemas(self) -> list[dict[str, Any]] | None:
        """The tools as OpenAI function schemas (what chat templates list), None when there are none."""
        if not self.tools:
            return None
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in self.tools.values()
        ]

    async def call(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(
                call, f"error: unknown tool {call.name!r} (known: {sorted(self.tools)})", ok=False
            )
        try:
            if asyncio.iscoroutinefunction(tool.fn):
                out = await asyncio.wait_for(tool.fn(**call.arguments), self.timeout_s)
            elif tool.inline:
                out = tool.fn(**call.arguments)
            else:  # off the event loop, so a slow sync tool cannot stall other episodes
                out = await asyncio.wait_for(asyncio.to_thread(tool.fn, **call.arguments), self.timeout_s)
            if self.latency is not None:
                await asyncio.sleep(self.latency.draw(self._rng))
            return ToolResult(call, str(out), ok=True)
        except TimeoutError:
            return ToolResult(call, f"error: tool {call.name!r} timed out after {self.timeout_s}s", ok=False)
        except Exception as e:  # a tool's failure is the model's observation, not the episode's end
            return ToolResult(call, f"error: {type(e).__name__}: {e}", ok=False)

    async def run(self, parsed: list[ToolCall | ToolResult]) -> list[ToolResult]:
        """Run all parsed calls concurrently; parse failures pass through as results. When every
        call is to an inline tool they run one after another without leaving the event loop."""

        async def one(item: ToolCall | ToolResult) -> ToolResult:
            return await self.call(item) if isinstance(item, ToolCall) else item

        if all(isinstance(p, ToolResult) or self._inline(p) for p in parsed):
            return [await one(p) for p in parsed]
        return list(await asyncio.gather(*(one(p) for p in parsed)))

    def _inline(self, call: ToolCall) -> bool:
        tool = self.tools.get(call.name)
        if tool is not None and self.latency is not None:
            return False
        return tool is None or (tool.inline and not asyncio.iscoroutinefunction(tool.fn))


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one annotation: str, int, float, bool, list[X], dict[str, X], Literal,
    X | None; anything else is an error naming ``where``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        kinds = {_JSON_TYPES[type(a)] for a in args}
        return {"type": kinds.pop() if len(kinds) == 1 else sorted(kinds), "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        inner = (
            _schema(options[0], where)
            if len(options) == 1
            else {"anyOf": [_schema(a, where) for a in options]}
        )
        return {**inner, "nullable": True} if len(options) < len(args) else inner  # X | None
    if origin is list:
        return {"type": "array", **({"items": _schema(args[0], where)} if args else {})}
    if origin is dict:
        return {"type": "object", **({"additionalProperties": _schema(args[1], where)} if args else {})}
    raise TypeError(
        f"{where}: cannot describe type {hint!r} in JSON schema "
        "(use str, int, float, bool, list, dict, Literal or X | None)"
    )


def _docstring(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The description (the text before ``Args:``) and each argument's line under ``Args:``."""
    doc = inspect.getdoc(fn) or ""
    head, _, rest = doc.partition("\nArgs:")
    args: dict[str, str] = {}
    name = ""
    for line in rest.splitlines():
        if not line.strip():
            continue
        if re.match(r"^\S", line):  # Returns:, Raises: ...: the Args section is over
            break
        if (m := _ARG_LINE.match(line)) and line.startswith("    ") and not line.startswith("        "):
            name, args[m.group(1)] = m.group(1), m.group(2).strip()
        elif name:
            args[name] = f"{args[name]} {line.strip()}".strip()
    return head.strip(), args


def function_tool(fn: Callable[..., Any], *, name: str = "", inline: bool = False) -> Tool:
    """A :class:`Tool` calling ``fn`` (sync or async), named ``name`` or its ``__name__``, its
    parameters' JSON schema from the annotations (every parameter needs one) and its docstring."""
    label = name or fn.__name__
    description, docs = _docstring(fn)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name not in hints:
            raise TypeError(f"tool {label!r}: parameter {p.name!r} has no type annotation")
        properties[p.name] = _schema(hints[p.name], f"tool {label!r}, parameter {p.name!r}")
        if p.name in docs:
            properties[p.name]["description"] = docs[p.name]
        if p.default is p.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties, **({"required": required} if required else {})}
    return Tool(label, fn, description, parameters, inline)
