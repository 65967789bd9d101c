#!/usr/bin/env bash
# GPU check: on a machine with a CUDA GPU and this repository, install the workspace (with the GPU
# extras that resolve there), run every test marked `gpu` (among them the SGLang contract cases of
# tests/test_sglang_contract.py against a real SGLang server), then short real training runs on a tiny
# model built here (Megatron on the GPU with the embedded engine, and with SGLang rollouts when an
# SGLang interpreter is available), and print a summary table last. About 5 minutes plus
# installation on one GPU.
#
# Usage: bash tools/gpu_check.sh
#        SGLANG_PYTHON=/opt/sglang/bin/python bash tools/gpu_check.sh   # SGLang from its own env
#        GPU_CHECK_PYTHON=python3 bash tools/gpu_check.sh   # offline: an interpreter with CUDA torch
# The offline form installs nothing: the workspace's sources go on PYTHONPATH and the interpreter
# must already have the rest (msgspec, httpx, starlette, uvicorn, transformers; megatron-core for
# the Megatron test, cupy for NCCL). The training runs need Ray and skip without it.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
  PY=("$GPU_CHECK_PYTHON")
  export PYTHONPATH="$(printf '%s:' "$PWD"/packages/*/src)${PYTHONPATH:-}"
  "${PY[@]}" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
else
  command -v uv >/dev/null 2>&1 || python3 -m pip install --quiet uv
  uv sync --locked --quiet
  PY=(uv run python)
fi
if nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null; then
  [ -n "${GPU_CHECK_PYTHON:-}" ] || uv pip install --quiet 'cupy-cuda13x>=13' || echo "cupy not installed: NCCL tests will skip"
else
  echo "no GPU visible: every gpu test will skip"
fi
# SGLang pins its own torch, so it usually lives in an environment of its own (docs/gpu.md).
if [ -z "${SGLANG_PYTHON:-}" ] && "${PY[@]}" -c "import sglang" 2>/dev/null; then
  SGLANG_PYTHON=$("${PY[@]}" -c "import sys; print(sys.executable)")
fi
export SGLANG_PYTHON=${SGLANG_PYTHON:-}
echo "SGLang interpreter: ${SGLANG_PYTHON:-none (SGLang tests and runs skip)}"

work=$(mktemp -d)
report="$work/junit.xml"
runs="$work/runs.tsv"  # one row per training run: name, seconds, outcome
: >"$runs"
# only the files with gpu tests: the others import what an offline interpreter may lack (Ray)
mapfile -t files < <(grep -rlE --include='test_*.py' 'mark.gpu|NEEDS_REAL_SGLANG' packages)
"${PY[@]}" -m pytest -m gpu -q -rsP --junitxml="$report" "${files[@]}" 2>&1
status=${PIPESTATUS[0]}

# A random-init tiny Qwen3 (no warm start) with 64-wide heads, which SGLang's kernels support.
"${PY[@]}" -m loong_train.cli build-tiny tiny-calc-agent --out "$work/tiny" \
  --set warmstart.steps=0 --set model.head_dim=64 >"$work/build.log" 2>&1 || echo "build-tiny failed: $work/build.log"
STEPS=3
COMMON=(--set "model.path=$work/tiny" --set train.backend.type=megatron --set "train.steps=$STEPS"
  --set train.batch_groups=2 --set rollout.group_size=4 --set rollout.max_new_tokens=32
  --set rollout.max_model_tokens=64 --set eval.every=100 --set eval.num_tasks=4)

# run_case NAME OVERRIDES...: a short `loong-train run`; passes when every step reached metrics.jsonl.
run_case() {
  local name=$1 start rc steps
  shift
  start=$(date +%s)
  timeout 300 "${PY[@]}" -m loong_train.cli run tiny-calc-agent --out "$work/$name" "${COMMON[@]}" "$@" >"$work/$name.log" 2>&1
  rc=$?
  steps=$(wc -l <"$work/$name/metrics.jsonl" 2>/dev/null || echo 0)
  if [ "$rc" -eq 0 ] && [ "$steps" -eq "$STEPS" ]; then
    outcome="passed: $steps steps, $("${PY[@]}" -c "import json,sys; m=[json.loads(l) for l in open(sys.argv[1])][-1]; print(f\"version {m['policy_version']}, weight sync {m['weight_sync_s']:.3f} s\")" "$work/$name/metrics.jsonl")"
  else
    outcome="FAILED (exit $rc, $steps/$STEPS steps; log $work/$name.log)"
    status=1
  fi
  printf 'run::%s\t%s\t%s\n' "$name" "$(($(date +%s) - start))" "$outcome" >>"$runs"
}

if ! "${PY[@]}" -c "import ray" 2>/dev/null; then
  printf 'run::%s\t0\t%s\n' training-runs "skipped: no Ray in this interpreter" >>"$runs"
elif nvidia-smi >/dev/null 2>&1; then
  run_case megatron-gpu+embedded --set train.backend.gpus=1
  if [ -n "$SGLANG_PYTHON" ]; then
    # colocated on one GPU: Ray gives the trainer and the SGLang worker half of it each
    run_case megatron-gpu+sglang-gpu --set train.backend.gpus=0.5 --set rollout.engine.type=sglang \
      --set rollout.engine.launcher=sglang --set "rollout.engine.python=$SGLANG_PYTHON" --set rollout.engine.gpus=0.5 \
      --set rollout.engine.mem_fraction_static=0.3 --set 'rollout.engine.args=["--disable-cuda-graph", "--dtype", "bfloat16"]'
    # the same with the trainer handing the server its CUDA tensors (IPC; no host copy in the worker)
    run_case megatron-gpu+sglang-gpu-direct --set train.backend.gpus=0.5 --set rollout.engine.type=sglang \
      --set rollout.engine.launcher=sglang --set "rollout.engine.python=$SGLANG_PYTHON" --set rollout.engine.gpus=0.5 \
      --set rollout.engine.weights=direct --set rollout.engine.update_backend=tensor \
      --set rollout.engine.mem_fraction_static=0.3 --set 'rollout.engine.args=["--disable-cuda-graph", "--dtype", "bfloat16"]'
  else
    printf 'run::%s\t0\t%s\n' megatron-gpu+sglang-gpu "skipped: no SGLang (set SGLANG_PYTHON)" >>"$runs"
  fi
else
  printf 'run::%s\t0\t%s\n' training-runs "skipped: no GPU" >>"$runs"
fi

echo
echo "=== GPU check summary (work directory: $work)"
"${PY[@]}" - "$report" "$runs" <<'PY'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

rows = []
if Path(sys.argv[1]).exists():
    for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "FAILED"
            elif child.tag == "skipped":
                outcome = "skipped: " + (child.get("message") or "")[:60]
        name = case.get("classname", "").rsplit(".", 1)[-1] + "::" + case.get("name")
        rows.append((name, float(case.get("time", 0)), outcome))
for line in Path(sys.argv[2]).read_text().splitlines():
    name, seconds, outcome = line.split("\t")
    rows.append((name, float(seconds), outcome))
width = max((len(name) for name, _, _ in rows), default=10)
print(f"{'check':<{width}}  {'seconds':>7}  outcome")
for name, seconds, outcome in rows:
    print(f"{name:<{width}}  {seconds:7.1f}  {outcome}")
PY
exit "$status"
