"""Write data.jsonl: shelves of random counts, the item asked about, and an expert's turns (a tool
call, then the count) for the warm start. ``python make_data.py [rows] [seed]``."""

import json
import random
import sys

ITEMS = ["fig", "yam", "kiwi", "lime", "pear", "plum", "leek", "okra"]


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        shelf = {name: rng.randint(0, 99) for name in rng.sample(ITEMS, 4)}
        item = rng.choice(list(shelf))
        call = json.dumps({"name": "stock", "arguments": {"item": item}})
        out.append(
            {
                "item": item,
                "shelf": shelf,
                "demonstration": [f"<tool_call>{call}</tool_call>", str(shelf[item])],
            }
        )
    return out


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    with open("data.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows(n, seed))
