"""cpshard.compat.verl against verl 0.9.1 itself (differential), Megatron's parallel state faked.

Single-process tests run every CP rank of a batch in one process; the functions that gather run on
gloo ranks (cpshard.spawn.run_ranks). Where verl is wrong the test asserts verl's wrong value next to
cpshard's right one (README, "Differences from verl").
"""

from __future__ import annotations

import importlib
import io
import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from strategies import props

try:
    import verl_fakes as vf
except ImportError as exc:  # scripts/setup.sh installs both; CI always runs these tests
    pytest.skip(f"verl 0.9.1 / megatron-core cannot be imported ({exc}); run scripts/setup.sh",
                allow_module_level=True)

from cpshard import BshdPlan, ShardPlan, alignment, shard, to_padded
from cpshard.compat import verl as cv
from cpshard.spawn import run_ranks

vutil = vf.vutil


def _lens(draw, low=0, big=True):
    one = st.integers(low, 20) | st.sampled_from([low, 1, 7, 8, 9, 16, 17, 31, 32, 33]).filter(lambda n: n >= low)
    if big:
        one = one | st.integers(low, 150)
    lens = draw(st.lists(one, min_size=1, max_size=6), "lens")
    if sum(lens) == 0:
        lens[0] = 1
    return lens


def _thd_case(data, *, layouts=("zigzag", "contiguous")):
    cp = data.draw(st.integers(1, 5), "cp")
    tp = data.draw(st.integers(1, 4), "tp")
    layout = data.draw(st.sampled_from(layouts), "layout")
    return cp, tp, layout


_TRAILING = st.sampled_from([(), (), (3,), (2, 2)])
_DTYPES = st.sampled_from([torch.int64, torch.int32, torch.float32, torch.bfloat16])


def _verl_thd(x, cp, tp, rank, **kwargs):
    with vf.parallel_state(tp, cp, rank), vf.partition_mode():
        return vutil.preprocess_thd_engine(x, **kwargs)


def _ours_thd(x, cp, tp, rank, **kwargs):
    with vf.partition_mode():
        return cv.preprocess_thd_engine(x, tp_size=tp, cp_size=cp, cp_rank=rank, **kwargs)


def _same_params(verl_psp, ours_psp):
    for name in ("qkv_format", "max_seqlen_q", "max_seqlen_kv", "cp_partition_mode", "local_cp_size"):
        assert getattr(ours_psp, name, None) == getattr(verl_psp, name, None), name
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        a, b = getattr(verl_psp, name), getattr(ours_psp, name)
        assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), name


