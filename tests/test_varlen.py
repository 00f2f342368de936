"""cpshard.varlen_metadata against the naive per-token document mask (tests/reference.py).

Every rank in one process: the gathered keys are the concatenation of every rank's ``shard`` rows.
The index check lists the (query, key) pairs flash-attn's bottom-right causal mask scores in each
segment (``ref_flash_pairs``) and compares them, each exactly once, with the pairs the naive mask
allows. The numeric check runs each segment through SDPA with that per-segment mask, scatters the
outputs back and compares with a dense masked SDPA over the rank's queries and every key (float64).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from cpshard import BshdPlan, ShardPlan, VarlenMetadata, shard, varlen_metadata
from reference import ref_bshd_varlen_rows, ref_flash_pairs, ref_varlen_mask, ref_varlen_rows
from strategies import props

F64 = torch.float64
H, D = 2, 3
WINDOWS = [None, 1, 2, 5, 10**6]  # 10**6: longer than any document


@st.composite
def cases(draw):
    cp = draw(st.integers(1, 4))
    tp = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(["zigzag", "contiguous", "balanced", "bshd-zigzag", "bshd-contiguous"]))
    padding = draw(st.sampled_from(["minimal", "aligned", "none"]))  # "none": the HF layer's zigzag default
    one = st.sampled_from([0, 1, 2, 3, 7]) | st.integers(0, 40)
    lens = draw(st.lists(one, min_size=1, max_size=6))
    window = draw(st.sampled_from(WINDOWS))
    return _plan(lens, cp, tp, layout, padding), window


def _plan(lens, cp, tp, layout, padding="minimal"):
    if layout.startswith("bshd-"):
        return BshdPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout.removeprefix("bshd-"))
    kw = dict(reorder="balanced") if layout == "balanced" else {}
    return ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout="contiguous" if layout == "balanced" else layout,
                           padding=padding, **kw)


def _rows(plan) -> list:
    """Per rank, per flattened local row: (document, position, is_token), from the reference."""
    if isinstance(plan, BshdPlan):
        return ref_bshd_varlen_rows(plan.seqlens_py, plan.max_seqlen, plan.cp_size, plan.layout)
    return ref_varlen_rows(plan.seqlens_py, plan.padded_seqlens_py, plan.cp_size, plan.layout)


def _ref_mask(plan, r, window) -> torch.Tensor:
    local = math.prod(plan.local_shape)
    return torch.tensor(ref_varlen_mask(_rows(plan), r, window), dtype=torch.bool).reshape(local, plan.cp_size * local)


def _segments(m: VarlenMetadata):
    cq, ck = m.cu_seqlens_q.tolist(), m.cu_seqlens_k.tolist()
    for s in range(m.num_segments):
        yield m.q_index[cq[s]:cq[s + 1]], m.k_index[ck[s]:ck[s + 1]]


def _check_indices(plan, r, window):
    m = varlen_metadata(plan, r, window=window)
    info = _rows(plan)[r]
    assert m.q_index.dtype == m.k_index.dtype == torch.int64
    assert m.cu_seqlens_q.dtype == m.cu_seqlens_k.dtype == torch.int32
    assert m.window_size == ((-1, -1) if window is None else (window - 1, 0))
    assert m.q_index.tolist() == [q for q, (_, _, token) in enumerate(info) if token]
    qlens = (m.cu_seqlens_q[1:] - m.cu_seqlens_q[:-1]).tolist()
    klens = (m.cu_seqlens_k[1:] - m.cu_seqlens_k[:-1]).tolist()
    assert m.max_seqlen_q == max(qlens, default=0) and m.max_seqlen_k == max(klens, default=0)
    pairs = Counter()
    runs = []
    for qi, ki in _segments(m):
        qi, ki = qi.tolist(), ki.tolist()
        docs_pos = [info[q][:2] for q in qi]
        assert docs_pos == [(docs_pos[0][0], docs_pos[0][1] + i) for i in range(len(qi))]  # one run of one document
        runs.append((docs_pos[0], docs_pos[-1]))
        scored = ref_flash_pairs(len(qi), len(ki), m.window_size)
        assert {j for _, j in scored} == set(range(len(ki))), "a key no query of the segment sees"
        for i, j in scored:
            pairs[qi[i], ki[j]] += 1
    for (_, (doc, last)), ((doc2, first), _) in zip(runs, runs[1:]):
        assert not (doc == doc2 and first == last + 1), "a run split in two segments"
    assert all(n == 1 for n in pairs.values()), "a pair scored twice"
    mask = _ref_mask(plan, r, window)
    assert set(pairs) == {tuple(p) for p in mask.nonzero().tolist()}


def _outputs(plan, r, window, *, top_left=False):
    """Rank ``r``'s attention two ways: the segments through SDPA, and the dense masked SDPA."""
    g = torch.Generator().manual_seed(plan.num_tokens + 7 * r)
    q, k, v = (list(torch.randn(plan.num_tokens, H, D, generator=g, dtype=F64).split(plan.input_seqlens_py))
               for _ in range(3))

    def local(x, s):  # rank s's rows, flattened (a BSHD rank holds (B, M / cp) of them)
        return shard(x, plan, s).reshape(-1, H, D)
    q_local = local(q, r)
    k_all = torch.cat([local(k, s) for s in range(plan.cp_size)])
    v_all = torch.cat([local(v, s) for s in range(plan.cp_size)])
    m = varlen_metadata(plan, r, window=window)
    out = torch.zeros_like(q_local)
    for qi, ki in _segments(m):
        nq, nk = qi.numel(), ki.numel()
        seg_mask = torch.zeros(nq, nk, dtype=torch.bool)
        for i, j in ref_flash_pairs(nq, nk if not top_left else nq, m.window_size):
            seg_mask[i, j] = True
        o = F.scaled_dot_product_attention(q_local[qi].transpose(0, 1), k_all[ki].transpose(0, 1),
                                           v_all[ki].transpose(0, 1), attn_mask=seg_mask)
        out[qi] = o.transpose(0, 1)
    mask = _ref_mask(plan, r, window)
    rows = mask.any(1)
    want = torch.zeros_like(q_local)
    if rows.any():
        want[rows] = F.scaled_dot_product_attention(q_local[rows].transpose(0, 1), k_all.transpose(0, 1),
                                                    v_all.transpose(0, 1), attn_mask=mask[rows]).transpose(0, 1)
    assert rows.nonzero().flatten().tolist() == m.q_index.tolist()
    return out, want


