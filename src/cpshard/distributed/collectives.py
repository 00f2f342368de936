"""Across context-parallel ranks: gather outputs, shift sharded tensors, change layout, gather the rows
and states the reference computations share.

The data collectives of cpshard (``cpshard.spawn`` starts the processes; the sums are in
``distributed/sums.py``, the checks before every call in ``distributed/checks.py``, the agreement
protocol's rules, pure, in ``distributed/agree.py``). Every function takes the CP process
group as its third argument, with no default: in a real job the world is DP x CP x TP, and a
same-size wrong group would mix replicas' data without an error (pass
``torch.distributed.group.WORLD`` where the whole job is one CP group). A Megatron CP sub-group or a
per-micro-batch dynamic group of ``local_cp_size`` ranks works the same way. The caller's CP rank is
its rank in the group. Every check (group membership and size, row counts, argument values) runs
before the first collective. Without checks, a check that fails on one rank only raises there while
the others wait in their collective; ``check=True`` costs one small extra collective that shares
every rank's verdict and plan fingerprint first, so that bad input on any rank, or ranks that built
different plans, raise on every rank and nothing hangs. ``check=None`` (the default) follows the
process-wide switch: ``cpshard.distributed.set_checks``, or the environment variable ``CPSHARD_CHECK=1``.

Checks on or off, every all-gather and all-to-all carries a 64-byte header that identifies the call
(plan, dtype, row shape, shifts and fills, check setting), compared on arrival, and every
``all_reduce`` a trailer with the same call's digest folded into the reduction: ranks that disagree
raise instead of returning a wrong result (Notes [Call headers] and [Stamped reductions] in
``distributed/header.py``; what every rank sees: docs/guarantees.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from cpshard.base.dtypes import carrier, check_fill, movable
from cpshard.base.errors import check_real, check_tensor, fail
from cpshard.base.types import Group, Scalar
from cpshard.distributed.checks import check_local, checked_call, plan_fingerprint
from cpshard.distributed.groups import solo
from cpshard.distributed.stamp import Stamp, all_gather_stamped, all_to_all
from cpshard.distributed.sums import reduce_stamped
from cpshard.index import halo as _halo
from cpshard.index.shift import ShiftExchange
from cpshard.ops.sharding import as_nested, pad_and_fill, token_rows
from cpshard.plan.args import check_shift
from cpshard.plan.twins import check_twins, relayout_route
from cpshard.plan.values import Plan

__all__ = ["all_gather_rows", "all_gather_rows_for", "backward_follows", "gather", "gather_states",
           "gather_states_for", "gather_tokens", "joined", "relayout", "shift_sharded", "shift_sharded_multi",
           "shift_sharded_multi_for"]


class _AllGatherOwnGrad(torch.autograd.Function):
    """All-gather along dim 0 into ``(size, rows, ...)``; the gradient is the caller's own slice, not
    reduced (the header is no data: only the rows' view takes part)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, rank: int, size: int, stamp: Stamp) -> torch.Tensor:
        ctx.rank = rank
        return all_gather_stamped(local.contiguous(), group, size, stamp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad[ctx.rank], None, None, None, None


def _gathered_buffer(local: torch.Tensor, plan: Plan, group: Any,
                     check: bool | None) -> torch.Tensor | list[torch.Tensor]:
    """Every rank's flattened local rows ``(R, ...)`` in rank order, views of the received buffer
    (whose headers lie between the ranks' rows), or the rows themselves at ``cp = 1`` with no group:
    what ``token_rows`` reads."""
    def validate() -> tuple[torch.Tensor, dict[str, Any]]:
        checked = check_local(local, plan)
        return checked, {"dtype": checked.dtype, "row shape": tuple(checked.shape[len(plan.local_shape):])}

    local, rank, call, checked = checked_call(plan, group, check, validate, "gather")
    flat = local.reshape(math.prod(plan.local_shape), *local.shape[len(plan.local_shape):])
    if solo(plan, group):
        return flat
    stamp = Stamp("gather", rank, checked, (plan,), call)
    return list(_AllGatherOwnGrad.apply(flat, group, rank, plan.cp_size, stamp).unbind(0))


def gather(local: torch.Tensor, plan: Plan, group: Any, *, check: bool | None = None) -> torch.Tensor:
    """Every rank's local outputs, restored per sequence, on every rank: ``unshard`` across processes.

    Args:
        local: this rank's output, ``plan.local_shape + trailing``: ``(L, ...)`` (THD) or
            ``(B, M / cp, ...)`` (BSHD): log-probs ``(L,)``, entropy, values, hidden rows ``(L, h)``,
            any dtype.
        plan: the plan every rank of ``group`` sharded this micro-batch with.
        group: the context-parallel process group (required); its size must be ``plan.cp_size``
            and this process's rank in it is its CP rank.
        check: first share every rank's input verdict and plan fingerprint (one small extra
            collective, as :func:`check_plan`), so that bad input on any rank raises on all;
            ``None`` follows :func:`set_checks`.

    Returns:
        A jagged nested tensor ``(B, j, ...)``, equal on every rank to ``unshard`` of all ranks'
        ``local``. One all-gather (``all_gather_single``), then one copy of the token rows (runs
        of them under the contiguous layout, one ``index_select`` otherwise).

    Autograd:
        The gradient reaches the calling rank's own ``local`` rows exactly once, from the positions
        they occupy in the result; the other ranks' rows are constants on this rank (their
        gradients are not sent back). If every rank computes the same loss from the gathered
        result, each rank's local gradient equals that of the single-process computation; sum
        ``local``-gradients across ranks yourself only if each rank computed a different part.
    """
    return as_nested(token_rows(_gathered_buffer(local, plan, group, check), plan), plan)


def gather_tokens(local: torch.Tensor, plan: Plan, group: Any, *, check: bool | None = None) -> torch.Tensor:
    """Like :func:`gather`, as one flat ``(num_tokens, ...)`` tensor (the nested result's ``values()``).

    For callers that reduce over tokens and need no per-sequence view. Same autograd contract.
    """
    return token_rows(_gathered_buffer(local, plan, group, check), plan)


class _ShiftSharded(torch.autograd.Function):
    """Forward: local gather + one all-to-all of boundary rows. Backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ex: ShiftExchange, group: Any, pad_value: Scalar,
                fill: Scalar, stamp: Stamp) -> torch.Tensor:
        ctx.ex, ctx.group, ctx.stamp = ex, group, stamp
        recv = None
        if ex.total_remote:
            recv = all_to_all(local.index_select(0, ex.send_rows), ex.recv_splits, ex.send_splits, group, stamp)
        return ex.apply(local, recv, pad_value, fill)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ex = ctx.ex
        kept = grad.clone()
        for rows in (ex.pad_rows, ex.fill_rows, ex.recv_rows):
            if rows.numel():
                kept.index_fill_(0, rows, 0)
        grad_local = torch.zeros_like(grad).index_add_(0, ex.source, kept)
        if ex.total_remote:
            back = all_to_all(grad.index_select(0, ex.recv_rows), ex.send_splits, ex.recv_splits, ctx.group,
                               ctx.stamp.backward("shift_sharded backward"))
            grad_local.index_add_(0, ex.send_rows, back)
        return grad_local, None, None, None, None, None


def shift_sharded(local: torch.Tensor, plan: Plan, group: Any, *, shift: int = 1, pad_value: Scalar | None = None,
                  fill: Scalar = 0, check: bool | None = None) -> torch.Tensor:
    """Shift a tensor that exists only sharded: exactly ``shard(shift(x, k), plan, cp_rank)``.

    For labels and loss masks that Megatron's multi-token prediction rolls after sharding, and (``k <
    0``) the look-back of a causal convolution. Works for every layout, THD and BSHD plans, and every
    ``k``, with one ``all_to_all_single`` per call
    whatever the batch size, moving only rows whose shifted source lives on another rank (under
    zigzag, about ``k`` rows per sequence and chunk boundary; see Note [Sharded shift exchange] in
    ``index/shift.py``). With ``cp_size == 1``, or when no row crosses ranks, there is no collective.

    Args:
        local: this rank's rows, ``plan.local_shape + trailing``, any dtype (bool travels as uint8).
        plan: the plan shared by every rank of ``group``.
        group: the context-parallel group (required); its size must be ``plan.cp_size``.
        shift: ``k``: row ``p`` receives position ``p + k`` of its sequence (``k < 0`` looks back).
        pad_value: value of pad rows; default ``fill`` when ``k != 0`` (as :func:`cpshard.shard`).
        fill: value of token rows whose source ``p + k`` lies outside the sequence.
        check: as in :func:`gather`.

    Autograd: differentiable; the gradient of a row flows back to the rank and row it was read
    from (a second all-to-all in backward). Pad and fill rows pass no gradient.
    """
    def validate() -> tuple[tuple[torch.Tensor, int, Any, Any], dict[str, Any]]:
        checked = check_local(local, plan)
        k = check_shift(shift)
        pad, fil = pad_and_fill(pad_value, fill, k, checked.dtype)
        call = {"dtype": checked.dtype, "row shape": tuple(checked.shape[len(plan.local_shape):]), "shift": k,
                "pad_value": pad, "fill": fil, "requires_grad": backward_follows(checked)}
        return (checked, k, pad, fil), call

    (local, k, pad, fil), rank, call, checked = checked_call(plan, group, check, validate, "shift_sharded")
    ex = plan.indices().shift_exchange(rank, k, local.device)
    stamp = Stamp("shift_sharded", rank, checked, (plan,), call)
    lead = len(plan.local_shape)
    flat = local.reshape(math.prod(plan.local_shape), *local.shape[lead:])
    moved = movable(flat, pad, fil)
    if moved is not None:  # fp8 / uintN rows move as their carrier; nothing to differentiate
        carried, pad_bits, fill_bits = moved
        out = _ShiftSharded.apply(carried, ex, group, pad_bits, fill_bits, stamp).view(local.dtype)
    else:
        out = _ShiftSharded.apply(flat, ex, group, pad, fil, stamp)
    return out.view(local.shape)


def shift_sharded_multi(tensors: Sequence[torch.Tensor], plan: Plan, group: Any, *, shifts: Sequence[int],
                        pad_values: Sequence[Scalar | None] | None = None, fills: Sequence[Scalar] | None = None,
                        check: bool | None = None) -> list[torch.Tensor]:
    """Shift several sharded tensors by several shifts with one collective: ``shard(shift(x, k))`` for each.

    For the labels and loss mask of every multi-token-prediction depth. Each segment's *halo* (the
    ``max(shifts)`` positions after it) is exchanged once for all tensors and shifts, in one
    ``all_to_all_single`` of the tensors' rows packed side by side as bytes; see Note [Halo exchange
    for several shifts] in ``index/halo.py``. No collective when no halo row lies on another rank.

    Args:
        tensors: this rank's rows, each ``plan.local_shape + trailing`` (``(L,)`` THD, ``(B, M /
            cp)`` BSHD), any dtypes and trailing shapes.
        plan: the plan shared by every rank of ``group``.
        group: the context-parallel group (required); its size must be ``plan.cp_size``.
        shifts: the shifts ``k`` (negative ones look back: the halo before each segment travels in
            the same collective).
        pad_values: per tensor, the value of pad rows (``None``: as :func:`cpshard.shard`, ``fill``
            for a shifted entry and 0 for an unshifted one, ``k = 0``); default all ``None``.
        fills: per tensor, the value of token rows shifted past the sequence's end; default 0.
        check: as in :func:`gather`.

    Returns:
        Per tensor, ``(len(shifts), *local_shape, *trailing)``: entry ``s`` is the tensor shifted by
        ``shifts[s]``, whose pad rows hold its pad value. No gradient flows (labels and
        masks); the inputs are read detached.
    """
    return shift_sharded_multi_for(tensors, plan, group, {}, shifts=shifts, pad_values=pad_values, fills=fills,
                                   check=check)


def shift_sharded_multi_for(tensors: Sequence[torch.Tensor], plan: Plan, group: Any, args: dict[str, Any], *,
                            shifts: Sequence[int], pad_values: Sequence[Scalar | None] | None = None,
                            fills: Sequence[Scalar] | None = None, check: bool | None = None) -> list[torch.Tensor]:
    """:func:`shift_sharded_multi` for a call of layer 5 (``cpshard.mtp``) whose own arguments ``args``
    (name -> value) every rank must pass alike: they join the agreement's digest (checks on) and the
    exchange's header (checks off), as the shifts and fills do (docs/guarantees.md)."""
    def validate() -> tuple[tuple[list[torch.Tensor], tuple[int, ...], list[Any], list[Any]], dict[str, Any]]:
        checked = [check_local(t, plan) for t in tensors]
        pads = list(pad_values) if pad_values is not None else [None] * len(checked)
        fils = list(fills) if fills is not None else [0] * len(checked)
        if not checked or len(pads) != len(checked) or len(fils) != len(checked):
            fail("tensors", f"{len(checked)} tensors, {len(pads)} pad_values and {len(fils)} fills",
                 "must be at least one tensor, with one pad value and one fill each", "pass matching lists")
        ks = tuple(check_shift(k, "shifts") for k in shifts)
        if not ks:
            fail("shifts", list(shifts), "must hold at least one shift", "pass e.g. shifts=[1, 2]")
        fils = [check_fill("fills", v, t.dtype) for v, t in zip(fils, checked)]
        # per tensor, one pad value per shift: SPEC's default is fill for a shifted entry, 0 for k = 0
        pads = [tuple(check_fill("pad_values", v, t.dtype) if v is not None else f if k else
                      check_fill("pad_values", 0, t.dtype) for k in ks) for v, f, t in zip(pads, fils, checked)]
        call = {"dtypes": [t.dtype for t in checked],
                "row shapes": [tuple(t.shape[len(plan.local_shape):]) for t in checked],
                "shifts": ks, "pad_values": pads, "fills": fils, **args}
        return (checked, ks, pads, fils), call

    (checked, ks, pads, fils), rank, call, ran_check = checked_call(plan, group, check, validate,
                                                                    "shift_sharded_multi")
    lead = len(plan.local_shape)
    rows = [t.detach().reshape(-1, *t.shape[lead:]) for t in checked]
    ms = plan.indices().halo(rank, ks, rows[0].device)
    received: list[torch.Tensor | None] = [None] * len(rows)
    if ms.total_remote:
        packed = _halo.pack_rows(rows)
        stamp = Stamp("shift_sharded_multi", rank, ran_check, (plan,), call)
        recv = all_to_all(packed.index_select(0, ms.send_rows), ms.recv_splits, ms.send_splits, group, stamp)
        received = list(_halo.unpack_rows(recv, rows))
    return [ms.apply(r, got, pad, fil).view(len(ks), *t.shape)
            for r, got, pad, fil, t in zip(rows, received, pads, fils, checked)]