def _lost_labels(plan, rank, roll):
    """Rows where verl loses a label (README, "Differences from verl", 1): under zigzag need_roll at
    cp > 1 an empty sequence writes 0 into the row before its start; where that row holds a token
    whose next token exists, verl's label is gone. The only rows where the drop-in may differ."""
    lost = torch.zeros(plan.local_len, dtype=torch.bool)
    if roll and plan.layout.value == "zigzag" and plan.cp_size > 1:
        before = [c // plan.cp_size - 1 for c, n in zip(plan.cu_seqlens_padded_py, plan.padded_seqlens_py) if n == 0]
        lost[[b for b in before if b >= 0]] = True
    return lost & plan.label_mask(rank)


def _same_whole(got, want, allowed=None):
    """Equal on every row (pad rows included), dtype and shape too, but for the ``allowed`` rows."""
    assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
    keep = slice(None) if allowed is None else ~allowed
    assert torch.equal(got[0][keep], want[0][keep])


# -- THD ------------------------------------------------------------------------------------------

@props(60)
@given(st.data())
def test_preprocess_thd_engine_matches_verl(data):
    """Whole outputs: rows, position ids and PackedSeqParams, on every row of every rank."""
    cp, tp, layout = _thd_case(data)
    lens = _lens(data.draw)
    roll = data.draw(st.booleans(), "need_roll")
    fp8 = data.draw(st.booleans(), "fp8")
    x = vf.nested(lens, data.draw(_TRAILING, "trailing"), data.draw(_DTYPES, "dtype"), seed=len(lens))
    for r in range(cp):
        kw = dict(need_roll=roll, use_fp8_padding=fp8, cp_layout=layout)
        got, psp, pos = _ours_thd(x, cp, tp, r, **kw)
        want, verl_psp, verl_pos = _verl_thd(x, cp, tp, r, **kw)
        _same_params(verl_psp, psp)
        plan = psp._cpshard_plan
        lost = _lost_labels(plan, r, roll)
        _same_whole(got, want, lost)
        _same_whole(pos, verl_pos)
        # where verl loses a label, the drop-in holds the right one (cpshard's own shift)
        assert torch.equal(got[0][lost], shard(x, plan, r, shift=1)[lost])
        assert (want[0][lost] == 0).all()


def test_zero_length_sequence_clobbers_label():
    """verl: under zigzag with need_roll an empty sequence overwrites the row before its start (the
    previous sequence's last row on each rank) with 0; where that row holds a token whose next
    token exists, its label is lost. The drop-in keeps it, and elsewhere writes what verl writes."""
    x = torch.nested.nested_tensor([torch.arange(10, 18), torch.tensor([], dtype=torch.int64),
                                    torch.arange(20, 24)], layout=torch.jagged)
    # rank 0 holds s0p0 s0p1 s0p6 s0p7 | s2p0 s2p3; rank 1 s0p2..s0p5 | s2p1 s2p2. Rolled, each
    # padded sequence wraps to its first token (s0p7 -> 10, s2p3 -> 20); row 3 (s0p7) is the empty
    # sequence's "row before", a label-less row on rank 0 (verl's 0 stays) and s0p5 on rank 1.
    ours = {r: _ours_thd(x, 2, 1, r, need_roll=True)[0][0].tolist() for r in range(2)}
    assert ours == {0: [11, 12, 17, 0, 21, 20], 1: [13, 14, 15, 16, 22, 23]}
    verl = {r: _verl_thd(x, 2, 1, r, need_roll=True)[0][0].tolist() for r in range(2)}
    assert verl[0] == ours[0]
    assert verl[1] == [13, 14, 15, 0, 22, 23]  # token 5 of sequence 0 should be labelled 16


@props(40)
@given(st.data())
def test_extensions_match_verl_where_verl_keeps_every_token(data):
    """min_local_rows / pad_to_length_bucket: verl's buffers where its padding is valid; where it is
    not, verl loses tokens and cpshard rounds the total up and keeps them all."""
    cp, tp, layout = _thd_case(data)
    lens = _lens(data.draw, big=False)
    fp8 = data.draw(st.booleans(), "fp8")
    mlr = data.draw(st.none() | st.integers(0, 80), "min_local_rows")
    bucket = data.draw(st.none() | st.integers(1, 70), "pad_to_length_bucket")
    x = vf.nested(lens, seed=3)
    kw = dict(use_fp8_padding=fp8, min_local_rows=mlr, pad_to_length_bucket=bucket, cp_layout=layout)
    plan = _ours_thd(x, cp, tp, 0, **kw)[1]._cpshard_plan
    verl_psp = _verl_thd(x, cp, tp, 0, pre_process=False, **kw)[1]  # its padding, without its copy loop
    verl_padded = torch.diff(verl_psp.cu_seqlens_q_padded).tolist()
    if verl_padded == list(plan.padded_seqlens_py):
        for r in range(cp):
            (got, _, pos), (want, _, verl_pos) = _ours_thd(x, cp, tp, r, **kw), _verl_thd(x, cp, tp, r, **kw)
            _same_whole(got, want)
            _same_whole(pos, verl_pos)
        return
    # verl's total breaks an invariant (it loses tokens or mis-splits ranks); cpshard's total is larger
    total = sum(verl_padded)
    broken = (total % cp or (total // cp) % tp
              or (layout == "zigzag" and cp > 1 and any(p % (2 * cp) for p in verl_padded))
              or (fp8 and total % (128 * alignment(cp, tp, layout))))
    assert broken, (verl_padded, plan.padded_seqlens_py)
    assert plan.total_len > total and plan.padded_seqlens_py[:-1] == tuple(verl_padded[:-1])


def _rank_values(x, cp, tp, fn, **kw):
    out = []
    for r in range(cp):
        try:
            out.append(fn(x, cp, tp, r, **kw)[0][0])
        except (RuntimeError, IndexError) as exc:
            out.append(exc)
    return out


def test_min_local_rows_drops_a_token_in_verl():
    """One 3-token sequence, cp=2, min_local_rows=3: verl pads it to 6 rows (not a multiple of
    2 * cp = 4) and no rank receives token 2. cpshard pads to 8 rows, 4 per rank (>= 3)."""
    x = torch.nested.nested_tensor([torch.tensor([7, 8, 9])], layout=torch.jagged)
    verl = _rank_values(x, 2, 1, _verl_thd, min_local_rows=3)
    ours = _rank_values(x, 2, 1, _ours_thd, min_local_rows=3)
    assert [v.tolist() for v in verl] == [[7, 0, 0], [8, 0, 0]]      # 9 is gone
    assert [v.tolist() for v in ours] == [[7, 8, 0, 0], [9, 0, 0, 0]]


def test_length_bucket_drops_tokens_in_verl():
    """9 tokens, tp=2, cp=2, pad_to_length_bucket=6: verl extends 16 rows to 18 (18 % 4 != 0) and
    loses tokens; cpshard's total is 24 (a multiple of lcm(6, 2) that keeps 2 * cp * tp = 8)."""
    x = torch.nested.nested_tensor([torch.arange(1, 10)], layout=torch.jagged)
    verl = _rank_values(x, 2, 2, _verl_thd, pad_to_length_bucket=6)
    ours = _rank_values(x, 2, 2, _ours_thd, pad_to_length_bucket=6)
    verl_tokens = sorted(v for part in verl for v in part.tolist() if v)
    assert verl_tokens != list(range(1, 10)) and len(verl[0]) == 9
    assert sorted(v for part in ours for v in part.tolist() if v) == list(range(1, 10))
    assert [len(v) for v in ours] == [12, 12]


def test_dynamic_cp_matches_verl():
    x = vf.nested([5, 0, 11, 3], seed=1)
    for cp in (2, 3):
        for r in range(cp):
            group = vf.FakeGroup(cp, r)
            with vf.parallel_state(2, 8, 0, group=group), vf.fake_group_ranks():
                want, verl_psp, verl_pos = vutil.preprocess_thd_engine(x, need_roll=True, local_cp_size=cp)
                got, psp, pos = cv.preprocess_thd_engine(x, need_roll=True, local_cp_size=cp)
            _same_params(verl_psp, psp)
            assert psp.cp_group is group and verl_psp.cp_group is group
            lost = _lost_labels(psp._cpshard_plan, r, True)
            _same_whole(got, want, lost)
            _same_whole(pos, verl_pos)


def test_pre_process_false_and_psp_only():
    x = vf.nested([5, 3])
    got = _ours_thd(x, 2, 1, 0, pre_process=False)
    want = _verl_thd(x, 2, 1, 0, pre_process=False)
    assert got[0] is x and want[0] is x and got[2] is None and want[2] is None
    _same_params(want[1], got[1])


def test_postprocess_thd_engine_single_rank_matches_verl():
    x = vf.nested([5, 0, 9, 3], trailing=(2,), dtype=torch.float32)
    for tp in (1, 2, 3):
        rows, psp, _ = _ours_thd(x, 1, tp, 0)
        out = rows.float() * 2
        with vf.parallel_state(tp, 1, 0):
            want = vutil.postprocess_thd_engine(out, psp, x, 4)
        got = cv.postprocess_thd_engine(out, psp, x, 4, cp_size=1)
        assert torch.equal(got.values(), want.values()) and torch.equal(got.offsets(), want.offsets())
        assert torch.equal(got.values(), x.values() * 2)
        # without the plan the PackedSeqParams carries: re-derived from its offsets and the lengths
        bare = vf.psp_module.PackedSeqParams(**{k: getattr(psp, k) for k in ("qkv_format", "cu_seqlens_q_padded")})
        assert torch.equal(cv.postprocess_thd_engine(out, bare, x, 4, cp_size=1).values(), want.values())
    assert cv.postprocess_thd_engine(out, psp, x, 4, post_process=False) is out


# -- legacy padded THD ---------------------------------------------------------------------------

@props(40)
@given(st.data())
def test_preprocess_packed_seqs_matches_verl(data):
    cp, tp, _ = _thd_case(data, layouts=("zigzag",))
    lens = _lens(data.draw, big=False)
    fp8 = data.draw(st.booleans(), "fp8")
    left = data.draw(st.booleans(), "left padding")
    s = max(lens) + data.draw(st.integers(0, 3), "extra columns")
    nt = vf.nested(lens, data.draw(_TRAILING, "trailing"), seed=2)
    padded, mask = to_padded(nt, padding_side="left" if left else "right", length=s)
    for r in range(cp):
        with vf.parallel_state(tp, cp, r):
            want, verl_psp = vutil.preprocess_packed_seqs(padded, mask, use_fp8_padding=fp8)
        got, psp = cv.preprocess_packed_seqs(padded, mask, use_fp8_padding=fp8, tp_size=tp, cp_size=cp, cp_rank=r)
        _same_params(verl_psp, psp)
        _same_whole(got, want)


def test_postprocess_packed_seqs_single_rank_matches_verl():
    nt = vf.nested([5, 1, 9], trailing=(2,), seed=4)
    padded, mask = to_padded(nt, padding_side="left", length=11)
    rows, psp = cv.preprocess_packed_seqs(padded, mask, tp_size=2, cp_size=1, cp_rank=0)
    out = rows.float() + 0.5
    with vf.parallel_state(2, 1, 0):
        want = vutil.postprocess_packed_seqs(out, psp, mask, 3, 11)
    assert torch.equal(cv.postprocess_packed_seqs(out, psp, mask, 3, 11, cp_size=1), want)


def test_postprocess_packed_seqs_checks_the_mask_against_the_plan():
    """A mask with the same token total in other rows moved tokens into the wrong sample; another total
    failed inside torch's indexing. Both are refused, naming the lengths (as postprocess_thd_engine)."""
    nt = vf.nested([5, 1, 9], trailing=(2,), seed=4)
    padded, mask = to_padded(nt, padding_side="left", length=11)
    rows, psp = cv.preprocess_packed_seqs(padded, mask, tp_size=2, cp_size=1, cp_rank=0)
    for other, lens in zip(_other_masks(mask), ([9, 1, 5], [6, 1, 9])):
        shown = ", ".join(map(str, lens))
        with pytest.raises(ValueError, match=rf"^attention_mask=mask with lengths \[{shown}\]: must match the "
                                             r"plan's seqlens \[5, 1, 9\]\. Fix: pass the attention_mask"):
            cv.postprocess_packed_seqs(rows.float(), psp, other, 3, 11, cp_size=1)


# -- BSHD ----------------------------------------------------------------------------------------

@props(40)
@given(st.data())
def test_preprocess_bshd_engine_matches_verl(data):
    cp, tp, _ = _thd_case(data, layouts=("zigzag",))
    lens = _lens(data.draw, low=1, big=False)
    roll = data.draw(st.booleans(), "need_roll")
    fp8 = data.draw(st.booleans(), "fp8")
    forced = data.draw(st.none() | st.integers(max(lens), max(lens) + 40), "forced_max_seqlen")
    x = vf.nested(lens, data.draw(_TRAILING, "trailing"), data.draw(_DTYPES, "dtype"), seed=5)
    for r in range(cp):
        kw = dict(need_roll=roll, use_fp8_padding=fp8, forced_max_seqlen=forced)
        with vf.parallel_state(tp, cp, r):
            want, verl_mask, verl_pos = vutil.preprocess_bshd_engine(x, **kw)
        got, mask, pos = cv.preprocess_bshd_engine(x, tp_size=tp, cp_size=cp, cp_rank=r, **kw)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(mask, verl_mask) and torch.equal(pos, verl_pos)
        assert torch.equal(got, want)  # every column, pad columns and the rolled last column included


def test_postprocess_bshd_engine_single_rank_matches_verl():
    x = vf.nested([5, 2, 7], trailing=(3,), dtype=torch.float32, seed=6)
    got, mask, _ = cv.preprocess_bshd_engine(x, tp_size=2, cp_size=1, cp_rank=0)
    with vf.parallel_state(2, 1, 0):
        want = vutil.postprocess_bshd_engine(got * 3, mask)
    for m in (mask, mask.clone()):  # with the plan the mask carries, and re-derived from the mask
        out = cv.postprocess_bshd_engine(got * 3, m, cp_size=1)
        assert torch.equal(out.values(), want.values()) and torch.equal(out.offsets(), want.offsets())


@props(30)
@given(st.data())
def test_vlm_masks_match_verl(data):
    cp, tp, _ = _thd_case(data, layouts=("zigzag",))
    lens = _lens(data.draw, low=1, big=False)
    forced = data.draw(st.none() | st.integers(max(lens), max(lens) + 30), "forced_max_seqlen")
    pad = data.draw(st.sampled_from([0, -1, 151643]), "pad_token_id")
    x = vf.nested(lens, seed=7)
    with vf.parallel_state(tp, cp, 0):
        want_thd = vutil.build_vlm_attn_mask_thd(x, pad)
        want_bshd = vutil.build_vlm_attn_mask_bshd(x, len(lens), pad, forced_max_seqlen=forced)
    got_thd = cv.build_vlm_attn_mask_thd(x, pad, tp_size=tp, cp_size=cp)
    got_bshd = cv.build_vlm_attn_mask_bshd(x, len(lens), pad, forced_max_seqlen=forced, tp_size=tp, cp_size=cp)
    for got, want in ((got_thd, want_thd), (got_bshd, want_bshd)):
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))


