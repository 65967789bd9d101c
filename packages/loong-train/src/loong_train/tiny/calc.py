"""The calculator-agent task: the model must call a ``calc`` tool and answer with its result.

A question is ``compute A<op>B`` with two-digit operands and ``op`` in ``+ - *``. A tiny
model cannot multiply, so the reliable way to earn the reward is a well-formed Hermes tool call
that copies the expression, then copying the tool's result as the final answer. Reward 1 when
the final answer equals the true value, else 0. Held-out questions are drawn from a separate
seed and never appear in training.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from loong_agentflow import ChatML, Tool, ToolRegistry, ToolResult
from loong_train.tasks.base import AgentCommand, Task

__all__ = [
    "EVAL_SEED",
    "CalcTask",
    "calc",
    "calc_agent_command",
    "demonstration",
    "eval_tasks",
    "random_task",
    "reward",
    "tool_registry",
    "train_tasks",
]

EVAL_SEED = 1_000_003

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expr: str) -> str:
    """Evaluate an integer expression of + - * and parentheses; anything else is an error."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression {expr!r}")

    if len(expr) > 64:
        raise ValueError("expression longer than 64 characters")
    return str(ev(ast.parse(expr, mode="eval").body))


def tool_registry() -> ToolRegistry:
    return ToolRegistry(
        [Tool("calc", calc, "Evaluate an integer arithmetic expression.", inline=True)], timeout_s=5.0
    )  # inline: bounded (64 characters, no powers) and pure


def random_task(rng: random.Random, ops: str = "+-*") -> dict[str, Any]:
    """``compute A<op>B`` with two-digit operands and ``op`` drawn from ``ops``."""
    a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice(ops)
    expr = f"{a}{op}{b}"
    return {"messages": [{"role": "user", "content": f"compute {expr}"}], "expr": expr, "answer": calc(expr)}


def eval_tasks(n: int, seed: int = EVAL_SEED) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_task(rng) for _ in range(n)]


def train_tasks(seed: int, held_out: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """An endless stream of training questions, skipping any held-out expression."""
    rng, banned = random.Random(seed), {t["expr"] for t in held_out}
    while True:
        task = random_task(rng)
        if task["expr"] not in banned:
            yield task


def reward(task: dict[str, Any], answer: str) -> float:
    return float(answer.strip() == task["answer"])


def demonstration(task: dict[str, Any]) -> list[tuple[str, bool]]:
    """An expert episode as (text, is_model) pieces, in exactly the agent's token layout."""
    call = json.dumps({"name": "calc", "arguments": {"expr": task["expr"]}})
    result = calc(task["expr"])
    tool_turn = ChatML.tool_turn([ToolResult(None, result, ok=True)])
    return [
        (ChatML.prompt(task["messages"]), False),
        (f"<tool_call>{call}</tool_call>{ChatML.END}", True),
        (tool_turn, False),
        (f"{result}{ChatML.END}", True),
    ]


def calc_agent_command() -> AgentCommand:
    """The shipped black-box calc agent (:mod:`loong_train.tiny.calc_agent`), an ``openai``-SDK
    program run by this interpreter; its episodes fork from a process that imported the SDK."""
    return AgentCommand(
        argv=[sys.executable, "-m", "loong_train.tiny.calc_agent"],
        preload=["openai", "loong_train.tiny.calc"],
        requires=["openai"],
        install="pip install 'loong-train[blackbox]'",
    )


class CalcTask(Task):
    """The ``calc`` task as a :class:`~loong_train.tasks.Task`, plus what the tiny warm start uses:
    ``probe`` sets (other seeds than the held-out one) and expert ``demonstration`` episodes."""

    def held_out(self, n: int) -> list[dict[str, Any]]:
        return eval_tasks(n, EVAL_SEED)

    def probe(self, n: int, seed: int, held_out: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        return eval_tasks(n, seed)

    def train_stream(self, seed: int, held_out: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        return train_tasks(seed, list(held_out))

    def tools(self) -> ToolRegistry:
        return tool_registry()

    def reward(self, item: dict[str, Any], answer: str) -> float:
        return reward(item, answer)

    def demonstration(self, item: dict[str, Any]) -> list[tuple[str, bool]]:
        return demonstration(item)

    def agent_command(self) -> AgentCommand:
        return calc_agent_command()
