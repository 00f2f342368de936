"""Ranks that disagree about a call, checks off: a clear error on every rank, never a wrong result
(the call headers, Note [Call headers] in ``distributed/header.py``); what each rank sees and how long it takes.

The other faults (a rank killed, a rank raising before its collective, a tensor of the wrong length,
different plans with check=True) are in ``tests/test_distributed.py``."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpshard import ShardPlan
from cpshard.spawn import run_ranks
from fault_cases import checks_differ_sizes, sequence_counts_differ_sizes
from rank_suites import run_suite

_CASES = ("plans_differ", "dtypes_differ", "shifts_differ", "checks_differ")


def _timed_suite(cases):
    start = time.monotonic()
    out = run_suite("fault_cases", cases, 2, timeout=200, collective_timeout=60)
    return out, time.monotonic() - start


def _per_rank(seen, name):
    out, elapsed = seen
    assert elapsed < 100  # one group for every case, far below the 60 s collective timeout per case
    return [ranks[name] for ranks in out]


@pytest.fixture(scope="module")
def seen():
    return _timed_suite(_CASES)


def _raised(seen, name):
    per_rank = _per_rank(seen, name)
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



# -- every other collective: losses, sums, the scan, the attention (Note [Stamped reductions]) ----------

_OTHERS = ("loss_plans_differ", "loss_checks_on", "loss_unchecked", "loss_dp", "scan_checked",
           "pad_rank_backward", "every_argument_checked", "every_argument_unchecked")


@pytest.fixture(scope="module")
def others():
    return _timed_suite(_OTHERS)


def _raised_at_once(what, kind="ValueError"):
    assert what[0] == "raised" and what[1] == kind, what  # never a result
    assert what[3] < 20, what  # at once, not at a timeout
    return what[2]


def test_losses_of_ranks_that_disagree_raise_on_every_rank_checks_off(others):
    """[5, 3] on rank 0 and [8, 4] on rank 1 returned 0.667 and 1.333 before; zigzag against
    contiguous, another grad_reduction and a bare sum_over_group returned values too."""
    for rank, calls in enumerate(_per_rank(others, "loss_plans_differ")):
        ops = ("token_mean", "token_mean", "sequence_mean", "token_mean", "sum_over_group")
        for what, op in zip(calls, ops):
            msg = _raised_at_once(what)
            assert msg.startswith(f"{op}: the ranks of the group disagree about this reduction (this is rank {rank})")
            assert "Fix: " in msg and "check=True" in msg


def test_losses_with_checks_on_raise_on_every_rank_before_any_sum(others):
    (a0, b0, c0, d0, e0), (a1, b1, c1, d1, e1) = _per_rank(others, "loss_checks_on")
    for what in (a0, a1, e0, e1):  # token_mean, token_sum (no collective of its own): the agreement names both
        msg = _raised_at_once(what)
        assert "built different plans" in msg and "ShardPlan(cp_size=2" in msg and "num_seqs=2" in msg
    for what in (b0, b1):  # sequence_mean, 2 sequences against 3: sizes differ, caught before the sum
        msg = _raised_at_once(what)
        assert "built different plans" in msg and "num_seqs=3" in msg and "num_seqs=2" in msg
    for what in (c1, d1):  # rank 1's own error
        assert _raised_at_once(what).startswith("per_token=tensor of shape (5,)")
    for what in (c0, d0):  # rank 0 no longer waits for rank 1 in the all_reduce
        assert "ranks [1] of the context-parallel group rejected their input" in _raised_at_once(what)


def test_a_count_refused_on_one_rank_checks_off(others):
    """num_tokens given: no collective, so rank 1 raises alone and rank 0 returns; the group stays usable."""
    (c0, d0), (c1, d1) = _per_rank(others, "loss_unchecked")
    assert c0[0] == "ok" and _raised_at_once(c1).startswith("num_tokens=tensor(-5.0): must be a count >= 0")
    # the ranks' shares average to the batch's token mean
    plan = ShardPlan.build([5, 3], cp_size=2)
    rows = [(torch.arange(6, dtype=torch.float64) + 1)[plan.token_mask(r)] for r in range(2)]
    assert d0[0] == d1[0] == "ok" and (d0[1] + d1[1]) / 2 == float(torch.cat(rows).mean())


def test_the_dp_count_carries_a_failure_and_the_loss_kind(others):
    (b0, c0, d0), (b1, c1, d1) = _per_rank(others, "loss_dp")
    # checks on: rank 1 its own error, rank 0 hears it in the DP count (with checks off it waits there)
    assert _raised_at_once(b1).startswith("per_token=")
    assert _raised_at_once(b0).startswith("token_mean over dp_group: a rank of the group rejected its input")
    assert _raised_at_once(c0).startswith("token_mean over dp_group: the ranks of the group disagree")
    assert _raised_at_once(c1).startswith("sequence_mean over dp_group: the ranks of the group disagree")
    assert d0[0] == d1[0] == "ok" and d0[1] != d1[1]  # each DP rank its own share of one mean


def test_the_scan_with_checks_on_raises_on_every_rank_not_aborts(others):
    rows_a_rank = ShardPlan.build([9, 5], cp_size=2, layout="contiguous").local_len
    for rank, (dtype, shape, rows, fine) in enumerate(_per_rank(others, "scan_checked")):
        assert "called with different arguments" in _raised_at_once(dtype) and "torch.float" in dtype[2]
        assert "called with different arguments" in _raised_at_once(shape) and "row shape" in shape[2]
        msg = _raised_at_once(rows)
        if rank == 1:
            assert msg.startswith(f"a=tensor of shape ({rows_a_rank - 1}, 2)"), msg
        else:
            assert "ranks [1] of the context-parallel group rejected their input" in msg
        assert fine == ("ok", (rows_a_rank, 2))


def test_a_rank_of_pad_rows_joins_the_attention_backward(others):
    """Lengths [1] at cp = 2: rank 1 holds only pad rows; before, its backward skipped the key/value
    all_reduce and rank 0 waited in it until rank 1 exited."""
    (r0,), (r1,) = _per_rank(others, "pad_rank_backward")
    assert r0[0] == r1[0] == "ok"
    # the one token attends only to itself: out = v there, so d/dv = 1 on its 2 x 4 values and d/dk = 0
    # (the cp = 1 gradients); rank 1's rows are pad rows and get none
    assert r0[1] == (0.0, 8.0) and r1[1] == (0.0, 0.0)


def test_count_sums_of_different_sizes_never_return():
    """Measured, not designed: sequence_mean over another number of sequences per rank, checks off
    (before: rank 0 returned 0.8333 and rank 1 waited). The trailer leads the counts, so a rank that
    returns from the sum raises; gloo aborts the one that receives more; run_ranks names it at once."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)^rank \d of 2 failed:\n(rank \d exited with code -6 without reporting"
                                           r"|.*ValueError: sequence_mean: the ranks of the group disagree)"):
        run_ranks(sequence_counts_differ_sizes, 2, timeout=100, collective_timeout=60)
    assert time.monotonic() - start < 50


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([torch.float64, torch.float32, torch.int64]), st.integers(2, 64),
       st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1), st.sampled_from(["sum", "max"]), st.data())
