"""Tools for white-box agents: a typed registry, the Hermes tool-call parser, safe execution.

Tool calls use the Qwen/Hermes format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
a completion may hold several (parallel calls). A tool that raises or times out does not end
the episode: its error text becomes the observation.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Tool", "ToolCall", "ToolRegistry", "ToolResult", "parse_tool_calls"]

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


class ToolRegistry:
    """Named tools, each call bounded by ``timeout_s``."""

    def __init__(self, tools: list[Tool], timeout_s: float = 10.0) -> None:
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s

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
        return tool is None or (tool.inline and not asyncio.iscoroutinefunction(tool.fn))
