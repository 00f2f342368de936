#!/usr/bin/env bash
# Create .venv and install cpshard with its test extra. torch is pinned and installed first so that
# pip never resolves an unpinned torch (which would download a multi-GB CUDA build).
#
# megatron-core (for the Megatron interop tests) goes in without its dependencies (--no-deps: pip
# must never resolve torch): 0.19.2 into .venv, and 0.16.0 into .venv-mcore016, a --target folder
# that scripts/test.sh puts first on PYTHONPATH for a second run of the MTP tests. Set
# CPSHARD_MEGATRON=0 to skip both (those tests then skip, naming the reason).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${CPSHARD_TORCH:-torch==2.13.0}
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
"${PIP[@]}" "$TORCH_SPEC"
"${PIP[@]}" -e '.[test]'
if [ "${CPSHARD_MEGATRON:-1}" != "0" ]; then
  "${PIP[@]}" numpy 'packaging>=24.2'
  "${PIP[@]}" --no-deps --ignore-requires-python megatron-core==0.19.2
  if [ ! -d .venv-mcore016/megatron_core-0.16.0.dist-info ]; then
    rm -rf .venv-mcore016
    "${PIP[@]}" --no-deps --ignore-requires-python --target .venv-mcore016 megatron-core==0.16.0
  fi
fi