# -- plans, parallel state, errors ------------------------------------------------------------------

def test_one_plan_per_step_is_shared_and_checked():
    x = vf.nested([6, 2, 9])
    plan = cv.thd_plan(x, cp_layout="contiguous", tp_size=2, cp_size=3)
    with vf.partition_mode():
        a = cv.preprocess_thd_engine(x, cp_layout="contiguous", tp_size=2, cp_size=3, cp_rank=1, plan=plan)
        b = cv.preprocess_thd_engine(x, need_roll=True, cp_layout="contiguous", tp_size=2, cp_size=3, cp_rank=1,
                                     plan=plan)
        assert a[1]._cpshard_plan is plan and b[1]._cpshard_plan is plan
        with pytest.raises(ValueError, match=r"plan=ShardPlan.*has layout 'contiguous', not cp_layout='zigzag'"):
            cv.preprocess_thd_engine(x, tp_size=2, cp_size=3, cp_rank=0, plan=plan)
        with pytest.raises(ValueError, match=r"is for cp_size=3, not the 2 ranks of this call"):
            cv.preprocess_thd_engine(x, cp_layout="contiguous", tp_size=2, cp_size=2, cp_rank=0, plan=plan)
        # the drift verl guards with a comment: a value head restored with another layout than the
        # policy head's plan. The plan travels in the PackedSeqParams, so it is an error here
        out = a[0].float()
        with pytest.raises(ValueError, match=r"has layout 'contiguous', not cp_layout='zigzag'"):
            cv.postprocess_thd_engine(out, a[1], x, 3, cp_layout="zigzag", cp_size=3)
        with pytest.raises(ValueError, match=r"has layout 'contiguous', not cp_layout='zigzag'"):
            cv.postprocess_thd_engine(out, a[1], x, 3, cp_size=3, plan=plan)
    with pytest.raises(TypeError, match="plan=BshdPlan: must be a ShardPlan"):
        cv.preprocess_thd_engine(x, tp_size=1, cp_size=1, cp_rank=0, plan=BshdPlan.build([6, 2, 9], cp_size=1))


