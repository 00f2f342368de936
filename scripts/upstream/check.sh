#!/usr/bin/env bash
# By hand, not in CI: the drop-ins against verl's and Megatron-LM's source trees (what the README's
# "Versions tested" reports). Needs scripts/setup.sh first and the trees from the search tool's fetch:
#   git -C <verl mirror> archive HEAD | tar -x -C /tmp/verl-main
#   git -C <Megatron-LM mirror> archive dev megatron | tar -x -C /tmp/mdev   (and main into /tmp/mmain)
#   scripts/upstream/check.sh /tmp/verl-main /tmp/mdev /tmp/mmain
set -euo pipefail
cd "$(dirname "$0")/../.."
VERL_TREE=$1 MDEV=$2 MMAIN=${3:-}
PY=.venv/bin/python
WORK=$(mktemp -d)
"$PY" -m pip install -q --no-deps --no-build-isolation --target "$WORK/verl" "$VERL_TREE"  # its dist-info names its version
# 1. verl's own util tests, with only the lines that load util.py changed to load the drop-ins
"$PY" - "$VERL_TREE" "$WORK/test_upstream.py" <<'PY'
import sys
src = open(f"{sys.argv[1]}/tests/utils/test_megatron_bshd_preprocess.py").read()
start = src.index('    util_path = Path(__file__)')
end = src.index('    return module', start) + len('    return module')
open(sys.argv[2], "w").write(src[:start] + "    import cpshard.compat.verl as module\n    return module" + src[end:])
PY
echo "--- verl's upstream util tests against cpshard.compat.verl (one fakes all_gather's list form: may fail)"
(cd "$WORK" && PYTHONPATH="$WORK/verl" "$OLDPWD/$PY" -m pytest -q -p no:cacheprovider test_upstream.py) || true
echo "--- whole outputs against that verl's util.py"
PYTHONPATH="$WORK/verl" "$PY" scripts/upstream/compare_thd.py 2>&1 | tail -1
echo "--- local_padding_mask against that verl's dynamic-CP padding mask (verl main only)"
PYTHONPATH="$WORK/verl" "$PY" scripts/upstream/compare_dcp_mask.py 2>&1 | tail -1
# 2. verl's own micro-batch tests through patch() (verl.workers.engine.utils imports a few more packages:
#    installed --no-deps beside it); test_seqlen_balancing's spawned ranks moved to gloo and the CPU
echo "--- verl's micro-batch tests against cpshard.compat.verl.rearrange_micro_batches (one asserts verl main's count: fails)"
"$PY" -m pip install -q --no-deps --target "$WORK/extra" peft accelerate datasets multiprocess pandas pyarrow dill xxhash
echo "--- what patch() binds in that verl (the site counts docs/verl.md reports), with and without those packages"
PYTHONPATH="$WORK/verl:$WORK/extra" "$PY" -m cpshard.compat.verl 2>&1 | grep -vE "Warning|warn\(" || true
PYTHONPATH="$WORK/verl" "$PY" -m cpshard.compat.verl 2>&1 | grep -E "sites$|^skipped|^refused|^  verl.*: " || true
cp "$VERL_TREE/tests/utils/test_prepare_micro_batches_with_group_size.py" "$WORK/"
cat > "$WORK/conftest.py" <<'PY'
import pytest


@pytest.fixture(autouse=True)
def _cpshard_patch():
    from cpshard.compat import verl as cv
    with cv.patch():
        import verl.workers.engine.utils as engine_utils
        assert engine_utils.rearrange_micro_batches is cv.rearrange_micro_batches
        yield
PY
sed -e 's/^    rearrange_micro_batches,$//' \
    -e 's/^from verl.utils.seqlen_balancing import (/from cpshard.compat.verl import rearrange_micro_batches\nfrom verl.utils.seqlen_balancing import (/' \
    -e 's/    get_torch_device().set_device(rank)/    pass/' -e 's/        backend=get_nccl_backend(),/        backend="gloo",/' \
    -e 's/device=f"{get_device_name()}:{rank}"/device="cpu"/g' \
    "$VERL_TREE/tests/utils/test_seqlen_balancing.py" > "$WORK/test_seqlen_balancing_cpshard.py"
