"""Load generator for bench_proxy.py: many agent sessions, each a keep-alive HTTP/1.1 connection.

Reads ``{"port", "keys", "calls", "think_s"}`` from stdin. Every session makes ``calls`` chained chat
calls (each appends the assistant reply and a new user turn, so the proxy only tokenizes the
suffix) and sleeps ``think_s`` x U(0.5, 1.5) before each call (0 = back to back). Prints
``{"latencies_ms": [...], "calls": {key: n}}``. A minimal client written on asyncio streams, so
the client's own cost stays far below the proxy's (an SDK client would dominate the numbers).
"""

import asyncio
import json
import random
import sys
import time


async def session(port, key, calls, think_s, out, done):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    messages = [{"role": "user", "content": "start"}]
    rng = random.Random(key)
    for _ in range(calls):
        if think_s:
            await asyncio.sleep(think_s * rng.uniform(0.5, 1.5))
        body = json.dumps({"messages": messages, "max_tokens": 8}).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        t0 = time.perf_counter()
        writer.write(head + body)
        headers = await reader.readuntil(b"\r\n\r\n")
        length = int(headers.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        payload = await reader.readexactly(length)
        out.append((time.perf_counter() - t0) * 1e3)
        assert headers.startswith(b"HTTP/1.1 200"), payload
        reply = json.loads(payload)["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]
        done[key] = done.get(key, 0) + 1
    writer.close()


async def main():
    cfg = json.load(sys.stdin)
    out, done = [], {}
    await asyncio.gather(
        *(session(cfg["port"], k, cfg["calls"], cfg["think_s"], out, done) for k in cfg["keys"])
    )
    json.dump({"latencies_ms": out, "calls": done}, sys.stdout)


if __name__ == "__main__":
    asyncio.run(main())
