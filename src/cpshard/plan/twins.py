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

Every rank can compute every rank's part of the permutation, so sender and receiver agree without
a metadata message, and the split sizes are Python ints (no device-to-host copy). Between THD twins
a rank computes only its own slices, from closed forms (``cpshard/index/closed.py``: where each of its
canonical rows lives under the other twin, and how many rows change rank over the group); BSHD twins
build the whole permutation. The reverse route (dst to src) is the backward of a relayout.

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

import math
from collections.abc import Sequence
from typing import Any

import torch

from cpshard.base.dtypes import carrier
from cpshard.base.errors import check_rank, check_tensor, fail
from cpshard.base.layout import Layout, TwinOrder
from cpshard.index.route import Route
from cpshard.index.shift import all_to_all_in_process
from cpshard.plan.values import Plan, check_plan_type

__all__ = ["Route", "apply_route", "check_twins", "relayout_route", "twin", "twin_plan"]


# -- twins --------------------------------------------------------------------------------------


def _check_plan(plan: Any, name: str) -> Plan:
    check_plan_type(plan, name=name)
    return plan


def twin(plan: Plan, layout: Layout | str | None = None, order: TwinOrder | str = TwinOrder.SAME) -> Plan:
    """``plan``'s twin: the same sequences and padded lengths under ``layout`` and ``order``
    (:meth:`~cpshard.plan.Plan.twin`, which each plan kind answers for itself).

    Note [Twin plans and their route]. ``layout``: the twin's layout (default: ``plan``'s).
    ``order`` (THD plans): ``"same"`` keeps ``plan``'s buffer order, ``"caller"`` lays the
    sequences out in the caller's order, ``"balanced"`` in the order ``ShardPlan.build(...,
    reorder="balanced")`` would choose for these padded lengths (contiguous layout only).

    >>> from cpshard import ShardPlan
    >>> zz = ShardPlan.build([5, 3], cp_size=2)
    >>> twin(zz, "contiguous").padded_seqlens_py, twin(zz, "contiguous").layout.value
    ((8, 4), 'contiguous')
    >>> twin(twin(zz, "contiguous"), "zigzag") == zz
    True
    """
    return _check_plan(plan, "plan").twin(layout, order)


def twin_plan(plan: Plan, layout: Layout | str | None = None, order: TwinOrder | str = TwinOrder.SAME) -> Plan:
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
    if src.input_padded_seqlens_py != dst.input_padded_seqlens_py:
        fail("dst_plan", repr(dst), "must pad every sequence as src_plan does (twins share one padded buffer)",
             "build one plan with zigzag's padding and take the other from cpshard.twin_plan(plan, layout)")
    return src, dst


# -- the route between twins ---------------------------------------------------------------------


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
    for r, t in enumerate(flats[1:], start=1):  # the all-to-all moves one dtype and row shape
        if t.dtype != flats[0].dtype or t.shape[1:] != flats[0].shape[1:]:
            fail(f"locals_[{r}]", f"a {locals_[r].dtype} tensor of shape {tuple(locals_[r].shape)}",
                 f"must have locals_[0]'s dtype and trailing shape ({locals_[0].dtype}, {tuple(flats[0].shape[1:])})",
                 "pass every rank's rows of one tensor", kind=TypeError)
    routes = [relayout_route(src, dst, r, flats[r].device) for r in range(src.cp_size)]
    received = all_to_all_in_process(flats, [rt.send_rows for rt in routes], [rt.send_splits for rt in routes])
    out = []
    for r, (flat, rt) in enumerate(zip(flats, routes)):
        moved = rt.apply(flat, received[r])
        if moved.dtype != locals_[r].dtype:  # a carried dtype (view(dtype) would leave the autograd graph)
            moved = moved.view(locals_[r].dtype)
        out.append(moved.view(*dst.local_shape, *locals_[r].shape[len(src.local_shape):]))
    return out