def test_a_stamped_reduction_reads_alike_only_when_every_rank_stamped_alike(dtype, ranks, word, other, reduce, data):
    """Note [Stamped reductions], against the reduction done exactly in Python: with every rank's
    trailer alike, every rank reads "alike" (and the sums stay exact in the dtype); with any rank's
    word another, every rank reads "differs" (but for a 48-bit collision); a failure word wins."""
    from cpshard.distributed.header import trailer, trailer_mismatch

    odd = data.draw(st.integers(0, ranks - 1))
    words = [other if r == odd else word for r in range(ranks)]
    trailers = [trailer(w, dtype, ranks, reduce, False) for w in words]
    exact = [sum(col) if reduce == "sum" else max(col) for col in zip(*trailers)]
    reduced = torch.tensor(exact, dtype=dtype)
    assert reduced.tolist() == exact  # every partial sum an exact integer of the dtype
    same = [trailer_mismatch(reduced.tolist(), trailers[r], ranks, reduce) for r in range(ranks)]
    alike = trailer(word, dtype, ranks, reduce, False) == trailer(other, dtype, ranks, reduce, False)
    assert same == [None if alike else "differs"] * ranks
    assert alike == ((word ^ other) & (2**48 - 1) == 0)  # the digest's 48 bits, all of them read
    trailers[odd] = trailer(other, dtype, ranks, reduce, True)
    failed = [sum(col) if reduce == "sum" else max(col) for col in zip(*trailers)]
    assert all(trailer_mismatch(failed, t, ranks, reduce) == "failed" for t in trailers)