def test_parallel_state_is_read_only_when_not_given():
    x = vf.nested([5, 3])
    with vf.parallel_state(2, 2, 1):
        read = cv.preprocess_thd_engine(x)
    given_ = cv.preprocess_thd_engine(x, tp_size=2, cp_size=2, cp_rank=1)
    assert torch.equal(read[0], given_[0]) and read[1]._cpshard_plan == given_[1]._cpshard_plan
    # nothing initialized and nothing given: a clear error, not a ZeroDivisionError
    with pytest.raises(ValueError, match=r"get_tensor_model_parallel_world_size=.*Fix: call parallel_state"):
        cv.preprocess_thd_engine(x)


def test_errors_name_the_argument():
    x = vf.nested([5, 3])
    # verl's words (its own tests match them), then cpshard's fix
    with pytest.raises(ValueError, match=r"^Unsupported context parallel layout: diagonal \(cp_layout='diagonal'; "
                                         r"valid: 'zigzag', 'contiguous'\)\. Fix: pass cp_layout="):
        cv.preprocess_thd_engine(x, cp_layout="diagonal", tp_size=1, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match=r"pad_to_length_bucket=0: must be >= 1"):
        cv.preprocess_thd_engine(x, pad_to_length_bucket=0, tp_size=1, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match=r"cp_rank=2: must lie in \[0, cp_size\)"):
        cv.preprocess_thd_engine(x, tp_size=1, cp_size=2, cp_rank=2)
    with pytest.raises(ValueError, match=r"plan=a contiguous plan at cp_size=2: .*megatron-core 0\.19\.2"):
        cv.preprocess_thd_engine(x, cp_layout="contiguous", tp_size=1, cp_size=2, cp_rank=0)
    rows, psp, _ = cv.preprocess_thd_engine(x, tp_size=1, cp_size=1, cp_rank=0)
    with pytest.raises(ValueError, match=r"output=tensor of shape \(8,\): must be \(1, local rows, \.\.\.\)"):
        cv.postprocess_thd_engine(rows[0], psp, x, 2, cp_size=1)
    with pytest.raises(ValueError, match=r"batch_size=3: must equal the micro-batch's 2 sequences"):
        cv.postprocess_thd_engine(rows, psp, x, 3, cp_size=1)
    with pytest.raises(ValueError, match=r"input_ids=nested tensor with lengths \[3, 5\]: must match"):
        cv.postprocess_thd_engine(rows, psp, vf.nested([3, 5]), 2, cp_size=1)
    with pytest.raises(ValueError, match=r"max_seqlen=4: must be >= the longest sequence \(5\)"):
        cv.preprocess_bshd_engine(x, forced_max_seqlen=4, tp_size=1, cp_size=1, cp_rank=0)
    with pytest.raises(TypeError, match=r"pad_token_id=None: is needed"):
        cv.build_vlm_attn_mask_thd(x, tp_size=1, cp_size=1)
    # releases have main's name for the dynamic group; uninitialized, it says so
    with pytest.raises(ValueError, match=r"get_hybrid_data_context_parallel_groups=megatron\.core\.parallel_state\."
                                         r"get_hybrid_data_context_parallel_groups\(\) raised KeyError"):
        cv.preprocess_thd_engine(x, local_cp_size=2, tp_size=1, cp_rank=0)


