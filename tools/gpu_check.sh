#!/usr/bin/env bash
# GPU check: on a machine with a CUDA GPU and this repository, install the workspace (with the GPU
# extras that resolve there) and run every test marked `gpu`, then print a summary table last.
# Usage: bash tools/gpu_check.sh            (about a minute plus installation)
set -uo pipefail
cd "$(dirname "$0")/.."

command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet uv
uv sync --locked --quiet
if nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null; then
  uv pip install --quiet 'cupy-cuda13x>=13' || echo "cupy not installed: NCCL tests will skip"
else
  echo "no GPU visible: every gpu test will skip"
fi

report=$(mktemp)
uv run pytest -m gpu -q --junitxml="$report" packages 2>&1 | tail -40
status=${PIPESTATUS[0]}

echo
echo "=== GPU check summary"
uv run python - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ET

rows = []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    outcome = "passed"
    for child in case:
        if child.tag in ("failure", "error"):
            outcome = "FAILED"
        elif child.tag == "skipped":
            outcome = "skipped: " + (child.get("message") or "")[:60]
    rows.append((case.get("classname", "").rsplit(".", 1)[-1], case.get("name"), outcome, float(case.get("time", 0))))
width = max((len(f"{c}::{n}") for c, n, _, _ in rows), default=10)
print(f"{'test':<{width}}  {'seconds':>7}  outcome")
for c, n, outcome, t in rows:
    print(f"{c + '::' + n:<{width}}  {t:7.1f}  {outcome}")
PY
exit "$status"
