#!/usr/bin/env bash
# The README's install cases, in a fresh virtual environment that holds only torch (the pin in
# constraints.txt; a CPU wheel): scripts/test.sh runs this after the test suite (it needs .venv, whose
# pip installs into the fresh environment and builds the checkout's wheel once).
#   1. pip install --no-deps of the checkout: `import cpshard` fails, naming NumPy and the command to install it
#   2. that command, then the checkout: cpshard imports and runs, and torch is the one installed before
#   3. pip install of the checkout with its dependencies into a torch-only environment: NumPy comes, torch stays
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ENV=.venv-install
PIP=(.venv/bin/python -m pip --python "$ENV/bin/python" install -q --disable-pip-version-check --no-compile)
# Installed without bytecode (--no-compile: compiling all of torch takes longer than it saves); where the
# environment says never to write any (PYTHONDONTWRITEBYTECODE), every start of the fresh interpreter would
# compile torch's modules again: here the first import writes them (into $ENV, removed at the end).
unset PYTHONDONTWRITEBYTECODE
rm -rf "$ENV"
"$PYTHON" -m venv --without-pip "$ENV"
.venv/bin/python -m pip wheel -q --disable-pip-version-check --no-deps -w "$ENV/wheel" . &  # while torch installs
build=$!
"${PIP[@]}" "$(grep '^torch==' constraints.txt)"
wait "$build"
wheel=$(ls "$ENV"/wheel/cpshard-*.whl)
torch_before=$("$ENV/bin/python" -c "import torch; print(torch.__version__)" 2> /dev/null)  # torch warns: no NumPy
"${PIP[@]}" --no-deps "$wheel"
if "$ENV/bin/python" -c "import cpshard" 2> "$ENV/import.err"; then
  echo "check_install: import cpshard without NumPy should fail with a clear message" >&2
  exit 1
fi
grep -q "cpshard needs NumPy" "$ENV/import.err" && grep -q "pip install 'numpy>=1.22'" "$ENV/import.err" || {
  echo "check_install: the ImportError does not name NumPy and its install command:" >&2
  cat "$ENV/import.err" >&2
  exit 1
}
"${PIP[@]}" "$(grep '^numpy==' constraints.txt)"
check() {
  "$ENV/bin/python" - "$torch_before" <<'PY'
import sys, torch, cpshard
from cpshard import ShardPlan, shard
assert torch.__version__ == sys.argv[1], (torch.__version__, sys.argv[1])
plan = ShardPlan.build([5, 3], cp_size=2)
assert shard([torch.arange(5), torch.arange(10, 13)], plan, 1).tolist() == [2, 3, 4, 0, 11, 12]
PY
  "$ENV/bin/cpshard" plan --lengths 5,3 --cp 2 | grep -q "rank 1 : s0p2 s0p3 | s0p4 pad  | s1p1 | s1p2"
}
check
echo "check_install: --no-deps install: a clear ImportError without NumPy, then imports and runs (torch $torch_before)"
.venv/bin/python -m pip --python "$ENV/bin/python" uninstall -q -y numpy cpshard
grep -v '^torch' constraints.txt > "$ENV/constraints.txt"  # a file: pip --python runs pip again, elsewhere
"${PIP[@]}" -c "$ENV/constraints.txt" "$wheel"
check
echo "check_install: pip install with dependencies into a torch-only environment: numpy added, torch kept"
rm -rf "$ENV"
