#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite; then the MTP tests once more with megatron-core
# 0.16.0 first on the path (its GPTModel loop, no process_mtp_loss; see scripts/setup.sh); then the
# README's install cases in a fresh torch-only environment (scripts/check_install.sh, about a minute;
# CPSHARD_INSTALL_CHECK=0 skips it). With arguments, only pytest runs, with them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m pytest "$@"
if [ -d .venv-mcore016/megatron ] && [ "$#" -eq 0 ]; then
  echo "--- the MTP tests with megatron-core 0.16.0 ---"
  PYTHONPATH=.venv-mcore016${PYTHONPATH:+:$PYTHONPATH} .venv/bin/python -m pytest -q tests/test_mtp.py \
    tests/test_mtp_distributed.py
fi
if [ "${CPSHARD_INSTALL_CHECK:-1}" != 0 ] && [ "$#" -eq 0 ]; then
  echo "--- the install cases (a fresh environment with torch only) ---"
  scripts/check_install.sh
fi
