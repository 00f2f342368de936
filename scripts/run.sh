#!/usr/bin/env bash
# Set up (idempotent) and run cpshard's main job on its built-in default.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/cpshard plan --lengths 5,3 --cp 2 "$@"
