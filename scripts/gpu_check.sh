#!/usr/bin/env bash
# The prepared check for a lent GPU (at most about 5 minutes on one GPU): writes one JSON file of
# figures, by default gpu_check.json in the current folder. Without CUDA it writes a "skipped"
# record and exits 0. See scripts/gpu_check.py for what it measures.
#
#   bash scripts/gpu_check.sh [OUT.json]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
out="${1:-gpu_check.json}"
timeout 300 "$python" "$here/gpu_check.py" --out "$out"