@props(60)
@given(cases())
def test_pairs_are_the_document_mask(case):
    plan, window = case
    for r in range(plan.cp_size):
        _check_indices(plan, r, window)


@props(40)
@given(cases())
def test_segments_through_sdpa_equal_the_masked_attention(case):
    plan, window = case
    for r in range(plan.cp_size):
        out, want = _outputs(plan, r, window)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "balanced", "bshd-zigzag", "bshd-contiguous"])
@pytest.mark.parametrize("window", WINDOWS)
def test_pinned_batches(layout, window):
    """Empty and one-token documents, lengths divisible by nothing, a document over several ranks (and
    BSHD rows: each rank's ``(B, M / cp)`` rows flattened)."""
    for lens, cp, tp in [([0, 1, 13, 0, 2], 3, 2), ([29], 4, 1), ([1, 1, 1], 2, 3), ([0], 2, 1)]:
        plan = _plan(lens, cp, tp, layout)
        for r in range(cp):
            _check_indices(plan, r, window)
            out, want = _outputs(plan, r, window)
            torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_a_top_left_mask_is_caught():
    """Breaking the alignment on purpose (flash-attn < 2.1's top-left causal mask) fails the check."""
    plan = _plan([13, 6], 2, 1, "zigzag")
    out, want = _outputs(plan, 1, None, top_left=True)
    assert not torch.allclose(out, want, rtol=0, atol=1e-6)


def test_zigzag_chunks_meeting_on_the_last_rank_are_one_segment():
    plan = _plan([16], 2, 1, "zigzag")  # chunks of 4: rank 1 holds positions 4..11
    m = varlen_metadata(plan, 1)
    assert m.cu_seqlens_q.tolist() == [0, 8] and m.cu_seqlens_k.tolist() == [0, 12]
    assert m.k_index.tolist() == [0, 1, 2, 3, *range(8, 16)]  # positions 0..3 on rank 0, 4..11 on rank 1
    assert m.q_index.tolist() == list(range(8))
    w = varlen_metadata(plan, 0, window=3)  # rank 0: positions 0..3 and 12..15; the second reads 10..15
    assert w.cu_seqlens_k.tolist() == [0, 4, 10] and w.k_index[4:].tolist() == [14, 15, 4, 5, 6, 7]


def test_kept_by_the_plan_and_moved_once():
    plan = _plan([5, 9, 2], 2, 2, "zigzag")
    m = varlen_metadata(plan, 1, window=4)
    assert varlen_metadata(plan, 1, window=4) is m
    assert varlen_metadata(plan, 1, window=4, device="cpu") is m
    assert varlen_metadata(plan, 1, window=4, device="meta").q_index.is_meta
    assert varlen_metadata(plan, 1) is not m


def test_a_rank_without_tokens():
    plan = ShardPlan.build([1], cp_size=4, layout="contiguous")  # rank 0 holds the token, the others pad rows
    m = varlen_metadata(plan, 3)
    assert m.num_segments == 0 and m.q_index.numel() == m.k_index.numel() == 0
    assert m.cu_seqlens_q.tolist() == m.cu_seqlens_k.tolist() == [0] and m.max_seqlen_q == m.max_seqlen_k == 0


@pytest.mark.parametrize("kwargs, kind, words", [
    (dict(cp_rank=2), ValueError, "cp_rank=2"),
    (dict(cp_rank=0, window=0), ValueError, "window=0"),
    (dict(cp_rank=0, window=2.5), TypeError, "window=2.5"),
    (dict(cp_rank=0, window=True), TypeError, "window=True"),
])
def test_bad_arguments(kwargs, kind, words):
    plan = _plan([5, 3], 2, 1, "zigzag")
    with pytest.raises(kind, match=words):
        varlen_metadata(plan, **kwargs)
    with pytest.raises(TypeError, match="plan=list"):
        varlen_metadata([5, 3], 0)
