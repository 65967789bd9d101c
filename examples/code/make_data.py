"""Write data.jsonl: small Python functions to write, each with hidden unit tests and a reference
solution (the warm start's demonstration). ``python make_data.py [rows] [seed]``."""

import json
import random
import sys

# (name, what it does, body with K, tests with K): K varies per row, so the rows are many
FUNCTIONS = [
    ("add_k", "returns x plus {k}", "return x + {k}", ["add_k(0) == {k}", "add_k(5) == 5 + {k}", "add_k(-3) == -3 + {k}"]),
    ("times_k", "returns x times {k}", "return x * {k}", ["times_k(1) == {k}", "times_k(7) == 7 * {k}", "times_k(0) == 0"]),
    ("minus_k", "returns x minus {k}", "return x - {k}", ["minus_k({k}) == 0", "minus_k(10) == 10 - {k}"]),
    ("is_multiple", "tells whether x is a multiple of {k}", "return x % {k} == 0",
     ["is_multiple({k} * 3)", "not is_multiple({k} * 3 + 1)", "is_multiple(0)"]),
    ("first_k", "returns the first {k} items of the list x", "return x[:{k}]",
     ["first_k(list(range(20))) == list(range({k}))", "first_k([]) == []"]),
    ("repeat_k", "returns the string x repeated {k} times", "return x * {k}",
     ["repeat_k('ab') == 'ab' * {k}", "repeat_k('') == ''"]),
]  # fmt: skip


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, what, body, tests = rng.choice(FUNCTIONS)
        k = rng.randint(2, 9)
        out.append(
            {
                "prompt": f"Write def {name}(x) that {what.format(k=k)}.",
                "answer": f"def {name}(x):\n    {body.format(k=k)}",
                "metadata": {"tests": [t.format(k=k) for t in tests]},
            }
        )
    return out


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    with open("data.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows(n, seed))
