#!/usr/bin/env bash
# Regenerate packages/loong-train/tests/fixtures/reference_{algorithms,trl}.json: verl's and TRL's
# algorithms on fixed inputs, each computed in a throwaway virtual environment (neither library is
# ever a dependency of Loong).
#   tools/reference_algorithms.sh [DIR]     (the environments go in DIR; default: a temporary one, removed after)
set -euo pipefail
cd "$(dirname "$0")/.."
VERL=0.9.1
TRL=1.16.0
TORCH=2.15.0
dir="${1:-$(mktemp -d)}"
fixtures=packages/loong-train/tests/fixtures
for spec in "verl verl==$VERL reference_algorithms.json" "trl trl==$TRL reference_trl.json"; do
  read -r library requirement fixture <<<"$spec"
  venv="$dir/$library-reference"
  uv venv -q -p 3.11 "$venv"
  VIRTUAL_ENV="$venv" uv pip install -q "$requirement" "torch==$TORCH"
  "$venv/bin/python" tools/reference_algorithms.py "$library" "$fixtures/$fixture"
done
[ -n "${1:-}" ] || rm -rf "$dir"