# -- gloo: the functions that gather ----------------------------------------------------------------

def _gather_suite(rank, world):
    """Every gathering function, verl's and cpshard's, on the same rows; returns what must match."""
    import torch

    import verl_fakes as vf
    from cpshard import ShardPlan
    from cpshard.compat import verl as cv

    vutil = vf.vutil
    results = {}
    torch.manual_seed(0)
    with vf.parallel_state(2, world, rank), vf.partition_mode():
        for layout in ("zigzag", "contiguous"):
            x = vf.nested([7, 0, 13, 2, 1], trailing=(2,), dtype=torch.float32, seed=8)
            rows, psp, _ = cv.preprocess_thd_engine(x, cp_layout=layout)
            out = (rows * 3).requires_grad_(True)
            want = vutil.postprocess_thd_engine(out, psp, x, 5, cp_layout=layout)
            got = cv.postprocess_thd_engine(out, psp, x, 5, cp_layout=layout)
            bare = vf.PackedSeqParamsWithMode(qkv_format="thd", cu_seqlens_q_padded=psp.cu_seqlens_q_padded,
                                              cp_partition_mode=layout)
            rederived = cv.postprocess_thd_engine(out, bare, x, 5, cp_layout=layout)
            w = torch.randn(want.values().shape, generator=torch.Generator().manual_seed(1))
            g_want = torch.autograd.grad((want.values() * w).sum(), out)[0]
            g_got = torch.autograd.grad((got.values() * w).sum(), out)[0]
            results[f"thd {layout}"] = (want.values().detach(), got.values().detach(), rederived.values().detach(),
                                        x.values() * 3, g_want, g_got)
        # a plan shared by the step that reordered its sequences (contiguous, balanced): the
        # PackedSeqParams follow the buffer, the restore returns the caller's order
        x = vf.nested([50, 3, 9, 70, 1], seed=14)
        plan = ShardPlan.build([50, 3, 9, 70, 1], cp_size=world, tp_size=2, layout="contiguous", reorder="balanced")
        rows, psp, _ = cv.preprocess_thd_engine(x, cp_layout="contiguous", plan=plan)
        got = cv.postprocess_thd_engine(rows * 2, psp, x, 5, cp_layout="contiguous")
        results["reordered"] = (got.values(), x.values() * 2, psp.cu_seqlens_q_padded, plan.cu_seqlens_padded,
                                plan.order is not None)
        # legacy padded path
        nt = vf.nested([5, 1, 9], seed=9)
        padded, mask = to_padded(nt, padding_side="left", length=12)
        rows, psp = cv.preprocess_packed_seqs(padded, mask)
        out = rows.float() + 0.25
        want = vutil.postprocess_packed_seqs(out, psp, mask, 3, 12)
        got = cv.postprocess_packed_seqs(out, psp, mask, 3, 12)
        results["packed"] = (want, got)
        # the mask postprocess gets is not the one preprocess packed: the same total in other rows,
        # and another total (before: tokens moved into the wrong sample, or torch's indexing failed)
        results["packed, other mask"] = [_refused(lambda: cv.postprocess_packed_seqs(out, psp, other, 3, 12))
                                         for other in _other_masks(mask)]
        # BSHD: with the plan the mask carries, and re-derived from every rank's mask (one all-gather)
        x = vf.nested([5, 2, 11], trailing=(3,), dtype=torch.float32, seed=10)
        cols, bmask, _ = cv.preprocess_bshd_engine(x)
        want = vutil.postprocess_bshd_engine(cols * 2, bmask)
        got = cv.postprocess_bshd_engine(cols * 2, bmask)
        rederived = cv.postprocess_bshd_engine(cols * 2, bmask.clone())
        results["bshd"] = (want.values(), got.values(), rederived.values(), x.values() * 2)
    # dynamic CP: the group travels in the PackedSeqParams
    import torch.distributed as dist
    x = vf.nested([4, 9], seed=11)
    with vf.parallel_state(1, 1, 0, group=dist.group.WORLD):
        rows, psp, _ = cv.preprocess_thd_engine(x, local_cp_size=world)
        want = vutil.postprocess_thd_engine(rows * 1.0, psp, x, 2, local_cp_size=world)
        got = cv.postprocess_thd_engine(rows * 1.0, psp, x, 2, local_cp_size=world)
    results["dynamic"] = (want.values(), got.values(), x.values() * 1.0)
    results["forward"] = _forward_both(rank, world)
    return _as_bytes(results)


