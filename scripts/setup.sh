#!/usr/bin/env bash
# Create .venv and install cpshard with its test extra, every version from constraints.txt (read by group:
# see its header). torch is installed first and alone so that pip never resolves an unpinned torch (which
# would download a multi-GB CUDA build); everything after it that could pull torch goes in with --no-deps.
#
# Switches (environment variables):
#   CPSHARD_TORCH="torch==2.6.0"  another torch (then torch's own dependencies float)
#   CPSHARD_MEGATRON=0            skip megatron-core (0.19.2 into .venv, 0.16.0 into .venv-mcore016, a --target
#                                 folder scripts/test.sh puts first on PYTHONPATH for a second run of the MTP
#                                 tests); the Megatron tests then skip, naming the reason
#   CPSHARD_NO_VERL=1             skip verl 0.9.1 and its pinned dependencies; tests/test_verl_compat.py skips
#   PYTHON=python3.11             the interpreter that creates .venv
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CONSTRAINTS=constraints.txt
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)

pins() {  # the pins of group $1 in constraints.txt, one per line
  awk -v group="[$1]" '$1 == "#" && $2 == group { on = 1; next } /^# \[/ { on = 0 } on && NF && $1 !~ /^#/ { print $1 }' \
    "$CONSTRAINTS"
}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ -n "${CPSHARD_TORCH:-}" ]; then
  "${PIP[@]}" "$CPSHARD_TORCH"
else
  pins torch > .venv/constraints-torch.txt
  "${PIP[@]}" -c .venv/constraints-torch.txt "$(pins torch | grep '^torch==')"
fi
pins core > .venv/constraints-core.txt
"${PIP[@]}" -c .venv/constraints-core.txt -e '.[test]'
if [ "${CPSHARD_MEGATRON:-1}" != "0" ]; then
  # shellcheck disable=SC2046  # one word per pin
  "${PIP[@]}" --no-deps --ignore-requires-python $(pins megatron)
  second=$(awk '$1 == "#" && $2 == "second:" { print $3 }' "$CONSTRAINTS")
  if [ ! -d ".venv-mcore016/megatron_core-${second#*==}.dist-info" ]; then
    rm -rf .venv-mcore016
    "${PIP[@]}" --no-deps --ignore-requires-python --target .venv-mcore016 "$second"
  fi
fi
if [ "${CPSHARD_NO_VERL:-0}" != 1 ]; then
  # shellcheck disable=SC2046
  "${PIP[@]}" --no-deps $(pins verl)
fi
