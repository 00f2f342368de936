"""Twin plans and the route between them: pure index math for changing layout inside a model.

No communication here (``cpshard.distributed.relayout`` runs a route across ranks).

Note [Twin plans and their route]
---------------------------------
Two plans are **twins** when they describe the same sequences with the same padded lengths (in the
caller's order) under different layouts or buffer orders (SPEC.md, "Changing layout inside a
model"). Every row of one is then a row of the other: the row of caller's sequence ``i`` at padded
position ``p``. Give that row its **canonical index** ``C = cu_padded_caller[i] + p``, its offset
in the padded buffer laid out in the caller's order (for a plan without a reorder, ``C`` is
``plan.global_rows(r)``'s value; for a BSHD plan, ``b * M + column``). Over every rank, a plan's
local rows list each canonical index once, so for two twins

    tgt[s * R + j] = d * R + l      (src rank s's local row j is dst rank d's local row l)

is a permutation of ``cp * R`` rows (``R = prod(local_shape)``), built in a few vectorized passes:
the dst plan's canonical indices inverted, then read at the src plan's. A rank's **route** is its
slice of ``tgt`` and of its inverse:

- rows whose rank does not change are copied locally (``keep_src -> keep_dst``);
- rows for rank ``d != r`` are sent grouped by ``d`` and, inside a group, in ``d``'s local order
  (``send_rows``, ``send_splits``);
- rows from rank ``s != r`` arrive grouped by ``s``, each group in this rank's local order, which is
  the order ``s`` sent them in (``recv_rows``, ``recv_splits``).

Every rank computes every rank's part of the permutation, so sender and receiver agree without a
metadata message, and the split sizes are Python ints (no device-to-host copy). The reverse route
(dst to src) is the backward of a relayout.

Padding valid for both layouts: zigzag's (``2 * cp * tp`` per sequence, or ``2 * cp`` under
minimal padding) serves contiguous too. A contiguous plan has a zigzag twin only if every padded
length divides by ``2 * cp`` (SPEC.md's zigzag invariant); otherwise :func:`twin` says which padding
to build with.

Example, lengths ``[5, 3]``, ``cp = 2`` (zigzag ``P = [8, 4]``, ``L = 6``) and its contiguous twin::

    zigzag     rank 0: g 0 1 6 7 8 11     rank 1: g 2 3 4 5 9 10
    contiguous rank 0: g 0 1 2 3 4 5      rank 1: g 6 7 8 9 10 11

    route zigzag -> contiguous, rank 0: keep rows 0 1 (to 0 1); send rows 2 3 4 5 (g 6 7 8 11)
    to rank 1; receive g 2 3 4 5 from rank 1 into rows 2 3 4 5.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cpshard._dtypes import carrier
from cpshard._errors import check_rank, check_tensor, fail
from cpshard._exchange import all_to_all_in_process
from cpshard._index import to_device
from cpshard.bshd import BshdPlan, bshd_alignment
from cpshard.layout import Layout, Padding, alignment, fp8_alignment, fp8_total_alignment
from cpshard.plan import Plan, ShardPlan, check_plan_type

__all__ = ["Route", "apply_route", "check_twins", "relayout_route", "twin", "twin_plan"]

_ORDERS = ("same", "caller", "balanced")


# -- twins --------------------------------------------------------------------------------------


def _check_plan(plan: Any, name: str) -> Plan:
    try:
        check_plan_type(plan)
    except TypeError as exc:  # in the caller's words
        raise TypeError(str(exc).replace("plan=", f"{name}=", 1)) from None
    return plan


def twin(plan: Plan, layout: Layout | str | None = None, order: str = "same") -> Plan:
    """``plan``'s twin: the same sequences and padded lengths under ``layout`` and ``order``.

    Note [Twin plans and their route]. ``layout``: the twin's layout (default: ``plan``'s).
    ``order`` (THD plans): ``"same"`` keeps ``plan``'s buffer order, ``"caller"`` lays the
    sequences out in the caller's order, ``"balanced"`` in the order ``ShardPlan.build(...,
    reorder="balanced")`` would choose for these padded lengths (contiguous layout only).

    The twin keeps ``plan``'s ``cp_size``, ``tp_size``, ``fp8`` and padding mode; its ``alignment``
    is the one its layout derives when every padded length divides by it (so a twin's twin is the
    plan again), else, for a zigzag twin of a contiguous plan whose lengths all divide by ``2 * cp``,
    minimal padding's ``2 * cp``. Where no twin exists (a zigzag twin needs every padded length to
    divide by ``2 * cp``) the error names the padding to build with.

    >>> zz = ShardPlan.build([5, 3], cp_size=2)
    >>> twin(zz, "contiguous").padded_seqlens_py, twin(zz, "contiguous").layout.value
    ((8, 4), 'contiguous')
    >>> twin(twin(zz, "contiguous"), "zigzag") == zz
    True
    """
    plan = _check_plan(plan, "plan")
    target = plan.layout if layout is None else Layout.parse(layout)
    if order not in _ORDERS:
        fail("order", repr(order), f"must be one of {', '.join(map(repr, _ORDERS))}",
             "pass order='same' (keep the buffer order), 'caller' or 'balanced'")
    if isinstance(plan, BshdPlan):
        if order != "same":
            fail("order", repr(order), "applies to packed (THD) plans only: a BSHD batch has no buffer order",
                 "drop order")
        return _bshd_twin(plan, target)
    assert isinstance(plan, ShardPlan)
    return _thd_twin(plan, target, order)


def _thd_twin(plan: ShardPlan, target: Layout, order: str) -> ShardPlan:
    cp, tp = plan.cp_size, plan.tp_size
    lens, padded = plan.input_seqlens_py, plan.input_padded_seqlens_py
    if order == "same":
        new_order = plan.order
    elif order == "caller":
        new_order = None
    else:
        if target is not Layout.CONTIGUOUS:
            fail("order", "'balanced'", f"balances the contiguous layout (zigzag is balanced by its chunks; "
                 f"layout={target.value!r})", "pass layout='contiguous', or order='same'")
        from cpshard._balance import balanced_order
        new_order = tuple(balanced_order(lens, padded, cp)) if cp > 1 else None
    if target is Layout.ZIGZAG and cp > 1:
        bad = [i for i, p in enumerate(padded) if p % (2 * cp)]
        if bad:
            i = bad[0]
            fail("plan", f"a {plan.layout.value} plan whose sequence {i} is padded to {padded[i]}",
                 f"a zigzag twin needs every padded length to divide by 2 * cp_size = {2 * cp} ({len(bad)} do "
                 "not)", "build the plan with layout='zigzag' (its padding, 2 * cp * tp per sequence or "
                 "2 * cp with padding='minimal', serves both layouts) and take its contiguous twin")
    if plan.fp8:
        base = alignment(cp, tp, target)
        if sum(padded) % fp8_total_alignment(base):
            fail("plan", f"an fp8 plan of {sum(padded)} padded rows", f"an fp8 {target.value} twin needs the "
                 f"total to divide by {fp8_total_alignment(base)}", "build the fp8 plan with layout='zigzag' "
                 "and take its contiguous twin")
    unit = alignment(cp, tp, target, plan.padding)
    unit = fp8_alignment(unit) if plan.fp8 else unit
    padding = plan.padding
    if any(p % unit for p in padded):  # contiguous padding too small for zigzag's aligned unit: minimal's
        padding = Padding.MINIMAL
        unit = alignment(cp, tp, target, padding)
        unit = fp8_alignment(unit) if plan.fp8 else unit
        if any(p % unit for p in padded):
            unit = 2 * cp  # fp8's lcm(16, 2 cp) does not divide: 2 cp still keeps zigzag's invariant
    buffer_lens, buffer_padded = lens, padded
    if new_order is not None:
        buffer_lens = tuple(lens[i] for i in new_order)
        buffer_padded = tuple(padded[i] for i in new_order)
    return ShardPlan(buffer_lens, buffer_padded, cp, tp, target, plan.fp8, unit, padding, new_order)


def _bshd_twin(plan: BshdPlan, target: Layout) -> BshdPlan:
    cp, m = plan.cp_size, plan.max_seqlen
    if target is Layout.ZIGZAG and cp > 1 and m % (2 * cp):
        fail("plan", f"a {plan.layout.value} BSHD plan padded to {m} columns", f"a zigzag twin needs the padded "
             f"length to divide by 2 * cp_size = {2 * cp}", "build the plan with layout='zigzag' (its padding "
             "serves both layouts) and take its contiguous twin")
    unit = bshd_alignment(plan.num_seqs, cp, plan.tp_size, target, plan.fp8)
    return dataclasses.replace(plan, layout=target, alignment=unit if m % unit == 0 else math.gcd(unit, m))


def twin_plan(plan: Plan, layout: Layout | str | None = None, order: str = "same") -> Plan:
    """Public name of :func:`twin` (``cpshard.twin_plan``)."""
    return twin(plan, layout, order)


def check_twins(src: Any, dst: Any) -> tuple[Plan, Plan]:
    """``(src, dst)`` if they are twins (Note [Twin plans and their route]); else a clear error."""
    src, dst = _check_plan(src, "src_plan"), _check_plan(dst, "dst_plan")
    if type(src) is not type(dst):
        fail("dst_plan", type(dst).__name__, f"must be the same kind of plan as src_plan ({type(src).__name__})",
             "take dst_plan from cpshard.twin_plan(src_plan, layout)", kind=TypeError)
    for name in ("cp_size", "tp_size"):
        if getattr(src, name) != getattr(dst, name):
            fail("dst_plan", f"a plan with {name}={getattr(dst, name)}", f"must have src_plan's {name}="
                 f"{getattr(src, name)} (twins share the batch and the group)",
                 "take dst_plan from cpshard.twin_plan(src_plan, layout)")
    if src.input_seqlens_py != dst.input_seqlens_py:
        fail("dst_plan", f"a plan of {dst.num_seqs} sequences, {dst.num_tokens} tokens", "must describe "
             f"src_plan's sequences ({src.num_seqs} sequences, {src.num_tokens} tokens) in the caller's order",
             "take dst_plan from cpshard.twin_plan(src_plan, layout)")
    same = (src.max_seqlen == dst.max_seqlen if isinstance(src, BshdPlan)
            else src.input_padded_seqlens_py == dst.input_padded_seqlens_py)
    if not same:
        fail("dst_plan", repr(dst), "must pad every sequence as src_plan does (twins share one padded buffer)",
             "build one plan with zigzag's padding and take the other from cpshard.twin_plan(plan, layout)")
    return src, dst


# -- the route ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """One rank's part of moving its local rows from ``src`` to ``dst`` (Note [Twin plans and their
    route]). Rows are the rank's flattened local rows, ``R = prod(local_shape)`` of them.

    Attributes:
        send_rows: ``(sum(send_splits),)`` int64 src-local rows to send, grouped by destination rank.
        send_splits: rows sent to each rank (``cp`` ints; 0 for this rank).
        recv_rows: ``(sum(recv_splits),)`` int64 dst-local rows the received rows land on, in arrival order.
        recv_splits: rows received from each rank.
        keep_src: ``(K,)`` int64 src-local rows that stay on this rank ...
        keep_dst: ``(K,)`` ... and the dst-local rows they land on.
        rows: ``R``.
        total_remote: rows changing rank over the whole group (0: no rank communicates).
    """

    send_rows: torch.Tensor
    send_splits: tuple[int, ...]
    recv_rows: torch.Tensor
    recv_splits: tuple[int, ...]
    keep_src: torch.Tensor
    keep_dst: torch.Tensor
    rows: int
    total_remote: int

    def to(self, device: torch.device) -> Route:
        move = functools.partial(to_device, device=device)
        return Route(move(self.send_rows), self.send_splits, move(self.recv_rows), self.recv_splits,
                     move(self.keep_src), move(self.keep_dst), self.rows, self.total_remote)

    def apply(self, local: torch.Tensor, received: torch.Tensor | None) -> torch.Tensor:
        """``(R, ...)``: ``local`` ``(R, ...)``'s rows moved by the route, with ``received`` (the rows
        other ranks sent, in arrival order; None when nothing arrives) placed on ``recv_rows``."""
        out = local.new_empty(local.shape)
        if self.keep_src.numel():
            out.index_copy_(0, self.keep_dst, local.index_select(0, self.keep_src))
        if received is not None and received.shape[0]:
            out.index_copy_(0, self.recv_rows, received)
        return out


def canonical_rows(plan: Plan, cp_rank: int) -> np.ndarray:
    """``(R,)`` int64: each of ``cp_rank``'s flattened local rows as its row of the padded buffer laid
    out in the caller's order (Note [Twin plans and their route])."""
    if isinstance(plan, BshdPlan):
        seq = plan.sequence_ids(cp_rank).reshape(-1).numpy()
        return seq * plan.max_seqlen + plan.position_ids(cp_rank).reshape(-1).numpy()
    assert isinstance(plan, ShardPlan)
    rows = plan.indices().view("rows", cp_rank)
    if plan.order is None:
        return rows
    # buffer sequence j (caller's order[j]) moves from cu_padded[j] to the caller's cu_padded[order[j]]
    caller_cu = np.concatenate([[0], np.cumsum(np.array(plan.input_padded_seqlens_py, dtype=np.int64))])
    buffer_cu = np.array(plan.cu_seqlens_padded_py[:-1], dtype=np.int64)
    delta = caller_cu[np.array(plan.order, dtype=np.int64)] - buffer_cu
    return rows + delta[plan.indices().view("seq", cp_rank)]