def _other_masks(mask):
    """Masks of ``mask``'s shape whose rows hold other lengths: the same total, then one token more."""
    import torch

    lens = mask.sum(-1).tolist()
    moved = [lens[-1], *lens[1:-1], lens[0]] if lens[0] != lens[-1] else [lens[0] - 1, *lens[1:-1], lens[-1] + 1]
    more = [lens[0] + 1, *lens[1:]]
    columns = torch.arange(mask.shape[1])
    return [columns < torch.tensor(n)[:, None] for n in (moved, more)]


def _refused(call):
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return "returned"


def _as_bytes(obj):
    """Tensors leave a rank as bytes (a queued tensor's shared memory dies with the process)."""
    import io

    import torch

    def plain(x):  # a clone drops Python attributes (the plan a mask carries)
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, (list, tuple)):
            return type(x)(plain(v) for v in x)
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    buf = io.BytesIO()
    torch.save(plain(obj), buf)
    return buf.getvalue()


def _stub_model(pre_process=True, post_process=True):
    """A Megatron model as far as verl's forward functions look: records what it receives."""
    import types

    import torch

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pre_process, self.post_process = pre_process, post_process
            self.config = types.SimpleNamespace(fp8=None, sequence_parallel=False)
            self.calls = []

        def forward(self, input_ids, attention_mask=None, position_ids=None, packed_seq_params=None, **kwargs):
            self.calls.append(dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   psp=packed_seq_params, **kwargs))
            return input_ids.unsqueeze(-1).float() * 0.5 + 1.0  # (.., 1): one "logit" per row

    return Stub()


def _forward_both(rank, world):
    """verl's gptmodel_forward_model_engine unpatched and patched, THD and BSHD: what the model saw
    and what came back (the model's outputs, and the rolled labels on every token but the last)."""
    import torch
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine

    import verl_fakes as vf
    from cpshard.compat import verl as cv

    def processor(output, label):
        return {"logits": output.squeeze(-1), "labels": label.float()}

    lens = [6, 3, 10]
    not_last = torch.cat([torch.arange(n) < n - 1 for n in lens])
    out = {}
    for data_format in ("thd", "bshd"):
        runs = []
        for patched in (False, True):
            model = _stub_model()
            with vf.parallel_state(1, world, rank), (cv.patch() if patched else _nothing()):
                res = gptmodel_forward_model_engine(model, vf.nested(lens, seed=12), {}, logits_processor=processor,
                                                    logits_processor_args={"label": vf.nested(lens, seed=13)},
                                                    data_format=data_format)
            seen = model.calls[0]
            runs.append((res["logits"].values(), res["labels"].values()[not_last], seen["input_ids"],
                         seen["attention_mask"], seen["position_ids"]))
        out[data_format] = runs
    return out


def _nothing():
    import contextlib
    return contextlib.nullcontext()


@pytest.fixture(scope="module")
def gloo():
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = [torch.load(io.BytesIO(b)) for b in
                            run_ranks(_gather_suite, world, timeout=300, collective_timeout=60)]
        return cache[world]
    return get


@pytest.mark.parametrize("world", [2])
def test_gathering_functions_match_verl_across_ranks(gloo, world):
    for rank, res in enumerate(gloo(world)):
        for layout in ("zigzag", "contiguous"):
            want, got, rederived, truth, g_want, g_got = res[f"thd {layout}"]
            assert torch.equal(got, want) and torch.equal(rederived, want) and torch.equal(got, truth)
            assert torch.equal(g_got, g_want), (rank, layout)  # gradient reaches the own rows only
        want, got = res["packed"]
        assert torch.equal(got, want)
        for msg in res["packed, other mask"]:  # every rank, before the gather
            assert msg.startswith("attention_mask=mask with lengths [")
            assert "must match the plan's seqlens [5, 1, 9]" in msg
        want, got, rederived, truth = res["bshd"]
        assert torch.equal(got, want) and torch.equal(rederived, want) and torch.equal(got, truth)
        want, got, truth = res["dynamic"]
        assert torch.equal(got, want) and torch.equal(got, truth)
        got, truth, psp_cu, plan_cu, reordered = res["reordered"]
        assert reordered and torch.equal(got, truth) and torch.equal(psp_cu, plan_cu)


def _same_runs(res):
    for data_format, (unpatched, patched) in res.items():
        for a, b in zip(unpatched, patched):
            assert (a is None and b is None) or torch.equal(a, b), data_format


def test_patched_forward_gives_verls_tensors_across_ranks(gloo):
    for res in gloo(2):
        _same_runs(res["forward"])


# -- patch() ------------------------------------------------------------------------------------------

def test_patch_replaces_every_binding_and_undoes_itself(caplog):
    import verl.models.mcore.model_forward as mf
    import verl.models.mcore.model_forward_fused as mff

    originals = {name: getattr(vutil, name) for name in cv.DROP_INS}
    with caplog.at_level(logging.DEBUG, logger="cpshard.compat.verl"):
        with cv.patch() as p:
            for name, fn in cv.DROP_INS.items():
                assert getattr(vutil, name) is fn and getattr(mf, name) is fn
            assert mff.preprocess_thd_engine is cv.preprocess_thd_engine
            assert "verl.models.mcore.util.preprocess_thd_engine" in p.replaced
            assert cv.patch().replaced == []  # already patched: nothing more to do
    assert any(f"calls cpshard at {len(p.bound)} sites" in r.getMessage() for r in caplog.records)  # INFO once
    for name, fn in originals.items():
        assert getattr(vutil, name) is fn and getattr(mf, name) is fn
    assert mff.preprocess_thd_engine is originals["preprocess_thd_engine"]
    p.undo()  # a second undo changes nothing
    assert vutil.preprocess_thd_engine is originals["preprocess_thd_engine"]