# -- every argument of every public collective, flipped on rank 1 (docs/guarantees.md) -------------------

def test_every_argument_flipped_on_one_rank_raises_on_every_rank_naming_it_checks_on(others):
    """Before: the MTP loss's scaling_factor, normalization and grad_reduction returned wrong
    gradients, counts="global" against "local" hung, num_tokens and num_seqs agreed only on whether
    they were given, and no error named the argument that differs."""
    per_rank = _per_rank(others, "every_argument_checked")
    assert len(per_rank[0]) == 34
    for rank, calls in enumerate(per_rank):
        for argument, what in calls:
            msg = _raised_at_once(what)
            assert "the context-parallel group called with different arguments in " in msg, (argument, msg)
            named = msg.split("called with different arguments in ")[1].split(": ranks")[0]
            assert argument in named.split(", "), (argument, named)
            assert f"(this is rank {rank}, which passed " in msg and "Fix: pass every rank the same" in msg


def test_every_argument_the_collective_carries_raises_checks_off(others):
    """Before: a different attention scale, the naive attention against the attention, the MTP loss's
    arguments and sequence_mean's num_seqs returned on every rank. A count given to a call that makes
    no collective is each rank's own (docs/guarantees.md): no message can carry it."""
    per_rank = _per_rank(others, "every_argument_unchecked")
    for rank, calls in enumerate(per_rank):
        ops = ["all_gather_rows"] * 2 + ["shift_sharded_multi"] * 4 + ["mtp_loss"]
        for (argument, what), op in zip(calls, ops):
            msg = _raised_at_once(what)
            assert msg.startswith(f"{op}: the ranks of the "), (argument, msg)
            assert f"{argument}=" in msg and "this rank passed" in msg.lower(), (argument, msg)
        (_, tokens), (_, seqs), (_, drop_in) = calls[7:]
        assert _raised_at_once(drop_in).startswith("shift_sharded_multi: ") and "normalization=" in drop_in[2]
        assert tokens[0] == "ok"
        assert _raised_at_once(seqs).startswith("sequence_mean: the ranks of the CP group passed different num_seqs "
                                                f"(this rank passed {2.0 + rank})")
    plan = ShardPlan.build([9, 7], cp_size=2)
    sums = [float((torch.arange(plan.local_len, dtype=torch.float64) + 1)[plan.token_mask(r)].sum()) for r in (0, 1)]
    assert [calls[7][1][1] for calls in per_rank] == [2 * sums[0] / 10, 2 * sums[1] / 12]  # each its own count


# -- refusals inside the agreement (check=True): every rank raises, the refusing one its own error ----

_REFUSALS = ("refusals_checked", "meta_checked", "counts_refused", "megatron_refusal")


@pytest.fixture(scope="module")
def refusals():
    return _timed_suite(_REFUSALS)


def _own_and_peer(what0, what1, own):
    """Rank 1 raised its own error (``own``: how it starts); rank 0 heard that rank 1 refused."""
    assert _raised_at_once(what1, own[1]).startswith(own[0]), what1
    assert "ranks [1] of the context-parallel group rejected their input" in _raised_at_once(what0), what0


def test_a_rank_that_refuses_its_input_makes_every_rank_raise(refusals):
    """Before: rank 1 raised alone, before the agreement, and rank 0 waited in it (or in the labels'
    exchange of mtp_loss)."""
    calls0, calls1 = _per_rank(refusals, "refusals_checked")
    # the scan of a zigzag plan against a contiguous one: the plans differ, which every rank names first
    for what in (calls0[0], calls1[0]):
        assert "built different plans" in _raised_at_once(what) and "layout='zigzag'" in what[2]
    own = [("states=NoneType: must be a torch.Tensor", "TypeError"),
           ("states=a nested tensor: must be a dense tensor of rows", "ValueError"),
           ("hidden_states=tensor of shape (17, 4): dim 0 must split into 1 + num_depths = 3", "ValueError"),
           ("labels=tensor of shape (5,): must hold one value per local row", "ValueError"),
           ("scaling_factor='0.1': must be a real number", "TypeError"),
           ("labels=tensor of shape (5,): must hold one value per local row", "ValueError")]
    for what0, what1, expected in zip(calls0[1:7], calls1[1:7], own):
        _own_and_peer(what0, what1, expected)
    assert calls0[7][0] == calls1[7][0] == "ok"  # the group is usable after every refusal


