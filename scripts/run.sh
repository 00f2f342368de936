#!/usr/bin/env bash
# Set up (idempotent) and run cpshard's main job on its built-in default: cpshard verify (a tiny
# transformer at cp=2 and 4, tp 1 and 2, both layouts, compared with cp=1 on spawned gloo ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/cpshard verify "$@"
