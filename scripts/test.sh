#!/usr/bin/env bash
# Set up (idempotent; scripts/setup.sh) and run the whole test suite; then the MTP tests once more with
# megatron-core 0.16.0 first on the path (its GPTModel loop, no process_mtp_loss; see scripts/setup.sh); the
# torchtitan adapter's tests with .venv-torchtitan first on the path (torchtitan 0.3.0 and triton);
# the docs site, built with mkdocs --strict (tests/test_docs.py runs every Python block of README.md and
# docs/ in the suite); and the README's install cases in a fresh torch-only environment
# (scripts/check_install.sh, about a minute, run alongside the MTP tests and the docs build;
# CPSHARD_INSTALL_CHECK=0 skips it). With arguments, only pytest runs, with them. Without, the suite runs
# on two pytest-xdist workers where there are two cores or more (the gloo tests together on one of them,
# tests/conftest.py); CPSHARD_TEST_WORKERS=N sets the number, 0 runs it in one process. pytest's -rs
# lists each skipped test with its reason; the docs build ends with a line saying it passed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
.venv/bin/python -m pytest -rs -n "${CPSHARD_TEST_WORKERS:-$(( $(nproc) >= 2 ? 2 : 0 ))}"  # -rs: why each skip
install_log=
if [ "${CPSHARD_INSTALL_CHECK:-1}" != 0 ]; then
  # alongside the MTP tests below (it mostly unpacks torch, on one core); its output follows theirs
  install_log=$(mktemp)
  scripts/check_install.sh > "$install_log" 2>&1 &
  install_pid=$!
  trap 'wait "$install_pid" 2> /dev/null; rm -f "$install_log"' EXIT  # never left running on an early exit
fi
if [ -d .venv-mcore016/megatron ]; then
  echo "--- the MTP tests with megatron-core 0.16.0 ---"
  PYTHONPATH=.venv-mcore016${PYTHONPATH:+:$PYTHONPATH} .venv/bin/python -m pytest -q -rs tests/test_mtp.py \
    tests/test_mtp_distributed.py
fi
if [ -d .venv-torchtitan/torchtitan ]; then
  # torchtitan 0.3.0 and the triton its CP module imports live apart from .venv (scripts/setup.sh): here they
  # come first on the path, for the adapter's tests and the docs page's blocks (the main run skips them)
  echo "--- the torchtitan tests with torchtitan 0.3.0 and triton 3.9.0 (.venv-torchtitan) ---"
  PYTHONPATH=$PWD/.venv-torchtitan${PYTHONPATH:+:$PYTHONPATH} .venv/bin/python -m pytest -q -rs -p no:xdist \
    tests/test_torchtitan.py tests/test_docs.py -k "test_torchtitan or torch_cp"
fi
echo "--- the docs site (mkdocs build --strict: a broken link or a missing API reference fails) ---"
# not --quiet: mkdocs drops its warnings under --quiet, and --strict then passes them
mkdocs_log=$(mktemp)
site_dir="$(mktemp -d)/site"
if ! .venv/bin/mkdocs build --strict --site-dir "$site_dir" > "$mkdocs_log" 2>&1; then
  cat "$mkdocs_log"; exit 1
fi
echo "docs site: OK, $(find "$site_dir" -name index.html | wc -l | tr -d ' ') pages built with no warning"
if [ -n "$install_log" ]; then
  echo "--- the install cases (a fresh environment with torch only) ---"
  status=0
  wait "$install_pid" || status=$?
  cat "$install_log"
  exit "$status"
fi