def test_tensors_on_the_meta_device_are_refused_on_every_rank(refusals):
    """Before: rank 1 returned a meta "result" without communicating (torch's collectives do nothing on
    meta tensors) and rank 0 waited in the collective."""
    calls0, calls1 = _per_rank(refusals, "meta_checked")
    names = ("local", "local", "local", "rows", "values", "per_token", "a", "q")
    for what0, what1, name in zip(calls0[:-1], calls1[:-1], names):
        _own_and_peer(what0, what1, (f"{name}=a tensor of shape", "ValueError"))
        assert "on the meta device: must hold real values" in what1[2] and "Fix: pass" in what1[2]
    assert calls0[-1][0] == calls1[-1][0] == "ok"


def test_a_count_below_the_tokens_present_raises_on_every_rank(refusals):
    """token_mean(num_tokens=0) while the mask holds tokens returned the plain sum before."""
    (checked0, off0, fine0), (checked1, off1, fine1) = _per_rank(refusals, "counts_refused")
    own = "num_tokens=0: must count at least this rank's labelled tokens (5, from"
    _own_and_peer(checked0, checked1, (own, "ValueError"))
    for what in (off0, off1):
        assert _raised_at_once(what).startswith("num_tokens=0: must count at least this rank's labelled tokens")
    plan = ShardPlan.build([5, 3], cp_size=2)
    rows = [(torch.arange(6, dtype=torch.float64) + 1)[plan.token_mask(r)] for r in range(2)]
    assert fine0[0] == fine1[0] == "ok" and (fine0[1] + fine1[1]) / 2 == float(torch.cat(rows).mean())


def test_the_agreement_holds_the_device_type():
    """What checked_call adds to the agreement (no GPU here: the digest itself): the device types of
    the checked tensors, in any nesting; a meta tensor anywhere is refused."""
    from cpshard.distributed.agree import contribution
    from cpshard.distributed.checks import device_types

    assert device_types((torch.zeros(1), [torch.zeros(2), (torch.zeros(3),)], 3, None)) == ("cpu",)
    with pytest.raises(ValueError, match=r"^input=a tensor of shape \(1,\) on the meta device"):
        device_types((torch.zeros(1), [torch.zeros(1, device="meta")]))
    plan = ShardPlan.build([5, 3], cp_size=2)
    words = [contribution(plan, None, {"dtype": torch.float32, "device": kind})[0] for kind in (("cpu",), ("cuda",))]
    assert torch.equal(words[0][:8], words[1][:8]) and words[0][8] != words[1][8]  # same plan, another call


def test_the_megatron_drop_in_refuses_on_every_rank_without_a_plan(refusals):
    """Checks on, rank 1's labels describe no plan: it raised alone and rank 0 waited in the agreement."""
    (bad0, fine0), (bad1, fine1) = _per_rank(refusals, "megatron_refusal")
    for what in (bad0, bad1):  # the root cause first, on every rank; rank 1's own error is its cause
        msg = _raised_at_once(what)
        assert "built different plans" in msg and "ranks [1] built no plan (see that rank's own error)" in msg, msg
    assert "| cause: labels=tensor of shape (1, 7): under cp = 2 the local sequence length" in bad1[2]
    assert fine0 == fine1 == ("ok", (8, 1, 3))


# -- a fresh adversarial pass (issue 38) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def adversary():
    return _timed_suite(("adversary_grad", "adversary_inputs", "adversary_check_values", "adversary_sums"))


def test_ranks_that_disagree_about_the_backward_raise_in_forward(adversary):
    """Before: rank 1 (no gradient, or no_grad) returned and rank 0 waited in the backward collective."""
    for rank, calls in enumerate(_per_rank(adversary, "adversary_grad")):
        unchecked = (calls[0], calls[1], calls[3])  # attention, shift_sharded, all_gather_rows: the header
        for what, op in zip(unchecked, ("all_gather_rows", "shift_sharded", "all_gather_rows")):
            msg = _raised_at_once(what)
            assert msg.startswith(f"{op}: the ranks of the context-parallel group disagree about this call"), msg
            assert f"requires_grad={rank == 0}" in msg, msg
        for what in (calls[2], calls[4], calls[5]):  # relayout, the scan, the attention: the agreement names it
            msg = _raised_at_once(what)
            assert "called with different arguments in requires_grad" in msg and "Fix: pass every rank" in msg, msg


