"""The exchanges of head-parallel ("Ulysses") sequence parallelism, over any group: an all-to-all that
trades a split of one dimension for a split of another (:func:`exchange_dims`), and an all-gather along a
dimension with a stated gradient (:func:`all_gather_dim`). Both ride on the stamped transports of
``distributed/stamp.py``: every message is led by the call's header and checked on arrival, so ranks that
disagree about the call (dimensions, shapes, dtype, plan, whether a backward collective follows) raise
instead of mixing data or leaving a peer waiting in a backward it never makes.

Note [Ulysses exchanges]
~~~~~~~~~~~~~~~~~~~~~~~~
Under Ulysses (DeepSpeed-Ulysses; verl's ``verl/utils/ulysses.py`` follows it) each of ``n`` ranks holds a
consecutive ``1/n`` of the sequence and every head. Before attention, one all-to-all gives each rank the
whole sequence for ``1/n`` of the heads: the local tensor is cut into ``n`` equal pieces along the head
dimension, piece ``j`` goes to group rank ``j``, and the pieces received are laid end to end along the
sequence dimension in group-rank order (the order of the sequence pieces). After attention the inverse
exchange (the two dimensions swapped) restores the sequence split. The inverse is also the backward:
the exchange only moves values, so its adjoint is the exchange that moves them back.

The all-gather comes in three gradients, because callers mean three things by it. Attention's keys and
values (``grad="sum"``): every rank's output reads every rank's rows, so a row's gradient is the sum of
what every rank's backward gives it (summed over the group, each rank keeps its own slice; nanotron's
``DifferentiableAllGather`` pairing). verl's ``Gather`` (``"own"``, and ``"own_scaled"`` for its
``grad_scaler=True``): each rank keeps the slice of its own gradient that matches its rows, unreduced,
optionally times the group size.

Group ranks, not global ranks, index the pieces: the groups of a ring x Ulysses mesh rarely start at
global rank 0. ``group=None`` or a group of one rank returns ``x`` itself and communicates nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cpshard.base.choice import Choice
from cpshard.base.errors import check_tensor, fail
from cpshard.distributed.collectives import backward_follows
from cpshard.distributed.groups import group_size
from cpshard.distributed.stamp import Stamp, all_gather_stamped, all_to_all
from cpshard.distributed.sums import reduce_stamped
from cpshard.plan.values import Plan

__all__ = ["GatherGrad", "all_gather_dim", "exchange_dims"]


class GatherGrad(Choice, argument="grad", what="gradient of the all-gather"):
    """The gradient :func:`all_gather_dim` hands back (Note [Ulysses exchanges])."""

    SUM = "sum"
    OWN = "own"
    OWN_SCALED = "own_scaled"


def _dim(name: str, dim: Any, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -ndim <= dim < ndim:
        fail(name, repr(dim), f"must be a dimension of the {ndim}-d tensor", f"pass an int in [{-ndim}, {ndim})",
             kind=TypeError if not isinstance(dim, int) or isinstance(dim, bool) else ValueError)
    return dim % ndim


def _members(group: Any) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``group``; ``(0, 1)`` for ``None``. No communication."""
    if group is None:
        return 0, 1
    size = group_size(group)
    return dist.get_rank(group), size


def _stamp(op: str, rank: int, plan: Plan | None, call: dict[str, Any]) -> Stamp:
    return Stamp(op, rank, False, () if plan is None else (plan,), call)


def _exchange(x: torch.Tensor, group: Any, size: int, scatter: int, gather: int, stamp: Stamp) -> torch.Tensor:
    pieces = torch.stack(x.chunk(size, dim=scatter))  # (size, *piece): piece j for group rank j
    shape = pieces.shape[1:]
    received = all_to_all(pieces.reshape(size, -1), [1] * size, [1] * size, group, stamp)
    return torch.cat([r.view(shape) for r in received.unbind(0)], dim=gather)