def permutation(src: Plan, dst: Plan) -> tuple[np.ndarray, np.ndarray, int]:
    """``(tgt, inv, total_remote)``: ``tgt[s * R + j] = d * R + l`` and its inverse, over every rank."""
    cp, rows = src.cp_size, math.prod(src.local_shape)
    canon_src = np.concatenate([canonical_rows(src, r) for r in range(cp)])
    canon_dst = np.concatenate([canonical_rows(dst, r) for r in range(cp)])
    where = np.empty_like(canon_dst)
    where[canon_dst] = np.arange(canon_dst.size, dtype=np.int64)
    tgt = where[canon_src]
    inv = np.empty_like(tgt)
    inv[tgt] = np.arange(tgt.size, dtype=np.int64)
    rank_of = np.repeat(np.arange(cp, dtype=np.int64), rows)
    total_remote = int(np.count_nonzero(tgt // max(rows, 1) != rank_of))
    return tgt, inv, total_remote


def build_route(src: Plan, dst: Plan, cp_rank: int) -> Route:
    """``cp_rank``'s route on the CPU (``src.indices().relayout`` keeps it and the permutation)."""
    cp, rows = src.cp_size, math.prod(src.local_shape)
    tgt, inv, total_remote = src.indices().permutation(dst)
    r, span = cp_rank, max(rows, 1)
    mine = tgt[r * rows:(r + 1) * rows]
    to_rank = mine // span
    remote = to_rank != r
    out_idx = np.flatnonzero(remote)
    send_rows = out_idx[np.argsort(mine[out_idx], kind="stable")]  # by (dst rank, dst row)
    keep_src = np.flatnonzero(~remote)
    keep_dst = mine[keep_src] - r * rows
    origin = inv[r * rows:(r + 1) * rows] // span
    incoming = np.flatnonzero(origin != r)  # dst rows, ascending
    recv_rows = incoming[np.argsort(origin[incoming], kind="stable")]  # by (src rank, dst row)
    as_t = torch.from_numpy
    return Route(as_t(send_rows), tuple(np.bincount(to_rank[out_idx], minlength=cp).tolist()),
                 as_t(recv_rows), tuple(np.bincount(origin[incoming], minlength=cp).tolist()),
                 as_t(keep_src), as_t(np.ascontiguousarray(keep_dst)), rows, total_remote)


def relayout_route(src_plan: Plan, dst_plan: Plan, cp_rank: int, device: torch.device | str | None = None) -> Route:
    """``cp_rank``'s :class:`Route` from ``src_plan``'s rows to its twin ``dst_plan``'s.

    Pure index math, the same on every rank (Note [Twin plans and their route]): call it for every
    rank in one process to see or test a whole relayout. Cached per (plans, rank, device). CPU unless
    ``device``.
    """
    src, dst = check_twins(src_plan, dst_plan)
    cp_rank = check_rank(cp_rank, src.cp_size)
    return src.indices().relayout(dst, cp_rank, torch.device("cpu") if device is None else torch.device(device))


def _flat(local: torch.Tensor, plan: Plan, name: str) -> torch.Tensor:
    local = check_tensor(name, local)
    lead = plan.local_shape
    if local.dim() < len(lead) or tuple(local.shape[:len(lead)]) != lead:
        fail(name, f"tensor of shape {tuple(local.shape)}", f"must lead with the plan's local_shape = {lead}",
             "pass this rank's whole local tensor for src_plan (pad rows included)")
    flat = local.reshape(math.prod(lead), *local.shape[len(lead):])
    over = carrier(flat.dtype)
    return flat.view(over) if over is not None else flat


def apply_route(locals_: Sequence[torch.Tensor], src_plan: Plan, dst_plan: Plan) -> list[torch.Tensor]:
    """Every rank's rows under ``dst_plan`` from every rank's rows under ``src_plan``, in one process.

    ``locals_[r]`` is rank ``r``'s ``src_plan.local_shape + trailing`` tensor; returns the
    ``dst_plan.local_shape + trailing`` tensors. Runs each rank's :func:`relayout_route` with the
    all-to-all simulated (rank ``s``'s send buffer cut by its ``send_splits``, piece ``d`` to rank
    ``d``), so that ``apply_route([shard(x, src, r) ...], src, dst)[r] == shard(x, dst, r)``.
    """
    src, dst = check_twins(src_plan, dst_plan)
    if len(locals_) != src.cp_size:
        fail("locals_", f"{len(locals_)} tensors", f"must hold one tensor per rank ({src.cp_size})",
             "pass every rank's local tensor, rank 0 first")
    flats = [_flat(t, src, f"locals_[{r}]") for r, t in enumerate(locals_)]
    routes = [relayout_route(src, dst, r, flats[r].device) for r in range(src.cp_size)]
    received = all_to_all_in_process(flats, [rt.send_rows for rt in routes], [rt.send_splits for rt in routes])
    out = []
    for r, (flat, rt) in enumerate(zip(flats, routes)):
        moved = rt.apply(flat, received[r])
        if moved.dtype != locals_[r].dtype:  # a carried dtype (view(dtype) would leave the autograd graph)
            moved = moved.view(locals_[r].dtype)
        out.append(moved.view(*dst.local_shape, *locals_[r].shape[len(src.local_shape):]))
    return out
