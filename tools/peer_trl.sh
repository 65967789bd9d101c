#!/usr/bin/env bash
# Loong against TRL's GRPOTrainer on smollm2-arithmetic, one run after the other per seed: wall
# time until held-out success first reaches a target (tools/peer_trl.py says what is matched).
# TRL goes into a throwaway virtual environment; it is never a dependency of Loong.
#   tools/peer_trl.sh [OUT] [SEEDS]     (default: runs/peer-trl, seeds "0 1 2")
# TARGET (default 0.4): the held-out success both race to; Loong trains the recipe's 12 steps,
# TRL up to TRL_STEPS (default 24), stopping at the target. PEER_VENV: keep TRL's environment there.
# TRL_BF16=1: TRL in its bfloat16 mixed precision (Loong's engine picks bfloat16 by itself where
# the CPU has native bfloat16 products: the recipe's [rollout.engine] dtype = "auto").
# Run it on a quiet machine: both frameworks use every core.
set -euo pipefail
cd "$(dirname "$0")/.."
TRL=1.16.0
TORCH=2.15.0
out="${1:-runs/peer-trl}"
seeds="${2:-0 1 2}"
target="${TARGET:-0.4}"
venv="${PEER_VENV:-$(mktemp -d)/trl-peer}"
mkdir -p "$out"
if [ ! -x "$venv/bin/python" ]; then
  uv venv -q -p 3.11 "$venv"
  VIRTUAL_ENV="$venv" uv pip install -q "trl==$TRL" "torch==$TORCH"
fi
for seed in $seeds; do
  uv run python tools/peer_trl.py spec --seed "$seed" --out "$out/spec-s$seed.json"
  uv run python tools/peer_trl.py loong --seed "$seed" --out "$out/loong-s$seed"
  "$venv/bin/python" tools/peer_trl.py trl "$out/spec-s$seed.json" "$out/trl-s$seed" \
    --steps "${TRL_STEPS:-24}" --stop-at "$target" $([ "${TRL_BF16:-0}" = 1 ] && echo --bf16)
done
uv run python tools/peer_trl.py table "$out" --target "$target"
