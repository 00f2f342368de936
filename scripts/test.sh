#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite; then the MTP tests once more with megatron-core
# 0.16.0 first on the path (its GPTModel loop, no process_mtp_loss; see scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m pytest "$@"
if [ -d .venv-mcore016/megatron ] && [ "$#" -eq 0 ]; then
  echo "--- the MTP tests with megatron-core 0.16.0 ---"
  PYTHONPATH=.venv-mcore016${PYTHONPATH:+:$PYTHONPATH} .venv/bin/python -m pytest -q tests/test_mtp.py \
    tests/test_mtp_distributed.py
fi