def test_patched_forward_single_rank_equals_unpatched():
    _same_runs(_forward_both(0, 1))


def test_patch_refuses_a_moved_or_changed_name(monkeypatch):
    monkeypatch.delattr(vutil, "build_vlm_attn_mask_bshd")
    with pytest.raises(ValueError, match=r"^verl=0\.9\.1: verl\.models\.mcore\.util has no build_vlm_attn_mask_bshd"):
        cv.patch()
    monkeypatch.undo()

    def changed(input_ids, pre_process=True, roll=False):
        return None

    monkeypatch.setattr(vutil, "preprocess_thd_engine", changed)
    with pytest.raises(ValueError, match=r"preprocess_thd_engine takes \(input_ids, pre_process, roll\), but "
                                         r"cpshard's drop-in is written for verl 0\.9\.1's"):
        cv.patch()
    monkeypatch.undo()
    import verl.models.mcore.model_forward as mf
    monkeypatch.setattr(mf, "postprocess_thd_engine", lambda *a: None)
    with pytest.raises(ValueError, match=r"model_forward\.postprocess_thd_engine is test_verl_compat\..*<lambda>, "
                                         r"not verl\.models\.mcore\.util\.postprocess_thd_engine \(verl wrapped"):
        cv.patch()
    assert vutil.preprocess_thd_engine is not cv.preprocess_thd_engine  # nothing was changed


def test_patch_names_the_module_that_is_missing(monkeypatch):
    """An import failure of verl's Megatron path names the real missing module (not "reinstall verl")."""
    real = importlib.import_module

    def no_triton(name, *args):
        if name == "verl.models.mcore.model_forward":
            raise ModuleNotFoundError("No module named 'triton'", name="triton")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_triton)
    with pytest.raises(ValueError, match=r"cannot import verl\.models\.mcore\.model_forward: the module 'triton' "
                                         r"is missing .*Fix: install triton"):
        cv.patch()
    assert vutil.preprocess_thd_engine is not cv.preprocess_thd_engine


def test_patch_skips_a_name_a_module_no_longer_binds(monkeypatch, caplog):
    """verl main's model_forward_fused builds its VLM mask inline and no longer imports
    build_vlm_attn_mask_thd: that site is skipped and logged, every other site is bound, and undo
    restores them all (checked by hand against verl main's tree too: README, "verl")."""
    import verl.models.mcore.model_forward as mf
    import verl.models.mcore.model_forward_fused as fused
    monkeypatch.delattr(fused, "build_vlm_attn_mask_thd")
    originals = {name: getattr(vutil, name) for name in cv.DROP_INS}
    with caplog.at_level(logging.INFO, logger="cpshard.compat.verl"), cv.patch() as p:
        site = "verl.models.mcore.model_forward_fused.build_vlm_attn_mask_thd"
        assert p.skipped[site] == "this verl's model_forward_fused does not bind build_vlm_attn_mask_thd (nothing to " \
                                  "replace)" and site not in p.bound
        assert f"skipped {site}: this verl's model_forward_fused does not bind" in caplog.text
        assert not hasattr(fused, "build_vlm_attn_mask_thd")
        assert fused.preprocess_thd_engine is cv.preprocess_thd_engine and mf.build_vlm_attn_mask_thd is \
            cv.build_vlm_attn_mask_thd
        assert "verl.models.mcore.model_forward_fused.preprocess_thd_engine" in p.replaced
    assert not hasattr(fused, "build_vlm_attn_mask_thd")
    for name, fn in originals.items():
        assert getattr(vutil, name) is fn and getattr(mf, name) is fn
    assert fused.preprocess_thd_engine is originals["preprocess_thd_engine"]


def test_short_forced_max_seqlen_drops_tokens_in_verl():
    """BSHD with forced_max_seqlen below the longest row: verl at cp=2 silently keeps only the first
    4 of 8 tokens (at cp=1 it fails with a shape error); cpshard refuses with a clear error."""
    x = torch.nested.nested_tensor([torch.arange(1, 9), torch.arange(11, 14)], layout=torch.jagged)
    kept = []
    for r in range(2):
        with vf.parallel_state(1, 2, r):
            cols, mask, _ = vutil.preprocess_bshd_engine(x, forced_max_seqlen=4)
        kept += cols[0][mask[0]].tolist()
    assert sorted(kept) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"max_seqlen=4: must be >= the longest sequence \(8\)"):
        cv.preprocess_bshd_engine(x, forced_max_seqlen=4, tp_size=1, cp_size=2, cp_rank=0)


def test_valid_verl_extension_is_kept_exactly():
    """verl extends [3] at tp=2 cp=2 with min_local_rows=6 to 12 rows: a multiple of 2 * cp but not
    of 2 * cp * tp. Every token survives, so cpshard keeps verl's 12 rows (not its own 16)."""
    x = torch.nested.nested_tensor([torch.tensor([7, 8, 9])], layout=torch.jagged)
    for r in range(2):
        got, psp, _ = _ours_thd(x, 2, 2, r, min_local_rows=6)
        want, verl_psp, _ = _verl_thd(x, 2, 2, r, min_local_rows=6)
        _same_params(verl_psp, psp)
        assert psp.cu_seqlens_q_padded.tolist() == [0, 12] and torch.equal(got, want)
    assert ShardPlan.build([3], cp_size=2, tp_size=2, min_local_rows=6).total_len == 16


