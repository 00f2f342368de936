"""Ranks that disagree about a call, checks off: a clear error on every rank, never a wrong result
(the call headers, Note [Call headers] in ``distributed/header.py``); what each rank sees and how long it takes.

The other faults (a rank killed, a rank raising before its collective, a tensor of the wrong length,
different plans with check=True) are in ``tests/test_distributed.py``."""

from __future__ import annotations

import time

import pytest
from cpshard.spawn import run_ranks

from fault_cases import checks_differ_sizes
from rank_suites import run_suite

_CASES = ("plans_differ", "dtypes_differ", "shifts_differ", "checks_differ")


@pytest.fixture(scope="module")
def seen():
    start = time.monotonic()
    out = run_suite("fault_cases", _CASES, 2, timeout=200, collective_timeout=60)
    return out, time.monotonic() - start


def _raised(seen, name):
    out, elapsed = seen
    assert elapsed < 100  # one group for every case, far below the 60 s collective timeout per case
    per_rank = [ranks[name] for ranks in out]
    for rank, calls in enumerate(per_rank):
        for what in calls:
            assert what[0] == "raised" and what[1] == "ValueError", (rank, what)  # never a result
            assert what[3] < 20, what  # at once, not at a timeout
            assert f"(this is rank {rank}): rank {1 - rank} differs in" in what[2], what[2]
    return [[what[2] for what in calls] for calls in per_rank]


def test_different_plans_of_one_local_length_raise_on_every_rank(seen):
    for gather_msg, shift_msg in _raised(seen, "plans_differ"):
        assert gather_msg.startswith("gather: ") and "differs in plan." in gather_msg
        assert shift_msg.startswith("shift_sharded: ") and "differs in plan." in shift_msg
        assert "Fix: " in gather_msg


def test_different_dtypes_raise_on_every_rank(seen):
    (a, b, c), (d, e, f) = _raised(seen, "dtypes_differ")
    assert "dtype (torch.int32 there, torch.float32 here)" in a and "dtype (torch.float32 there, torch.int32 here)" in d
    assert "dtype (torch.int32 there" in b and c.startswith("shift_sharded_multi: ") and "dtype" in f


def test_different_shifts_and_fills_raise_on_every_rank(seen):
    for msgs in _raised(seen, "shifts_differ"):
        assert all("differs in shift, pad and fill values" in m for m in msgs), msgs


def test_mixed_check_settings_are_named_not_mispaired(seen):
    """check=True on rank 0 only: its agreement all-gather meets rank 1's data all-gather (here of the
    same size); each rank reads the other's header and names the check settings."""
    (checked,), (unchecked,) = _raised(seen, "checks_differ")
    assert checked.startswith("check=True agreement: ") and "check setting (unchecked there, checked here)" in checked
    assert unchecked.startswith("gather: ") and "check setting (checked there, unchecked here)" in unchecked
    assert "kind (the agreement check of check=True" in unchecked and "plan" not in unchecked.split("Fix")[0][-60:]


def test_messages_of_different_sizes_abort_the_rank_that_receives_more():
    """Measured, not designed: where the ranks' messages differ in size (check settings with a gather
    of another size, plans or dtypes of other widths), gloo aborts the process that receives more
    bytes than it expects (``EnforceNotMet``, SIGABRT); run_ranks names it at once."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)^rank \d of 2 failed:\nrank \d exited with code -6 without reporting"):
        run_ranks(checks_differ_sizes, 2, timeout=100, collective_timeout=60)
    assert time.monotonic() - start < 50