(cd "$WORK" && PYTHONPATH="$WORK/verl:$WORK/extra:$WORK" "$OLDPWD/$PY" -m pytest -q -p no:cacheprovider \
  test_prepare_micro_batches_with_group_size.py test_seqlen_balancing_cpshard.py 2>&1 | grep -E "^FAILED|passed|failed") || true
# 3. verl's other CPU tests of the modules whose sites patch() binds (dynamic CP, MTP, router replay,
#    the fused forward, packed padding, the FSDP fused forwards' labels under Ulysses), with patch() in force around every test, on the installed
#    megatron-core (verl main's model_forward_fused tests expect 0.19's GPTModel, not dev's or main's)
echo "--- verl's tests of the patched modules, under patch()"
mkdir -p "$WORK/sites"
for f in tests/utils/test_megatron_mtp_dcp.py tests/utils/test_dynamic_cp_scheduler.py \
         tests/utils/test_megatron_router_replay_dcp.py tests/models/test_model_forward_fused.py \
         tests/workers/test_packed_pad_to_length_on_cpu.py tests/utils/megatron/test_router_replay_model_walk_on_cpu.py \
         tests/models/test_fused_kernels_ulysses_sp_on_cpu.py; do
  cp "$VERL_TREE/$f" "$WORK/sites/"
done
# the dynamic-CP test imports verl's padding mask by name: it tests cpshard's instead
sed -i -e 's/^    _local_padding_mask,$//' \
    -e 's/^import verl.utils.dynamic_cp_scheduler as dcp_module$/&\nfrom cpshard.compat.verl import local_padding_mask as _local_padding_mask/' \
    "$WORK/sites/test_dynamic_cp_scheduler.py"
cp scripts/upstream/megatron_cpu_conftest.py "$WORK/sites/conftest.py"
cat >> "$WORK/sites/conftest.py" <<'PY'


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _cpshard_patch():
    from cpshard.compat import verl as cv
    with cv.patch() as patched:
        assert len(patched.replaced) > 20
        yield
PY
(cd "$WORK/sites" && PYTHONPATH="$WORK/verl:$WORK/extra" "$OLDPWD/$PY" -m pytest -q -p no:cacheprovider test_*.py 2>&1 \
  | grep -E "^FAILED|passed|failed") || true
for tree in "$MDEV" $MMAIN; do
  echo "--- process_mtp_loss against $tree (tests/test_mtp.py; its version check reads the installed metadata: fails)"
  PYTHONPATH="$tree" "$PY" -m pytest -q tests/test_mtp.py 2>&1 | grep -E "^FAILED|passed|failed" || true
  # 4. Megatron-LM's own process_mtp_loss tests with the drop-in in place of Megatron's, on the CPU
  #    (needs the tree's tests too: git archive dev tests/__init__.py tests/unit_tests/__init__.py
  #    tests/unit_tests/test_utilities.py tests/unit_tests/transformer/test_multi_token_prediction.py
  #    tests/unit_tests/dist_checkpointing | tar -x -C <tree>)
  own="$tree/tests/unit_tests/transformer/test_multi_token_prediction.py"
  if [ -f "$own" ]; then
    echo "--- Megatron's own process_mtp_loss tests in $tree against cpshard.megatron.process_mtp_loss"
    dest="$WORK/m$(basename "$tree")"
    mkdir -p "$dest/tests/unit_tests/transformer"
    cp -r "$tree/tests/__init__.py" "$tree/tests/unit_tests/__init__.py" "$tree/tests/unit_tests/test_utilities.py" \
      "$tree/tests/unit_tests/dist_checkpointing" "$dest/tests/unit_tests/" 2>/dev/null || true
    cp "$tree/tests/__init__.py" "$dest/tests/"
    cp scripts/upstream/megatron_cpu_conftest.py "$dest/conftest.py"
    sed -e 's/^from tests.unit_tests.test_utilities import Utils$/&\nfrom cpshard.megatron import process_mtp_loss  # the drop-in/' \
        -e 's/device="cuda"/device="cpu"/g' "$own" > "$dest/tests/unit_tests/transformer/test_multi_token_prediction.py"
    (cd "$dest" && PYTHONPATH="$tree:$dest" "$OLDPWD/$PY" -m pytest -q -p no:cacheprovider \
      tests/unit_tests/transformer/test_multi_token_prediction.py -k process_mtp_loss 2>&1 | grep -E "^FAILED|^E  .*Error|passed|failed|error") || true
  fi
done
rm -rf "$WORK"
