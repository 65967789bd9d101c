"""A black-box agent run in the sandbox: it answers through the proxy (``openai`` SDK) and, on
the way, tries what the sandbox must stop. Prints one JSON line: the model's answer and what
each attempt gave.

Task keys: ``messages``; ``other`` (a loopback port it must not reach); ``escape`` (a path
outside its working directory it must not write); ``hog`` (true: allocate 4 GB first);
``flood`` (true: print 64 KiB before its answer).
"""

import json
import os
import socket
import sys

from openai import OpenAI

task = json.load(sys.stdin)
if task.get("hog"):
    hoard = bytearray(4 << 30)
seen = {"cwd": os.getcwd(), "parent_env": os.environ.get("LOONG_TEST_PARENT_SECRET")}
try:
    socket.create_connection(("127.0.0.1", task["other"]), timeout=3).close()
    seen["other"] = "reached"
except OSError as e:
    seen["other"] = type(e).__name__
try:
    with open(task["escape"], "w") as f:
        f.write("out")
    seen["escape"] = "written"
except OSError as e:
    seen["escape"] = type(e).__name__
with open("scratch.txt", "w") as f:  # its own directory is writable
    seen["scratch"] = f.write("in")
reply = OpenAI().chat.completions.create(model="policy", messages=task["messages"])
seen["answer"] = reply.choices[0].message.content
if task.get("flood"):
    print("x" * (64 << 10))
print(json.dumps(seen))
