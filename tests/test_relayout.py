"""Twin plans and relayout: the pure route for every rank in one process (hypothesis), then across
real gloo ranks (cpshard.distributed.relayout: exact, differentiable, one collective per call)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from cpshard import BshdPlan, ShardPlan, TwinOrder, shard, twin_plan
from cpshard.index.closed import thd_moved, thd_rows
from cpshard.index.route import build_route, permutation
from cpshard.plan.twins import apply_route, relayout_route, twin
from cpshard.spawn import CollectiveCounter
from rank_suites import run_suite
from strategies import props

ALL_TO_ALL = "alltoall_base"


def _x(lens, trailing=(), dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    if dtype.is_floating_point:
        return torch.randn(n, *trailing, generator=g, dtype=torch.float64).to(dtype)
    return torch.arange(n * max(1, int(torch.tensor(trailing).prod()) if trailing else 1)).view(n, *trailing).to(dtype)


@st.composite
def _pairs(draw):
    cp = draw(st.integers(1, 8))
    tp = draw(st.integers(1, 4))
    padding = draw(st.sampled_from(["aligned", "minimal", "none"]))
    lens = draw(st.lists(st.sampled_from([0, 1, 2, 2 * cp - 1, 2 * cp, 2 * cp + 1]) | st.integers(0, 40),
                         min_size=1, max_size=9))
    src_layout = draw(st.sampled_from(["zigzag", "contiguous"]))
    reorder = "balanced" if src_layout == "contiguous" and draw(st.booleans()) else None
    src = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=src_layout, padding=padding, reorder=reorder)
    if src_layout == "zigzag":
        dst = twin(src, "contiguous", draw(st.sampled_from(["same", "balanced"])))
    else:
        choice = draw(st.sampled_from(["zigzag", "caller", "balanced"]))
        if choice == "zigzag":
            if any(p % (2 * cp) for p in src.padded_seqlens_py) and cp > 1 and padding != "none":
                with pytest.raises(ValueError, match="2 \\* cp_size"):
                    twin(src, "zigzag", "caller")
                dst = twin(src, "contiguous", "caller")
            else:
                dst = twin(src, "zigzag", "caller")
        else:
            dst = twin(src, "contiguous", choice)
    return lens, src, dst


@props(150)
@given(_pairs())
def test_route_composed_with_shard_is_shard_under_the_twin(case):
    lens, src, dst = case
    x = _x(lens, (2,))
    got = apply_route([shard(x, src, r) for r in range(src.cp_size)], src, dst)
    back = apply_route(got, dst, src)
    moved = 0
    for r in range(src.cp_size):
        assert torch.equal(got[r], shard(x, dst, r))
        assert torch.equal(back[r], shard(x, src, r))
        route = relayout_route(src, dst, r)
        moved += route.send_rows.numel()
        # rows that stay are copied; the others are sent once, and what s sends r is what r expects from s
        assert route.keep_src.numel() + route.send_rows.numel() == src.local_len
        assert route.keep_dst.numel() + route.recv_rows.numel() == src.local_len
        for s in range(src.cp_size):
            assert relayout_route(src, dst, s).send_splits[r] == route.recv_splits[s]
        assert route.send_splits[r] == route.recv_splits[r] == 0
    assert moved == relayout_route(src, dst, 0).total_remote  # only rows whose rank changes travel


@props(120)
@given(_pairs())
def test_one_ranks_route_from_closed_forms_equals_the_every_rank_permutation(case):
    """A THD rank's route reads only its own canonical rows under both twins (``plan.closed``): field
    for field the route the permutation over every rank's rows gives, and ``total_remote`` is the
    naive count of rows whose rank changes."""
    _, src, dst = case
    cp, rows = src.cp_size, src.local_len
    canon_src = [src.indices().canonical(r) for r in range(cp)]
    canon_dst = [dst.indices().canonical(r) for r in range(cp)]
    moved = sum(len(set(canon_src[r].tolist()) - set(canon_dst[r].tolist())) for r in range(cp))
    every = permutation(np.concatenate(canon_src), np.concatenate(canon_dst), cp, rows)
    assert moved == every[2]
    closed = not (src.indices().unequal_chunks() or dst.indices().unequal_chunks())  # else the permutation
    if closed:
        assert thd_moved(src, dst) == thd_moved(dst, src) == moved
    for r in range(cp):
        if closed:
            assert thd_rows(src, canon_src[r]).tolist() == list(range(r * rows, (r + 1) * rows))
        got, want = relayout_route(src, dst, r), build_route(*every, cp, rows, r)
        for field in dataclasses.fields(want):
            a, b = getattr(got, field.name), getattr(want, field.name)
            assert (torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b), field.name


def test_worked_example_and_twin_of_twin():
    zz = ShardPlan.build([5, 3], cp_size=2)
    cont = twin_plan(zz, "contiguous")
    assert cont.padded_seqlens_py == (8, 4) and cont.layout.value == "contiguous" and twin(cont, "zigzag") == zz
    r0 = relayout_route(zz, cont, 0)
    assert r0.keep_src.tolist() == [0, 1] and r0.send_rows.tolist() == [2, 3, 4, 5] and r0.send_splits == (0, 4)
    assert r0.recv_rows.tolist() == [2, 3, 4, 5] and r0.total_remote == 8
    assert relayout_route(zz, zz, 1).total_remote == 0  # equal plans: nothing moves
    one = ShardPlan.build([5, 3], cp_size=1)
    assert relayout_route(one, twin(one, "contiguous"), 0).total_remote == 0


def test_bshd_twins():
    plan = BshdPlan.build([5, 3, 7], cp_size=2, tp_size=2)
    cont = twin(plan, "contiguous")
    x = torch.arange(3 * plan.max_seqlen * 2).view(3, plan.max_seqlen, 2)
    got = apply_route([shard(x, plan, r) for r in range(2)], plan, cont)
    for r in range(2):
        assert torch.equal(got[r], shard(x, cont, r))
    assert twin(cont, "zigzag") == plan
    odd = BshdPlan.build([7], cp_size=3, layout="contiguous")  # M = 9
    with pytest.raises(ValueError, match="divide by 2 \\* cp_size = 6"):
        twin(odd, "zigzag")


def test_twin_errors_teach():
    cont = ShardPlan.build([5, 3], cp_size=2, layout="contiguous")  # P = [6, 4]: 6 % 4 != 0
    with pytest.raises(ValueError, match="zigzag twin needs every padded length to divide by 2 \\* cp_size = 4.*"
                       "Fix: build the plan with layout='zigzag'"):
        twin(cont, "zigzag")
    zz = ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(ValueError, match="balances the contiguous layout"):
        twin(zz, "zigzag", "balanced")
    with pytest.raises(ValueError, match="order='sorted': is not a twin order .valid: 'same', 'caller', 'balanced'"):
        twin(zz, "contiguous", "sorted")
    assert twin(zz, "contiguous", TwinOrder.CALLER) == twin(zz, "contiguous", "caller")
    with pytest.raises(ValueError, match="must pad every sequence as src_plan does"):
        relayout_route(zz, cont, 0)
    with pytest.raises(ValueError, match="must describe src_plan's sequences"):
        relayout_route(zz, twin(ShardPlan.build([3, 5], cp_size=2), "contiguous"), 0)
    with pytest.raises(ValueError, match="cp_size"):
        relayout_route(zz, ShardPlan.build([5, 3], cp_size=4), 0)
    with pytest.raises(TypeError, match="same kind of plan"):
        relayout_route(zz, BshdPlan.build([5, 3], cp_size=2), 0)
    with pytest.raises(ValueError, match="local_shape"):
        apply_route([torch.zeros(5), torch.zeros(5)], zz, twin(zz, "contiguous"))


def test_odd_dtypes_move_as_bytes():
    zz = ShardPlan.build([9, 4, 1], cp_size=2, padding="minimal")
    cont = twin(zz, "contiguous", "balanced")
    for dtype in [torch.bool, torch.bfloat16, torch.uint16, torch.float8_e4m3fn, torch.complex64]:
        x = torch.randint(0, 2, (14, 3)).to(dtype) if dtype in (torch.bool, torch.uint16) else \
            torch.randn(14, 3).to(dtype)
        got = apply_route([shard(x, zz, r) for r in range(2)], zz, cont)
        for r in range(2):
            want = shard(x, cont, r)
            assert got[r].dtype == dtype and torch.equal(got[r].view(torch.uint8), want.view(torch.uint8))


# -- across gloo ranks -------------------------------------------------------------------------


def _gloo_batches(cp):
    return [[0, 1, 3 * 2 * cp + 1, 0, 2 * cp - 1, 5, 40], [1], [700, 5, 333]]


def _relayout_cases(rank, world):
    """relayout == shard under the twin, both ways, every dtype; exactly one all-to-all (none when no
    row changes rank); gradients are the reverse relayout (what cp = 1 gives)."""
    from cpshard.distributed import relayout
    group = dist.group.WORLD
    seen = []
    for i, lens in enumerate(_gloo_batches(world)):
        for tp, padding in ((1, "aligned"), (2, "minimal")):
            zz = ShardPlan.build(lens, cp_size=world, tp_size=tp, padding=padding)
            for dst in (twin(zz, "contiguous"), twin(zz, "contiguous", "balanced")):
                for dtype, trailing in ((torch.float64, (3,)), (torch.int64, ()), (torch.bool, (2,)),
                                        (torch.bfloat16, ()), (torch.float8_e5m2, (2,))):
                    x = (torch.randn(sum(lens), *trailing, generator=torch.Generator().manual_seed(i))
                         .to(dtype))
                    for a, b in ((zz, dst), (dst, zz)):
                        with CollectiveCounter() as comm:
                            got = relayout(shard(x, a, rank), a, b, group)
                        assert comm.calls == [ALL_TO_ALL], comm.calls
                        assert got.dtype == dtype and torch.equal(got.view(torch.uint8),
                                                                  shard(x, b, rank).view(torch.uint8))
                        seen.append((i, tp, dtype, a.layout.value))
                # gradient: d/dlocal sum(relayout(local) * w_dst) = w_src exactly (as at cp = 1: d/dx sum(x w) = w)
                x = torch.randn(sum(lens), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
                w = torch.randn(sum(lens), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
                local = shard(x, zz, rank).requires_grad_()
                with CollectiveCounter() as comm:
                    out = relayout(local, zz, dst, group)
                    (out * shard(w, dst, rank)).sum().backward()
                assert comm.calls == [ALL_TO_ALL, ALL_TO_ALL], comm.calls
                assert torch.equal(local.grad, shard(w, zz, rank))
                back = relayout(relayout(shard(x, zz, rank), zz, dst, group), dst, zz, group)
                assert torch.equal(back, shard(x, zz, rank))
    zz = ShardPlan.build([5, 3], cp_size=world)
    with CollectiveCounter() as comm:  # equal plans: no row changes rank, no collective
        same = relayout(shard(torch.arange(8), zz, rank), zz, zz, group)
    assert comm.calls == [] and torch.equal(same, shard(torch.arange(8), zz, rank))
    errors = []
    with CollectiveCounter() as comm:  # bad input raises before any collective
        for bad in (lambda: relayout(torch.zeros(3), zz, twin(zz, "contiguous"), group),
                    lambda: relayout(shard(torch.arange(8), zz, rank), zz, ShardPlan.build([5, 3], cp_size=world,
                                                                                       layout="contiguous"), group)):
            try:
                bad()
            except ValueError as exc:
                errors.append(str(exc).split(":")[0])
    assert comm.calls == [] and errors[0] == "local=tensor of shape (3,)" and errors[1].startswith("dst_plan=")
    return len(seen)


@functools.cache
def _suites(world):
    return run_suite(__name__, ("_relayout_cases",), world, timeout=400, collective_timeout=60)


@pytest.mark.parametrize("world", [2, 4])
def test_relayout_across_gloo_ranks(world):
    want = 3 * 2 * 2 * 5 * 2
    assert [r["_relayout_cases"] for r in _suites(world)] == [want] * world


# -- Megatron-LM dev's cp_partition_route ------------------------------------------------------


@dataclasses.dataclass
class _ThdCpRoute:  # the stand-in for megatron.core.context_parallel_layout.ThdCpRoute (dev)
    zigzag_index: torch.Tensor | None
    zigzag_split_sizes: list
    contiguous_index: torch.Tensor | None
    contiguous_split_sizes: list


def _megatron_convert(locals_, routes, source):
    """What Megatron's THD conversion does with the routes, every rank in one process: send
    x[source_index] cut by source splits, receive by target splits, scatter to target_index."""
    other = "contiguous" if source == "zigzag" else "zigzag"
    pieces = [list((x if getattr(rt, f"{source}_index") is None else x[getattr(rt, f"{source}_index")])
                   .split(getattr(rt, f"{source}_split_sizes"))) for x, rt in zip(locals_, routes)]
    out = []
    for r, rt in enumerate(routes):
        recv = torch.cat([pieces[s][r] for s in range(len(routes))])
        assert recv.shape[0] == sum(getattr(rt, f"{other}_split_sizes"))
        index = getattr(rt, f"{other}_index")
        out.append(recv if index is None else recv.new_empty(recv.shape).index_copy_(0, index, recv))
    return out


@pytest.mark.parametrize("lens,cp,tp,padding", [([5, 3], 2, 1, "aligned"), ([0, 1, 17, 40, 3], 4, 2, "minimal"),
                                                 ([100], 3, 1, "aligned"), ([7, 7], 1, 1, "aligned")])
def test_megatron_cp_partition_route_converts_both_ways(lens, cp, tp, padding):
    from cpshard.megatron.route import cp_partition_route
    zz = ShardPlan.build(lens, cp_size=cp, tp_size=tp, padding=padding)
    cont = twin(zz, "contiguous")
    x = _x(lens, (2,))
    for plan in (zz, cont):  # either side builds the same route
        routes = [cp_partition_route(plan, r, route_type=_ThdCpRoute) for r in range(cp)]
        got = _megatron_convert([shard(x, zz, r) for r in range(cp)], routes, "zigzag")
        back = _megatron_convert([shard(x, cont, r) for r in range(cp)], routes, "contiguous")
        for r in range(cp):
            assert torch.equal(got[r], shard(x, cont, r)) and torch.equal(back[r], shard(x, zz, r))
    reordered = ShardPlan.build([3, 40, 1, 9], cp_size=2, layout="contiguous", reorder="balanced")
    assert reordered.order is not None
    with pytest.raises(ValueError, match="without reorder='balanced'"):
        cp_partition_route(reordered, 0, route_type=_ThdCpRoute)


def test_packed_seq_params_prebuilds_dev_s_route(monkeypatch):
    """Where PackedSeqParams has dev's cp_partition_route, packed_seq_params(cp_rank=) fills it with the
    plan's route (here: a stand-in class and Megatron's route type stood in too)."""
    import dataclasses as dc

    import cpshard.megatron.packed as packed
    import cpshard.megatron.route as route

    @dc.dataclass
    class DevParams:
        qkv_format: str = "thd"
        cu_seqlens_q: object = None
        cu_seqlens_kv: object = None
        cu_seqlens_q_padded: object = None
        cu_seqlens_kv_padded: object = None
        max_seqlen_q: object = None
        max_seqlen_kv: object = None
        cp_partition_mode: object = None
        cp_partition_route: object = None

    monkeypatch.setattr(packed, "packed_seq_params_class", lambda: DevParams)
    monkeypatch.setattr(route, "route_class", lambda: _ThdCpRoute)
    plan = ShardPlan.build([5, 3, 9], cp_size=2)
    psp = packed.packed_seq_params(plan, cp_rank=1)
    want = route.cp_partition_route(plan, 1, route_type=_ThdCpRoute)
    got = psp.cp_partition_route
    assert isinstance(got, _ThdCpRoute) and got.zigzag_split_sizes == want.zigzag_split_sizes
    assert packed.packed_seq_params(plan).cp_partition_route is None  # no rank given: nothing prebuilt


def test_apply_route_names_a_rank_of_another_dtype_or_row_shape():
    """A raw RuntimeError of index_copy_ before."""
    plan = ShardPlan.build([5, 3], cp_size=2)
    dst = twin_plan(plan, "contiguous")
    x = torch.arange(8.0)
    with pytest.raises(TypeError, match=r"^locals_\[1\]=a torch.float64 tensor of shape \(6,\): must have "
                                        r"locals_\[0\]'s dtype and trailing shape \(torch.float32, \(\)\)"):
        apply_route([shard(x, plan, 0), shard(x, plan, 1).double()], plan, dst)
    with pytest.raises(TypeError, match=r"^locals_\[1\]=.*trailing shape"):
        apply_route([shard(x, plan, 0), shard(x[:, None].repeat(1, 2), plan, 1)], plan, dst)