# -- patch() routes verl's MTP loss through cpshard ---------------------------------------------------

class _OutputLayer(torch.nn.Module):
    """Megatron's ColumnParallelLinear at tp=1, as verl's postprocess calls it."""

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=torch.float64,
                                                     generator=torch.Generator().manual_seed(5)))

    def forward(self, x, weight=None, runtime_gather_output=None):
        return x @ (self.weight if weight is None else weight).t(), None


def _mtp_postprocess(depths: int, per_token: bool):
    """verl 0.9.1's GPTModel postprocess (``mtp_patch._megatron_gptmodel_postprocess``) on a stub model
    at cp=1: the returned logits and the gradients of the hidden states and the output weight."""
    import types

    import torch.nn.functional as F
    import verl.models.mcore.mtp_patch as mp

    b, s, h, v = 2, 11, 4, 13
    g = torch.Generator().manual_seed(depths)
    out = _OutputLayer(h, v)

    def lm_loss(labels, logits):  # [b, s], [s, b, v] -> [b, s], as Megatron's compute_language_model_loss
        return F.cross_entropy(logits.transpose(0, 1).reshape(-1, v), labels.reshape(-1), reduction="none").view(b, s)

    model = types.SimpleNamespace(
        share_embeddings_and_output_weights=False, post_process=True, training=False, output_layer=out,
        compute_language_model_loss=lm_loss,
        config=types.SimpleNamespace(mtp_num_layers=depths, mtp_loss_scaling_factor=0.3,
                                     calculate_per_token_loss=per_token, use_mup=False, mtp_detach_heads=False))
    hidden = torch.randn((1 + depths) * s, b, h, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.2).double()
    logits = mp._megatron_gptmodel_postprocess(model, hidden, labels, None, labels, None, None, None,
                                               mtp_in_postprocess=False, loss_mask=mask)
    (logits * torch.linspace(-1, 1, logits.numel(), dtype=torch.float64).view_as(logits)).sum().backward()
    return logits.detach(), hidden.grad, out.weight.grad


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize(("depths", "per_token"), [(1, False), (2, True), (3, False)])
def test_patch_routes_verls_mtp_loss_through_cpshard(monkeypatch, legacy, depths, per_token):
    """Both of verl's MTP paths (megatron-core's process_mtp_loss, and the legacy roll_tensor loop with
    a detached output layer) give the same tensors at cp=1 once routed through cpshard's drop-in."""
    import verl.models.mcore.mtp_patch as mp

    from cpshard.megatron import process_mtp_loss

    if legacy:
        monkeypatch.setattr(mp, "_HAS_PROCESS_MTP_LOSS", False)
    theirs = _mtp_postprocess(depths, per_token)
    with cv.patch() as p:
        assert mp._HAS_PROCESS_MTP_LOSS is True and mp._process_mtp_loss.__wrapped__ is process_mtp_loss
        assert f"{mp.__name__}._process_mtp_loss" in p.replaced
        ours = _mtp_postprocess(depths, per_token)
    assert mp._HAS_PROCESS_MTP_LOSS is (not legacy)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_patch_undo_removes_a_name_verl_did_not_have(monkeypatch):
    import verl.models.mcore.mtp_patch as mp

    monkeypatch.setattr(mp, "_HAS_PROCESS_MTP_LOSS", False)
    monkeypatch.delattr(mp, "_process_mtp_loss", raising=False)
    with cv.patch():
        assert callable(mp._process_mtp_loss)
    assert not hasattr(mp, "_process_mtp_loss") and mp._HAS_PROCESS_MTP_LOSS is False


def test_drop_in_with_a_reordered_plan():
    """A balanced (reordered) plan passed as plan=: the rows are shard's (taken in the caller's order),
    and PackedSeqParams' padded offsets follow the buffer's order, as the attention kernel needs."""
    lens = [900, 3, 0, 400, 17, 1200]
    x = torch.nested.nested_tensor([torch.arange(n) + 10_000 * i for i, n in enumerate(lens)], layout=torch.jagged)
    plan = ShardPlan.build(lens, cp_size=3, layout="contiguous", reorder="balanced")
    assert plan.order is not None
    for r in range(3):
        with vf.partition_mode():
            rows, psp, pos = cv.preprocess_thd_engine(x, cp_layout="contiguous", tp_size=1, cp_size=3, cp_rank=r,
                                                      plan=plan)
        assert psp.cp_partition_mode == "contiguous"
        assert torch.equal(rows[0], shard(x.values(), plan, r))
        # verl's position ids under contiguous: each token's position, 0 on pad rows
        assert torch.equal(pos[0], torch.where(plan.token_mask(r), plan.position_ids(r), 0))
        assert psp.cu_seqlens_q_padded.tolist() == list(plan.cu_seqlens_padded_py)


def test_one_host_copy_per_call(monkeypatch):
    """The lengths are read once by preprocess and once by postprocess (verl reads them too): host
    copies of the batch's offsets (the plan's own small CPU index tensors are not counted)."""
    x = vf.nested([5, 0, 9, 3], dtype=torch.float32)
    calls = []
    original = torch.Tensor.tolist
    offsets = x.offsets().untyped_storage().data_ptr()
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda t: (t.untyped_storage().data_ptr() == offsets and calls.append(1)) or original(t))
    rows, psp, _ = cv.preprocess_thd_engine(x, need_roll=True, tp_size=2, cp_size=1, cp_rank=0)
    assert len(calls) == 1
    cv.postprocess_thd_engine(rows, psp, x, 4, cp_size=1)
    assert len(calls) == 2
