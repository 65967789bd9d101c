"""Summarise a pytest-benchmark JSON file as ratios to the floors measured in the same run.

    uv run python tools/bench_table.py BENCH.json

Groups benchmarks by payload bytes; for each it prints the median time, its ratio to the memcpy
floor and, for ``tcp`` cases, to the flat gloo broadcast floor with the same receiver count.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(path: str) -> None:
    rows = json.loads(Path(path).read_text())["benchmarks"]
    by_size: dict[int, list[dict]] = defaultdict(list)
    for b in rows:
        by_size[b["extra_info"]["bytes"]].append(b)
    for size, group in sorted(by_size.items()):
        median = {
            (b["extra_info"]["case"], b["extra_info"]["receivers"]): b["stats"]["median"] for b in group
        }
        floor = median[("floor_memcpy", 1)]
        print(f"\n{size / 2**20:.0f} MiB, {group[0]['extra_info'].get('tensors', '?')} tensors")
        print("| case | receivers | median ms | x memcpy floor | x flat gloo floor |")
        print("|---|---|---|---|---|")
        for (case, receivers), t in sorted(median.items(), key=lambda kv: (kv[0][1], kv[1])):
            gloo = median.get(("floor_flat_gloo", receivers))
            vs_gloo = f"{t / gloo:.2f}" if gloo and case.startswith("tcp") else ""
            print(f"| {case} | {receivers} | {t * 1e3:.0f} | {t / floor:.2f} | {vs_gloo} |")


if __name__ == "__main__":
    main(sys.argv[1])