def test_whole_batch_inputs_and_counts_refused_on_every_rank(adversary):
    """Before: rank 1's whole-batch labels were sharded after the agreement, so it raised alone (rank 0
    returned, or waited in mtp_loss's count sum); num_tokens=inf returned 0; a NaN weight in rank 1's
    mask made rank 0 return its plain sum (6.0) as its share."""
    (len0, count0, fill0, inf0, nan0, seq0, fine0, *spelt0), (len1, count1, fill1, inf1, nan1, seq1, fine1, *spelt1) = (
        _per_rank(adversary, "adversary_inputs"))
    _own_and_peer(len0, len1, ("x[1]=tensor of shape (6,): must have seqlens[1] = 7 rows", "ValueError"))
    _own_and_peer(count0, count1, ("x=list of 3 tensors: must hold the plan's 2 sequences", "ValueError"))
    # rank 0's integer labels cannot take label_fill=0.5, rank 1's float ones can: rank 0 refuses
    assert _raised_at_once(fill0).startswith("fill=0.5: does not fit rows of integer dtype torch.int64"), fill0
    assert "ranks [0] of the context-parallel group rejected their input" in _raised_at_once(fill1), fill1
    for what in (inf0, inf1):
        assert _raised_at_once(what).startswith("num_tokens=inf: must be finite (a count of tokens or sequences)")
    for what in (nan0, nan1, seq0, seq1):  # NaN on every rank, never a finite share
        assert what[0] == "ok" and what[1] != what[1], what
    assert fine0[0] == fine1[0] == "ok"
    # "mean" / "MEAN" (token_mean of ones: shares 2 n_r / 16, adding up to 2), then SUM / "Sum" (sequence_mean
    # of ones under "sum": shares adding up to 1); refused before as "disagree about this reduction"
    for what0, what1, total in zip(spelt0, spelt1, (2.0, 1.0)):
        assert what0[0] == what1[0] == "ok", (what0, what1)
        assert abs(what0[1] + what1[1] - total) < 1e-12, (what0, what1)
    assert spelt0[2:] == spelt1[2:] == [("ok", (2, 10))] * 2  # label_fill spelt two ways: the labels of 2 depths


def test_a_check_that_is_no_bool_is_refused_on_every_rank(adversary):
    """Before: rank 1 raised its TypeError alone; rank 0's agreement paired with rank 1's next call."""
    calls0, calls1 = _per_rank(adversary, "adversary_check_values")
    for what0, what1, value in zip(calls0, calls1, ("'yes'", "1", "'on'")):
        _own_and_peer(what0, what1, (f"check={value}: must be True, False or None", "TypeError"))
    assert calls0[3] == calls1[3] == ("ok", (16,))
    for rank, what in enumerate((calls0[4], calls1[4])):  # before: both waited until the backend's timeout
        msg = _raised_at_once(what)
        assert "called with different arguments in operation" in msg, msg
        assert f"operation={('gather', 'sum_over_group')[rank]}" in msg, msg
    for rank, what in enumerate((calls0[5], calls1[5])):  # before: "Fix: pass the context-parallel group ..."
        assert _raised_at_once(what).startswith(f"dp_group=a group of ranks [{1 - rank}]: does not contain this "
                                                f"process (global rank {rank}). Fix: pass the data-parallel group")


def test_complex_sums_add_up_and_a_complex_maximum_is_refused(adversary):
    """Before: a torch RuntimeError on every rank for the sums; the maximum of the parts apart for max_over."""
    want = torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64) * 3  # ranks 1 and 2 times the values
    for summed, summed_wide, maximum in _per_rank(adversary, "adversary_sums"):
        assert summed[0] == "ok" and torch.equal(summed[1], want), summed
        assert summed_wide[0] == "ok" and torch.equal(summed_wide[1], want.to(torch.complex128)), summed_wide
        assert _raised_at_once(maximum, "TypeError").startswith("values=a torch.complex64 tensor: has no order")