class _GatherRowsSumGrad(torch.autograd.Function):
    """All-gather along dim 0 (``all_gather_single``); backward: the gathered gradient summed over the
    group (``all_reduce``, stamped: Note [Stamped reductions]), of which the caller keeps its own rows.
    The pairing of nanotron's ``DifferentiableAllGather`` / ``DifferentiableReduceScatterSum``;
    ``all_reduce`` because gloo has no reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, rank: int, size: int, stamp: Stamp) -> torch.Tensor:
        local = local.contiguous()
        ctx.rows, ctx.rank, ctx.group, ctx.stamp = local.shape[0], rank, group, stamp
        # the ranks' rows out of the headed buffer: one copy, as the result is (size * rows, ...)
        return all_gather_stamped(local, group, size, stamp).reshape(size * local.shape[0], *local.shape[1:])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # summed in at least float32: gloo reduces half precision poorly or not at all
        wide = grad.to(torch.promote_types(grad.dtype, torch.float32)).contiguous()
        wide = reduce_stamped(wide, ctx.group, ctx.stamp.backward(f"{ctx.stamp.op} backward"))
        own = wide[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]
        return own.to(grad.dtype), None, None, None, None


def all_gather_rows(rows: torch.Tensor, plan: Plan, group: Group, *, check: bool | None = None) -> torch.Tensor:
    """Every rank's ``rows`` ``(R, ...)``, concatenated in rank order: ``(cp * R, ...)``, for a
    computation in which every rank's rows serve every rank (the reference attention's keys and
    values). Backward: the gathered gradient is summed over the group and each rank keeps its own
    rows, so that when the ranks' losses add up to the batch's, every gradient equals ``cp = 1``'s.
    ``rows`` as they are at ``cp = 1`` with no group. ``check``: as in :func:`gather`.

    That backward is a collective: every rank's loss must depend on the result (:func:`joined`
    attaches it where a rank's output reads none of it), or the ranks that skip it leave the others
    waiting."""
    return _gather_rows(rows, plan, group, "all_gather_rows", check, {})


def all_gather_rows_for(rows: torch.Tensor, plan: Plan, group: Group, args: dict[str, Any], *,
                        check: bool | None = None) -> torch.Tensor:
    """:func:`all_gather_rows` for a call of layer 5 (the reference attention) whose own arguments
    ``args`` (name -> value: the score scale, the kernel's belief) every rank must pass alike: they join
    the agreement's digest (checks on), the gather's header and its backward's trailer (checks off)."""
    return _gather_rows(rows, plan, group, "all_gather_rows", check, args)


def _gather_rows(rows: torch.Tensor, plan: Plan, group: Group, op: str, check: bool | None,
                 args: dict[str, Any]) -> torch.Tensor:
    """``rows`` ``(R, ...)`` of every rank (``op="gather_states"``: ``rows`` is one rank's states,
    gathered as one row), checked inside the agreement (checks on): a rank that refuses its input
    makes every rank raise instead of leaving them waiting in the gather."""
    name = "rows" if op == "all_gather_rows" else "states"

    def validate() -> tuple[torch.Tensor, dict[str, Any]]:
        checked = check_real(name, check_tensor(name, rows))
        if checked.is_nested or (op == "all_gather_rows" and checked.dim() == 0):
            fail(name, f"a {'nested' if checked.is_nested else '0-d'} tensor", "must be a dense tensor of rows "
                 "(one shape on every rank)", f"pass {name} as one strided tensor")
        checked = checked.unsqueeze(0) if op == "gather_states" else checked
        return checked, {"dtype": checked.dtype, "row shape": tuple(checked.shape[1:]),
                         "requires_grad": backward_follows(checked), **args}

    rows, rank, call, ran_check = checked_call(plan, group, check, validate, op)
    if solo(plan, group):
        return rows
    stamp = Stamp(op, rank, ran_check, (plan,), call)
    return _GatherRowsSumGrad.apply(rows, group, rank, plan.cp_size, stamp)


class _Joined(torch.autograd.Function):
    """``out`` itself, made to depend on ``gathered``: a zero gradient flows to it, so that the
    gathered tensor's backward collective runs on this rank too."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype, ctx.device = gathered.shape, gathered.dtype, gathered.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)


def joined(out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """``out`` (a view of it), made to depend on ``gathered`` (the result of :func:`all_gather_rows` or
    :func:`gather_states`) with a zero gradient: so that the gather's backward ``all_reduce`` runs on
    every rank, also where ``out`` reads none of ``gathered`` (a rank whose rows are all pad rows, a
    scan rank with no carry), instead of the others waiting in it. Nothing is attached where no
    gradient can flow."""
    if not (torch.is_grad_enabled() and gathered.requires_grad):
        return out
    return _Joined.apply(out, gathered)


def backward_follows(*tensors: torch.Tensor) -> bool:
    """Whether autograd records a call on ``tensors`` (grad mode on, one of them requiring a gradient): then
    its backward collective follows, which every rank must make alike. Agreed on (checks on) and carried by
    the forward's header (checks off) as ``requires_grad``, so that a rank whose tensors require no gradient
    (or that runs under ``torch.no_grad()``) while its peers' do raises with them in forward, instead of
    returning while they wait in the backward collective it never makes."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _run_relayout(flat: torch.Tensor, route: Any, group: Any, stamp: Stamp) -> torch.Tensor:
    """``flat``'s rows moved by ``route`` (``cpshard.plan.twins.Route``): one all-to-all, or none when no
    row of the group changes rank."""
    received = None
    if route.total_remote:
        received = all_to_all(flat.index_select(0, route.send_rows), route.recv_splits, route.send_splits, group,
                               stamp)
    return route.apply(flat, received)


class _Relayout(torch.autograd.Function):
    """Forward: the route from src to dst. Backward: the reverse route (dst to src), one all-to-all."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, forward_route: Any, backward_route: Any, group: Any,
                stamp: Stamp) -> torch.Tensor:
        ctx.route, ctx.group, ctx.stamp = backward_route, group, stamp
        return _run_relayout(flat.contiguous(), forward_route, group, stamp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        stamp = ctx.stamp.backward("relayout backward")
        return _run_relayout(grad.contiguous(), ctx.route, ctx.group, stamp), None, None, None, None


def relayout(local: torch.Tensor, src_plan: Plan, dst_plan: Plan, group: Any, *,
             check: bool | None = None) -> torch.Tensor:
    """This rank's rows under ``dst_plan`` from its rows under ``src_plan``, its twin: exactly
    ``shard(x, dst_plan, cp_rank)`` when ``local == shard(x, src_plan, cp_rank)``.

    For hybrid models whose attention layers run on a zigzag plan and whose linear-attention or
    state-space layers run on its contiguous twin (``cpshard.twin_plan(plan, "contiguous")``; SPEC.md,
    "Changing layout inside a model"). One ``all_to_all_single`` per call that moves only the rows
    whose rank changes; rows that stay are copied locally; no collective at all when no row of the
    group changes rank (``cp_size == 1``, equal plans). Every rank derives the route from the two
    plans (Note [Twin plans and their route] in ``plan/twins.py``): no metadata message, split sizes
    as Python ints, so no host sync on CUDA (the route's indices are copied to the device once per
    plan pair, rank and device).

    Args:
        local: this rank's rows, ``src_plan.local_shape + trailing``, any dtype (bytes on the wire).
        src_plan: the plan ``local`` is sharded with.
        dst_plan: its twin (same sequences, same padded lengths; another layout or order).
        group: the context-parallel group (required); its size must be ``src_plan.cp_size``.
        check: as in :func:`gather` (the agreement covers both plans).

    Returns:
        ``dst_plan.local_shape + trailing``, ``local``'s dtype.

    Autograd: differentiable; the gradient is the reverse relayout of the output's gradient (one
    more all-to-all in backward), so every row's gradient returns to the rank and row it came from.
    """
    def validate() -> tuple[tuple[torch.Tensor, Plan], dict[str, Any]]:
        _, dst = check_twins(src_plan, dst_plan)
        checked = check_local(local, src_plan)
        return (checked, dst), {"dtype": checked.dtype, "row shape": tuple(checked.shape[len(src_plan.local_shape):]),
                                "dst_plan": plan_fingerprint(dst).tolist(), "requires_grad": backward_follows(checked)}

    (checked, dst), rank, call, ran_check = checked_call(src_plan, group, check, validate, "relayout")
    lead = len(src_plan.local_shape)
    trailing = checked.shape[lead:]
    flat = checked.reshape(math.prod(src_plan.local_shape), *trailing)
    over = carrier(flat.dtype)
    if over is not None:  # fp8 / uintN move as their same-width carrier (no index_select there)
        flat = flat.view(over)
    device = flat.device
    forward_route = relayout_route(src_plan, dst, rank, device)
    backward_route = relayout_route(dst, src_plan, rank, device)
    stamp = Stamp("relayout", rank, ran_check, (src_plan, dst), call)
    out = _Relayout.apply(flat, forward_route, backward_route, group, stamp)
    if over is not None:  # only then: view(dtype), even to the same dtype, leaves the autograd graph
        out = out.view(checked.dtype)
    return out.view(*dst.local_shape, *trailing)


def gather_states(states: torch.Tensor, plan: Plan, group: Any, *, check: bool | None = None) -> torch.Tensor:
    """``(cp, *states.shape)``: every rank's ``states`` (one shape and dtype on every rank), in rank order.

    What a recurrence needs from the ranks before it: each rank's segment end states and decay
    products (``cpshard.scan``), or the last rows a causal convolution looks back at. One
    ``all_gather_single``; the group's size must be ``plan.cp_size``.

    Autograd: every rank's result feeds every rank's later computation, so the gradient of a rank's
    ``states`` is the sum over the group of the gradients of its slice (one ``all_reduce`` in
    backward): if the ranks' losses add up to the batch's, it is the single-process gradient. That
    backward is a collective: every rank's loss must depend on its result (a rank that reads no
    carry attaches it anyway with :func:`joined`, as ``cpshard.scan`` does), or the ranks that skip
    it leave the others waiting. ``check``: as in :func:`gather` (the agreement covers the dtype and
    shape: a rank whose states differ raises with the others, before the gather).
    """
    return gather_states_for(states, plan, group, {}, check=check)


def gather_states_for(states: torch.Tensor, plan: Plan, group: Any, args: dict[str, Any], *,
                      check: bool | None = None) -> torch.Tensor:
    """:func:`gather_states` for a call of layer 5 (the scan) whose own arguments ``args`` every rank
    must pass alike: as :func:`all_gather_rows_for`. ``states`` is checked inside the agreement."""
    gathered = _gather_rows(states, plan, group, "gather_states", check, args)
    return gathered.reshape(plan.cp_size, *gathered.shape[1:])
