"""The calc task's agent as a black-box program: the official ``openai`` SDK with tool calling.

Run by :class:`loong_agentflow.BlackBoxRunner` (``python -m loong_train.tiny.calc_agent``): the
SDK reads ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` from the environment, the task arrives as JSON
on stdin (``{"messages": [...], ...}``), and the final answer goes to stdout.

The loop is the white-box :class:`~loong_agentflow.ToolAgent`'s, written as an ordinary agent:
ask the model with the ``calc`` tool offered; run every tool call it makes (an error's text is the
tool's result) and ask again; print the content of the first reply without tool calls. At most
``LOONG_MAX_TURNS`` model calls (default 3). A reply cut by the token limit, a session whose token
budget is used up, or running out of turns ends the episode with no answer (reward 0). One
difference from the white-box agent: a malformed ``<tool_call>`` block reaches this program as
plain content (the proxy only returns well-formed calls), so it is taken as the answer, where the
white-box agent shows the model the parse error and goes on.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an integer arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string"}},
                "required": ["expr"],
            },
        },
    }
]


def run_tool(name: str, arguments: str) -> str:
    """A tool call's result, or its error as text (the model sees it, the episode goes on)."""
    from loong_train.tiny.calc import calc

    if name != "calc":
        return f"error: unknown tool {name!r} (known: ['calc'])"
    try:
        return calc(**json.loads(arguments))
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


def answer(client: Any, messages: list[dict[str, Any]], max_turns: int) -> str:
    """The final answer, or "" when the episode ends without one."""
    from openai import BadRequestError

    for _ in range(max_turns):
        try:
            reply = client.chat.completions.create(model="loong-policy", messages=messages, tools=TOOLS)
        except BadRequestError as e:
            if e.code == "context_length_exceeded":  # the episode's token budget is used up
                return ""
            raise
        choice = reply.choices[0]
        if choice.finish_reason == "length":
            return ""
        calls = choice.message.tool_calls or []
        if not calls:
            return choice.message.content or ""
        messages.append(
            {
                "role": "assistant",
                "content": choice.message.content,
                "tool_calls": [
                    {"id": c.id, "type": "function", "function": c.function.model_dump()} for c in calls
                ],
            }
        )
        messages += [
            {"role": "tool", "tool_call_id": c.id, "content": run_tool(c.function.name, c.function.arguments)}
            for c in calls
        ]
    return ""


def main() -> int:
    try:
        from openai import OpenAI
    except ImportError:
        print("the calc agent needs the 'openai' package (uv pip install openai)", file=sys.stderr)
        return 2
    task = json.load(sys.stdin)
    client = OpenAI(max_retries=0)  # a retried call would be recorded twice
    print(answer(client, list(task["messages"]), int(os.environ.get("LOONG_MAX_TURNS", "3"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
