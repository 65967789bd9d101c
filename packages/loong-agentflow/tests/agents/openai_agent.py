"""A black-box agent written against the official ``openai`` SDK, configured only by its environment.

Reads its task (JSON) from stdin. ``mode``:
- ``tools``: multi-turn tool use (``add``) until the model answers without a call; prints the
  answer and writes the messages it saw (and the logprobs it was sent) to ``task["transcript"]``;
  ``task["stream"]`` chooses streaming.
- ``crash``: one call, then an exception; ``hang``: one call, then sleeps forever (writes its pid);
  ``silent``: exits 0 without calling the model; ``post_reward``: one call, then reports its reward
  to the proxy's session reward endpoint.
"""

import json
import os
import sys
import time

import httpx
from openai import OpenAI

TOOLS = [
    {
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
]


def streamed(client, messages):
    content, calls, logprobs = "", {}, []
    for chunk in client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, top_p=0.5, stream=True, logprobs=True
    ):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        if choice.logprobs and choice.logprobs.content:
            logprobs += [x.logprob for x in choice.logprobs.content]
        for tc in choice.delta.tool_calls or ():
            slot = calls.setdefault(
                tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            slot["id"] = tc.id or slot["id"]
            if tc.function and tc.function.name:
                slot["function"]["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["function"]["arguments"] += tc.function.arguments
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, message.get("tool_calls") or [], logprobs


def plain(client, messages):
    r = client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, top_p=0.5, logprobs=True
    )
    message = r.choices[0].message  # passed back as the SDK object, as most agents do
    calls = [tc.model_dump() for tc in message.tool_calls or ()]
    return message, calls, [x.logprob for x in r.choices[0].logprobs.content]


def main():
    task = json.load(sys.stdin)
    assert json.loads(os.environ["LOONG_TASK"]) == task
    client = OpenAI(max_retries=0, timeout=60)
    messages = list(task["messages"])
    mode = task.get("mode", "tools")
    if mode == "silent":
        return
    if mode != "tools":
        client.chat.completions.create(model="policy", messages=messages, top_p=0.5, max_tokens=2)
        if mode == "crash":
            raise RuntimeError("agent bug")
        if mode == "hang":
            with open(task["pidfile"], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)
        if mode == "post_reward":
            url = os.environ["OPENAI_BASE_URL"] + "/sessions/reward"
            auth = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}
            httpx.post(url, json={"reward": 0.75}, headers=auth).raise_for_status()
        return
    seen_logprobs = []
    for _ in range(6):
        message, calls, logprobs = (streamed if task["stream"] else plain)(client, messages)
        seen_logprobs.append(logprobs)
        messages.append(message)
        if not calls:
            break
        for call in calls:
            args = json.loads(call["function"]["arguments"])
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])}
            )
    dumped = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    with open(task["transcript"], "w") as f:
        json.dump({"messages": dumped, "logprobs": seen_logprobs}, f)
    print(messages[-1]["content"] if isinstance(messages[-1], dict) else messages[-1].content)


if __name__ == "__main__":
    main()
