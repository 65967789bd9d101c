"""A test agent on the official ``openai`` SDK that keeps talking whatever the policy says.

A random-init policy never makes a well-formed tool call, so this agent drives the multi-turn
path itself: ``task["turns"]`` calls, the replies followed in turn by a tool result and a user
message, offering the calc tool and asking for logprobs and temperature 0.3 (which the proxy
overrides). ``task["stream"]`` picks streaming. It writes what it saw to
``task["transcript"]``: its messages (with the last reply), each reply's finish reason and the
logprobs it was sent.
"""

import json
import sys

from openai import OpenAI

from loong_train.tiny.calc_agent import TOOLS


def plain(client, messages):
    r = client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, temperature=0.3, logprobs=True
    )
    choice = r.choices[0]
    message = {"role": "assistant", "content": choice.message.content}
    if choice.message.tool_calls:
        message["tool_calls"] = [c.model_dump() for c in choice.message.tool_calls]
    return message, choice.finish_reason, [x.logprob for x in choice.logprobs.content]


def streamed(client, messages):
    content, finish, logprobs = "", None, []
    for chunk in client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, temperature=0.3, logprobs=True, stream=True
    ):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        if choice.logprobs and choice.logprobs.content:
            logprobs += [x.logprob for x in choice.logprobs.content]
        assert not choice.delta.tool_calls, "a random policy made a well-formed tool call"
    return {"role": "assistant", "content": content}, finish, logprobs


def main():
    task = json.load(sys.stdin)
    client = OpenAI(max_retries=0)
    messages, finishes, seen = list(task["messages"]), [], []
    for turn in range(task["turns"]):
        if turn:
            follow = (
                {"role": "tool", "tool_call_id": f"call_{turn}", "content": str(turn * 11)}
                if turn % 2
                else {"role": "user", "content": "and once more?"}
            )
            messages.append(follow)
        message, finish, logprobs = (streamed if task["stream"] else plain)(client, messages)
        messages.append(message)
        finishes.append(finish)
        seen.append(logprobs)
    with open(task["transcript"], "w") as f:
        json.dump({"messages": messages, "finish": finishes, "logprobs": seen}, f)
    print(messages[-1]["content"] or "")


if __name__ == "__main__":
    main()
