#!/usr/bin/env bash
# Create .venv and install cpshard with its test extra, every version from constraints.txt (read by group:
# see its header). torch is installed first and alone so that pip never resolves an unpinned torch (which
# would download a multi-GB CUDA build); everything after it that could pull torch goes in with --no-deps.
#
# Each step prints what it installs and how long it took, and leaves a stamp in .venv/.cpshard-setup/: the
# hash of what it installed from (its pins, pyproject.toml for cpshard's own step, the switches below). A
# rerun skips every step whose stamp still matches, so a rerun with nothing to install takes a moment; a
# fresh clone has no .venv and installs everything.
#
# Switches (environment variables):
#   CPSHARD_TORCH="torch==2.6.0"  another torch (then torch's own dependencies float)
#   CPSHARD_MEGATRON=0            skip megatron-core (0.19.2 into .venv, 0.16.0 into .venv-mcore016, a --target
#                                 folder scripts/test.sh puts first on PYTHONPATH for a second run of the MTP
#                                 tests); the Megatron tests then skip, naming the reason
#   CPSHARD_NO_VERL=1             skip verl 0.9.1 and its pinned dependencies; tests/test_verl_compat.py skips
#   CPSHARD_NO_TORCHTITAN=1       skip torchtitan 0.3.0 and what its CP module imports (triton, ...), which go
#                                 into .venv-torchtitan (a --target folder scripts/test.sh puts first on
#                                 PYTHONPATH for the torchtitan tests' own run); tests/test_torchtitan.py skips
#   PYTHON=python3.11             the interpreter that creates .venv
#   CPSHARD_SETUP_FORCE=1         run every step, stamps or not
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CONSTRAINTS=constraints.txt
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
STAMPS=.venv/.cpshard-setup
started=$EPOCHREALTIME
ran=()
current=()

pins() {  # the pins of group $1 in constraints.txt, one per line
  awk -v group="[$1]" '$1 == "#" && $2 == group { on = 1; next } /^# \[/ { on = 0 } on && NF && $1 !~ /^#/ { print $1 }' \
    "$CONSTRAINTS"
}

seconds_since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f s", b - a }'; }

key() { printf '%s\n' "$@" | sha256sum | cut -c1-16; }  # a stamp: the hash of its arguments

# step NAME KEY WHAT COMMAND...: run COMMAND unless the stamp of NAME holds KEY; WHAT says what it installs
step() {
  local name=$1 stamp=$2 what=$3 start=$EPOCHREALTIME
  shift 3
  if [ "${CPSHARD_SETUP_FORCE:-0}" != 1 ] && [ "$(cat "$STAMPS/$name" 2> /dev/null)" = "$stamp" ]; then
    current+=("$name")
    return
  fi
  echo "setup: $name: $what" | fold -s -w 118 | sed '2,$s/^/         /'
  rm -f "$STAMPS/$name"
  "$@"
  mkdir -p "$STAMPS"
  echo "$stamp" > "$STAMPS/$name"
  echo "setup: $name: done in $(seconds_since "$start")"
  ran+=("$name")
}

listed() { tr '\n' ' ' | sed 's/ $//'; }  # pins on one line

if [ ! -x .venv/bin/python ]; then
  start=$EPOCHREALTIME
  echo "setup: venv: a virtual environment .venv from $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  rm -rf .venv
  "$PYTHON" -m venv .venv
  echo "setup: venv: done in $(seconds_since "$start")"
  ran+=(venv)
fi

if [ -n "${CPSHARD_TORCH:-}" ]; then
  step torch "$(key "$CPSHARD_TORCH")" "$CPSHARD_TORCH (CPSHARD_TORCH), its dependencies unpinned" \
    "${PIP[@]}" "$CPSHARD_TORCH"
else
  pins torch > .venv/constraints-torch.txt
  step torch "$(key "$(pins torch)")" \
    "$(pins torch | grep '^torch==') (the CPU wheel), alone, then its pinned dependencies: $(pins torch | grep -v '^torch==' | listed)" \
    "${PIP[@]}" -c .venv/constraints-torch.txt "$(pins torch | grep '^torch==')"
fi

pins core > .venv/constraints-core.txt
step core "$(key "$(pins core)" "$(cat pyproject.toml)" "$PWD")" \
  "cpshard from $PWD (editable) with its [test] extra, pinned: $(pins core | listed)" \
  "${PIP[@]}" -c .venv/constraints-core.txt -e '.[test]'

if [ "${CPSHARD_MEGATRON:-1}" != "0" ]; then
  # shellcheck disable=SC2046  # one word per pin
  step megatron "$(key "$(pins megatron)")" "$(pins megatron | listed) (--no-deps --ignore-requires-python)" \
    "${PIP[@]}" --no-deps --ignore-requires-python $(pins megatron)
  second=$(awk '$1 == "#" && $2 == "second:" { print $3 }' "$CONSTRAINTS")
  second_install() {
    rm -rf .venv-mcore016
    "${PIP[@]}" --no-deps --ignore-requires-python --target .venv-mcore016 "$second"
  }
  if [ ! -d ".venv-mcore016/megatron_core-${second#*==}.dist-info" ]; then
    rm -f "$STAMPS/megatron-second"
  fi
  step megatron-second "$(key "$second")" "$second into .venv-mcore016 (a second run of the MTP tests)" second_install
fi
if [ "${CPSHARD_NO_VERL:-0}" != 1 ]; then
  # shellcheck disable=SC2046
  step verl "$(key "$(pins verl)")" "$(pins verl | listed) (each --no-deps)" "${PIP[@]}" --no-deps $(pins verl)
fi
if [ "${CPSHARD_NO_TORCHTITAN:-0}" != 1 ]; then
  # into a --target folder, not .venv: triton in .venv would hide the triton-less CPU machine that the
  # Megatron tests stand for (cpshard.megatron's stand-in); scripts/test.sh puts it first on PYTHONPATH
  # for the torchtitan tests' own run
  titan_install() {
    rm -rf .venv-torchtitan
    # shellcheck disable=SC2046
    "${PIP[@]}" --no-deps --target .venv-torchtitan $(pins torchtitan)
  }
  if [ ! -d .venv-torchtitan/torchtitan ]; then
    rm -f "$STAMPS/torchtitan"
  fi
  step torchtitan "$(key "$(pins torchtitan)" target)" \
    "$(pins torchtitan | listed) into .venv-torchtitan (each --no-deps; the torchtitan tests' own run)" titan_install
fi

if [ "${#ran[@]}" -eq 0 ]; then
  echo "setup: .venv is up to date (${current[*]}: nothing to install; CPSHARD_SETUP_FORCE=1 reinstalls)," \
    "$(seconds_since "$started")"
else
  echo "setup: .venv ready in $(seconds_since "$started") (installed: ${ran[*]}${current:+; up to date: ${current[*]}})"
  echo "setup: the CLI is .venv/bin/cpshard (or \`source .venv/bin/activate\`, then \`cpshard\`)"
fi