class _Exchange(torch.autograd.Function):
    """:func:`exchange_dims`; backward: the inverse exchange (Note [Ulysses exchanges])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, scatter: int, gather: int,
                stamp: Stamp) -> torch.Tensor:
        ctx.args = group, size, scatter, gather, stamp
        return _exchange(x, group, size, scatter, gather, stamp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        group, size, scatter, gather, stamp = ctx.args
        back = _exchange(grad.contiguous(), group, size, gather, scatter, stamp.backward(f"{stamp.op} backward"))
        return back, None, None, None, None, None


def exchange_dims(x: torch.Tensor, group: Any, *, scatter_dim: int, gather_dim: int,
                  plan: Plan | None = None) -> torch.Tensor:
    """All-to-all over ``group`` (``n`` ranks): ``x`` cut into ``n`` equal pieces along ``scatter_dim``,
    piece ``j`` sent to group rank ``j``; the ``n`` pieces received laid end to end along ``gather_dim``
    in group-rank order. ``x`` has the same shape on every rank; the result's ``scatter_dim`` is ``n``
    times shorter and its ``gather_dim`` ``n`` times longer (Note [Ulysses exchanges]).

    Ulysses' sequence-to-heads exchange of ``(B, S/n, H, D)`` is ``exchange_dims(x, g, scatter_dim=2,
    gather_dim=1)`` -> ``(B, S, H/n, D)``; ``exchange_dims(y, g, scatter_dim=1, gather_dim=2)`` is its
    inverse. Differentiable: the backward is the inverse exchange. ``plan`` (optional) joins the call's
    header, so ranks holding other plans raise. ``group=None`` or one rank: ``x`` itself.

    >>> x = torch.arange(12).view(1, 3, 4)          # one rank: nothing moves
    >>> torch.equal(exchange_dims(x, None, scatter_dim=2, gather_dim=1), x)
    True
    """
    x = check_tensor("x", x)
    scatter, gather = _dim("scatter_dim", scatter_dim, x.dim()), _dim("gather_dim", gather_dim, x.dim())
    rank, size = _members(group)
    if size == 1:
        return x
    if scatter == gather:
        fail("gather_dim", gather_dim, f"is the scatter dimension ({scatter_dim}) too", "pass two different dims")
    if x.shape[scatter] % size:
        fail("x", f"a tensor of shape {tuple(x.shape)}", f"must divide dimension {scatter_dim} "
             f"({x.shape[scatter]}) by the group's {size} ranks", f"pad dimension {scatter_dim} to a multiple of "
             f"{size}, or use a group whose size divides it")
    call = {"dtype": x.dtype, "row shape": tuple(x.shape), "scatter_dim": scatter, "gather_dim": gather,
            "requires_grad": backward_follows(x)}  # its backward is an exchange too: every rank makes it or none
    stamp = _stamp("exchange_dims", rank, plan, call)
    return _Exchange.apply(x.contiguous(), group, size, scatter, gather, stamp)


class _GatherDim(torch.autograd.Function):
    """:func:`all_gather_dim`; backward as its ``grad`` says (Note [Ulysses exchanges])."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int, size: int, dim: int, grad: GatherGrad,
                stamp: Stamp) -> torch.Tensor:
        ctx.args = group, rank, size, dim, grad, stamp
        gathered = all_gather_stamped(x.contiguous(), group, size, stamp)
        return torch.cat(gathered.unbind(0), dim=dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        group, rank, size, dim, grad, stamp = ctx.args
        if grad is GatherGrad.SUM:  # summed in at least float32: gloo reduces half precision poorly
            wide = g.to(torch.promote_types(g.dtype, torch.float32)).contiguous()
            g = reduce_stamped(wide, group, stamp.backward(f"{stamp.op} backward")).to(g.dtype)
        own = g.chunk(size, dim=dim)[rank]
        if grad is GatherGrad.OWN_SCALED:
            own = own * size
        return own, None, None, None, None, None, None


def all_gather_dim(x: torch.Tensor, group: Any, *, dim: int, grad: GatherGrad | str = GatherGrad.SUM,
                   plan: Plan | None = None) -> torch.Tensor:
    """Every group rank's ``x`` laid end to end along ``dim`` in group-rank order (``x`` the same shape
    on every rank): one stamped all-gather.

    The gradient ``x`` gets (Note [Ulysses exchanges]): ``grad="sum"``, the gathered gradient summed
    over the group (one stamped ``all_reduce``), of which this rank keeps its own slice: right when every
    rank's loss reads every rank's rows (attention's keys and values), so that the ranks' gradients add
    up to one process's. ``"own"``: this rank's slice of its own gradient, unreduced; ``"own_scaled"``: the
    same times the group size (verl's ``Gather`` with and without ``grad_scaler``). ``plan`` (optional)
    joins the call's header. ``group=None`` or one rank: ``x`` itself.
    """
    x = check_tensor("x", x)
    d = _dim("dim", dim, max(x.dim(), 1))
    how = GatherGrad.parse(grad)
    rank, size = _members(group)
    if size == 1:
        return x
    call = {"dtype": x.dtype, "row shape": tuple(x.shape), "dim": d, "grad": how.value}
    if how is GatherGrad.SUM:  # its backward all-reduces: every rank makes it or none ("own": a local slice)
        call["requires_grad"] = backward_follows(x)
    stamp = _stamp("all_gather_dim", rank, plan, call)
    return _GatherDim.apply(x.contiguous(), group, rank, size, d, how, stamp)
