#!/usr/bin/env bash
# Set up (scripts/setup.sh: prints each step and its time; a rerun with nothing to install takes under a
# second) and run cpshard's main job on its built-in default: cpshard verify (a tiny transformer at cp=2
# and 4, tp 1 and 2, both layouts, compared with cp=1 on spawned gloo ranks). Arguments go to verify.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "run: .venv/bin/cpshard verify $*"
status=0
.venv/bin/cpshard verify "$@" || status=$?
if [ "$status" -eq 0 ]; then
  echo "run: next, .venv/bin/cpshard --help (or \`source .venv/bin/activate\`, then \`cpshard\`); docs/index.md lists the docs"
fi
exit "$status"
