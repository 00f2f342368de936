#!/usr/bin/env bash
# Create .venv and install cpshard with its test extra. torch is pinned and installed first so that
# pip never resolves an unpinned torch (which would download a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${CPSHARD_TORCH:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
