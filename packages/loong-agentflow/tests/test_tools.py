"""The Hermes tool-call parser and the ToolRegistry: parse cases written by hand, real sync and async
tools, failures that become observations, time-outs, and proof (by event order) that calls overlap."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import threading
import time
from typing import Literal

import pytest

from loong_agentflow import (
    Latency,
    Tool,
    ToolCall,
    ToolRegistry,
    ToolResult,
    function_tool,
    parse_tool_calls,
)

_NEEDS_NAME = 'error: tool call needs {"name": str, "arguments": object}'
_NEEDS_OBJECT = "error: tool call arguments must be a JSON object"


# ---- parse_tool_calls ----------------------------------------------------------------------------


def test_parse_no_calls() -> None:
    assert parse_tool_calls("The answer is 42.<|im_end|>") == []
    assert parse_tool_calls("") == []
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}') == []  # never closed


def test_parse_single_call() -> None:
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call><|im_end|>'
    )
    assert parse_tool_calls(text) == [ToolCall("calc", {"expr": "2+3"})]


def test_parse_parallel_calls_in_order() -> None:
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>{"name": "mul", "arguments": {"a": 3, "b": 4}}</tool_call>'
    )
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("mul", {"a": 3, "b": 4})]


def test_parse_arguments_given_as_a_json_string() -> None:
    text = '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"7*6\\"}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calc", {"expr": "7*6"})]


def test_parse_missing_arguments_means_none() -> None:
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


def test_parse_malformed_json_names_the_decoder_error() -> None:
    body = '{"name": "calc", "arguments": {"expr": "1+1"}'  # missing closing brace
    with pytest.raises(json.JSONDecodeError) as reference:
        json.loads(body)
    [result] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert result == ToolResult(None, f"error: tool call is not valid JSON ({reference.value.msg})", ok=False)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"arguments": {"x": 1}}', _NEEDS_NAME),
        ('{"name": 7, "arguments": {}}', _NEEDS_NAME),
        ('["calc", {"expr": "1"}]', _NEEDS_NAME),
        ('"calc"', _NEEDS_NAME),
        ('{"name": "calc", "arguments": [1, 2]}', _NEEDS_OBJECT),
        ('{"name": "calc", "arguments": 3}', _NEEDS_OBJECT),
        ('{"name": "calc", "arguments": null}', _NEEDS_OBJECT),
        ('{"name": "calc", "arguments": "not json"}', _NEEDS_OBJECT),
        ('{"name": "calc", "arguments": "[1]"}', _NEEDS_OBJECT),
    ],
    ids=[
        "no-name",
        "int-name",
        "list-body",
        "string-body",
        "list-args",
        "int-args",
        "null-args",
        "bad-string-args",
        "string-list-args",
    ],
)
def test_parse_invalid_calls_become_failed_results(body: str, message: str) -> None:
    assert parse_tool_calls(f"<tool_call>{body}</tool_call>") == [ToolResult(None, message, ok=False)]


def test_parse_keeps_failures_in_place_among_good_calls() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        "<tool_call>{oops}</tool_call>"
        '<tool_call>{"name": "b", "arguments": {"k": "v"}}</tool_call>'
    )
    first, bad, last = parse_tool_calls(text)
    assert first == ToolCall("a", {})
    assert isinstance(bad, ToolResult) and not bad.ok and "not valid JSON" in bad.content
    assert last == ToolCall("b", {"k": "v"})


# ---- ToolRegistry --------------------------------------------------------------------------------


def _add(a: int, b: int) -> str:
    return str(a + b)


async def _mul(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a * b


def _divide(a: int, b: int) -> str:
    return str(a // b)


async def _async_fail() -> str:
    await asyncio.sleep(0)
    raise RuntimeError("disk on fire")


async def _sleep_long() -> str:
    await asyncio.sleep(30)
    return "never"


_REGISTRY_TOOLS = [
    Tool("add", _add),
    Tool("mul", _mul),
    Tool("divide", _divide),
    Tool("fail", _async_fail),
    Tool("sleepy", _sleep_long),
]


def _call(registry: ToolRegistry, name: str, **arguments: object) -> ToolResult:
    return asyncio.run(registry.call(ToolCall(name, dict(arguments))))


def test_sync_and_async_tools() -> None:
    registry = ToolRegistry(_REGISTRY_TOOLS)
    assert _call(registry, "add", a=2, b=3) == ToolResult(ToolCall("add", {"a": 2, "b": 3}), "5", ok=True)
    # a non-str return value is rendered with str()
    assert _call(registry, "mul", a=6, b=7) == ToolResult(ToolCall("mul", {"a": 6, "b": 7}), "42", ok=True)


def test_unknown_tool_lists_known_ones() -> None:
    result = _call(ToolRegistry(_REGISTRY_TOOLS), "sqrt", x=4)
    assert not result.ok
    assert result.call == ToolCall("sqrt", {"x": 4})
    assert result.content == "error: unknown tool 'sqrt' (known: ['add', 'divide', 'fail', 'mul', 'sleepy'])"


def test_raising_tools_become_failed_results() -> None:
    registry = ToolRegistry(_REGISTRY_TOOLS)
    assert _call(registry, "divide", a=1, b=0) == ToolResult(
        ToolCall("divide", {"a": 1, "b": 0}),
        "error: ZeroDivisionError: integer division or modulo by zero",
        ok=False,
    )
    assert _call(registry, "fail") == ToolResult(
        ToolCall("fail", {}), "error: RuntimeError: disk on fire", ok=False
    )
    wrong_args = _call(registry, "add", a=1, c=2)
    assert (
        not wrong_args.ok
        and wrong_args.content.startswith("error: TypeError: ")
        and "'c'" in wrong_args.content
    )


def test_async_tool_past_timeout_fails() -> None:
    registry = ToolRegistry(_REGISTRY_TOOLS, timeout_s=0.05)
    assert _call(registry, "sleepy") == ToolResult(
        ToolCall("sleepy", {}), "error: tool 'sleepy' timed out after 0.05s", ok=False
    )


def test_sync_tool_past_timeout_fails() -> None:
    def slow() -> str:
        time.sleep(0.3)
        return "late"

    result = _call(ToolRegistry([Tool("slow", slow)], timeout_s=0.05), "slow")
    assert not result.ok and "timed out" in result.content


def test_run_passes_parse_failures_through_in_order() -> None:
    parsed = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": 5}</tool_call>'
        '<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 5}}</tool_call>'
    )
    results = asyncio.run(ToolRegistry(_REGISTRY_TOOLS).run(parsed))
    assert [(r.content, r.ok) for r in results] == [("2", True), (_NEEDS_OBJECT, False), ("10", True)]
    assert results[1] is parsed[1]


def test_run_executes_calls_concurrently() -> None:
    """Each tool waits until the other has started: sequential execution could never satisfy both."""
    log: list[str] = []

    async def body() -> list[ToolResult]:
        started = {"left": asyncio.Event(), "right": asyncio.Event()}

        def make(me: str, other: str):
            async def tool() -> str:
                log.append(f"start {me}")
                started[me].set()
                await started[other].wait()
                await asyncio.sleep(0.01)
                log.append(f"end {me}")
                return me

            return tool

        registry = ToolRegistry(
            [Tool("left", make("left", "right")), Tool("right", make("right", "left"))], timeout_s=2.0
        )
        return await registry.run([ToolCall("left", {}), ToolCall("right", {})])

    results = asyncio.run(body())
    assert [(r.content, r.ok) for r in results] == [("left", True), ("right", True)]
    assert sorted(log[:2]) == ["start left", "start right"]
    assert sorted(log[2:]) == ["end left", "end right"]


def test_inline_tools_run_on_the_event_loop_without_yielding() -> None:
    """A sync tool runs in a worker thread unless it is ``inline``; calls to inline tools (and
    parse failures) complete without the episode ever giving the event loop to another task."""
    loop_thread, seen = threading.get_ident(), {}

    def where(tag: str) -> str:
        seen[tag] = threading.get_ident()
        return tag

    registry = ToolRegistry([Tool("inline", where, inline=True), Tool("threaded", where)])
    parsed = parse_tool_calls(
        '<tool_call>{"name": "inline", "arguments": {"tag": "a"}}</tool_call>'
        '<tool_call>{"name": "inline", "arguments": 5}</tool_call>'
        '<tool_call>{"name": "inline", "arguments": {"tag": "b"}}</tool_call>'
    )

    async def main() -> tuple[list[str], bool]:
        other_ran = False

        async def other() -> None:
            nonlocal other_ran
            other_ran = True

        task = asyncio.create_task(other())  # would run at the episode's first suspension
        results = await registry.run(parsed)
        ran_before = other_ran
        await task
        await registry.call(ToolCall("threaded", {"tag": "t"}))
        return [r.content for r in results], ran_before

    contents, other_ran_first = asyncio.run(main())
    assert contents == ["a", _NEEDS_OBJECT, "b"] and not other_ran_first
    assert seen["a"] == seen["b"] == loop_thread != seen["t"]


# ---- function_tool: schemas from typed functions, checked against transformers' reader ----


def _stock(item: str, warehouse: int = 1, exact: bool = False) -> int:
    """How many of an item are in stock.

    Args:
        item: the item's name,
            as printed on the label
        warehouse: which warehouse to look in
        exact: count opened packs too
    """
    return 3


def _route(stops: list[str], mode: Literal["car", "bike"], budget: float | None = None) -> str:
    """Plan a route through the stops.

    Args:
        stops: the places to visit, in order
        mode: how to travel
        budget: the most to spend
    """
    return "ok"


def _weights(table: dict[str, float]) -> str:
    """Normalise a weight table.

    Args:
        table: name to weight
    """
    return "ok"


@pytest.mark.parametrize("fn", [_stock, _route, _weights])
def test_function_tool_schema_matches_transformers(fn):
    get_json_schema = pytest.importorskip("transformers.utils").get_json_schema
    reference = get_json_schema(fn)["function"]
    tool = function_tool(fn)
    assert tool.name == reference["name"] == fn.__name__
    assert tool.description == reference["description"]
    assert tool.parameters == reference["parameters"]


def test_function_tool_runs_a_bound_method_and_refuses_untyped_parameters():
    class Shop:
        def __init__(self):
            self.sold = 0

        def sell(self, n: int) -> str:
            """Sell some."""
            self.sold += n
            return f"sold {self.sold}"

    shop = Shop()
    registry = ToolRegistry([function_tool(shop.sell)])
    out = asyncio.run(
        registry.run(parse_tool_calls('<tool_call>{"name": "sell", "arguments": {"n": 2}}</tool_call>'))
    )
    assert out[0].content == "sold 2" and shop.sold == 2
    assert function_tool(shop.sell).parameters == {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
    }

    def untyped(x):
        return x

    with pytest.raises(TypeError, match="parameter 'x' has no type annotation"):
        function_tool(untyped)

    def odd(x: set[int]) -> str:
        return ""

    with pytest.raises(TypeError, match=r"tool 'odd', parameter 'x': cannot describe type"):
        function_tool(odd)


# ---- simulated latency ---------------------------------------------------------------------------


def test_latency_draws_are_lognormal_with_the_given_median_and_sigma() -> None:
    rng, latency = random.Random(7), Latency(0.2, 0.5)
    logs = sorted(math.log(latency.draw(rng)) for _ in range(20001))
    assert math.exp(logs[10000]) == pytest.approx(0.2, rel=0.02)  # the sample median
    assert statistics.stdev(logs) == pytest.approx(0.5, rel=0.03)
    assert Latency(0.2, 0.0).draw(rng) == pytest.approx(0.2)


@pytest.mark.parametrize(("median", "sigma"), [(0.0, 0.5), (-1.0, 0.5), (0.1, -0.1)])
def test_latency_refuses_impossible_settings(median: float, sigma: float) -> None:
    with pytest.raises(ValueError, match="median_s > 0 and sigma >= 0"):
        Latency(median, sigma)


def test_every_call_waits_one_seeded_draw_while_other_episodes_go_on(monkeypatch) -> None:
    """The wait is ``asyncio.sleep`` of a lognormal draw, seeded, one per successful call (an
    unknown tool answers at once); an inline tool then yields the event loop to other episodes."""
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded(delay: float, *args):
        waits.append(delay)
        await real_sleep(0)

    registry = ToolRegistry([Tool("double", lambda x: 2 * x, inline=True)]).with_latency(
        Latency(0.3, 0.4), seed=5
    )
    calls = [ToolCall("double", {"x": 1}), ToolCall("nope", {}), ToolCall("double", {"x": 4})]

    async def main() -> tuple[list[ToolResult], bool]:
        other_ran = False

        async def other() -> None:
            nonlocal other_ran
            other_ran = True

        task = asyncio.create_task(other())
        monkeypatch.setattr(asyncio, "sleep", recorded)
        results = [await registry.call(c) for c in calls[:1]]
        ran_during_the_first_call = other_ran
        results += await registry.run(calls[1:])
        await task
        return results, ran_during_the_first_call

    results, yielded = asyncio.run(main())
    reference = random.Random(5)
    assert waits == [reference.lognormvariate(math.log(0.3), 0.4) for _ in range(2)]
    assert [(r.content, r.ok) for r in results][::2] == [("2", True), ("8", True)]
    assert not results[1].ok and yielded
    assert ToolRegistry([Tool("double", lambda x: 2 * x)]).latency is None  # off unless asked
