"""Moving data by a plan: ``shard`` (with shifts) and its exact inverse ``unshard``. No communication.

Each call is one gather (``index_select``) of the input rows by an index the plan caches per rank,
shift and device, plus ``index_fill_`` of the pad and fill rows; ``unshard`` is one ``cat`` and one
gather of the token rows (the inverse of sharding). Nothing loops over sequences or tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch

from cpshard import _index
from cpshard._dtypes import OPAQUE, bit_pattern, check_fill
from cpshard._errors import check_int, check_rank, fail
from cpshard.bshd import BshdPlan
from cpshard.plan import ShardPlan, _jagged_offsets, jagged_lengths

__all__ = ["as_flat", "shard", "shift", "unshard"]

Plan = Union[ShardPlan, BshdPlan]
Scalar = Union[int, float, bool]
TokenRows = Union[torch.Tensor, Sequence[torch.Tensor]]


def as_flat(x: TokenRows, plan: Plan, name: str = "x") -> torch.Tensor:
    """The batch's token rows concatenated, ``(sum(seqlens), *trailing)``, checked against ``plan``.

    ``x`` may be a jagged nested tensor (its offsets must equal the plan's ``cu_seqlens``: one
    device-to-host copy), a list of ``(n_i, *trailing)`` tensors (one ``cat``), or the flat tensor.
    """
    lens = plan.seqlens_py
    if isinstance(x, torch.Tensor) and x.is_nested:
        offsets = _jagged_offsets(x, name)
        if plan._offsets_known(offsets):
            return x.values()
        got = jagged_lengths(x, name)
        if got != lens:
            fail(name, f"nested tensor with lengths {list(got)}", f"must match the plan's seqlens {list(lens)}",
                 "build the plan from this batch's lengths")
        plan._remember_offsets(x)
        return x.values()
    if isinstance(x, torch.Tensor) and isinstance(plan, BshdPlan):
        fail(name, f"tensor of shape {tuple(x.shape)}", "with a BshdPlan a plain tensor is the padded (B, S, ...) "
             "batch, which this function does not take", "pass the packed rows as a list or a jagged nested tensor")
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 or x.shape[0] != plan.num_tokens:
            fail(name, f"tensor of shape {tuple(x.shape)}",
                 f"a flat tensor must have sum(seqlens) = {plan.num_tokens} rows",
                 "pass the concatenated token rows, a list of per-sequence tensors, or a jagged nested tensor")
        return x
    if isinstance(x, (list, tuple)):
        if len(x) != len(lens):
            fail(name, f"list of {len(x)} tensors", f"must hold the plan's {len(lens)} sequences",
                 "pass one tensor per sequence")
        for i, (t, n) in enumerate(zip(x, lens)):
            if not isinstance(t, torch.Tensor):
                fail(f"{name}[{i}]", type(t).__name__, "must be a torch.Tensor", "pass tensors", kind=TypeError)
            if t.dim() == 0 or t.shape[0] != n:
                fail(f"{name}[{i}]", f"tensor of shape {tuple(t.shape)}", f"must have seqlens[{i}] = {n} rows",
                     "build the plan from this batch's lengths")
            if t.shape[1:] != x[0].shape[1:] or t.dtype != x[0].dtype or t.device != x[0].device:
                fail(f"{name}[{i}]", f"{tuple(t.shape)} {t.dtype} on {t.device}",
                     f"must match {name}[0]'s trailing shape, dtype and device "
                     f"({tuple(x[0].shape[1:])}, {x[0].dtype}, {x[0].device})", "convert the tensors to agree")
        return torch.cat(list(x))
    fail(name, type(x).__name__, "must be a tensor, a jagged nested tensor or a list of tensors",
         "pass the batch's token rows", kind=TypeError)


def _check_shift(value: Any) -> int:
    return check_int("shift", value, minimum=0)


def _gather_rows(rows: torch.Tensor, index: _index.ShardIndex, pad_value: Scalar, fill: Scalar) -> torch.Tensor:
    """One gather of ``rows`` by ``index``, then the pad and fill rows. Values checked by the caller."""
    if rows.dtype in OPAQUE:  # fp8: move the bytes, fill with the values' bit patterns
        out = _gather_rows(rows.view(torch.uint8), index, bit_pattern(pad_value, rows.dtype),
                           bit_pattern(fill, rows.dtype))
        return out.view(rows.dtype)
    src, pad_rows, fill_rows = index.src, index.pad_rows, index.fill_rows
    if rows.shape[0] == 0:  # nothing to read: every output row is a pad row
        out = rows.new_full((src.numel(), *rows.shape[1:]), pad_value)
        if rows.requires_grad:  # keep the (empty) graph, so that backward() still reaches the input
            out = out + rows.sum() * 0
    else:
        out = rows.index_select(0, src)
        if pad_rows.numel():
            out.index_fill_(0, pad_rows, pad_value)
    if fill_rows.numel():
        out.index_fill_(0, fill_rows, fill)
    return out


def shard(x: TokenRows, plan: Plan, rank: int, *, shift: int = 0, pad_value: Scalar = 0,
          fill: Scalar = 0) -> torch.Tensor:
    """Rank ``rank``'s local rows of ``x``, optionally shifted (SPEC.md, "Shifts").

    Args:
        x: the batch's token rows, any dtype and trailing shape: a jagged nested tensor, a list of
            ``(n_i, ...)`` tensors, or the flat ``(sum(seqlens), ...)`` tensor. For a
            :class:`BshdPlan` a plain tensor is the right-padded ``(B, S, ...)`` batch
            (``S >= max(seqlens)``); pass packed rows there as a list or nested tensor.
        plan: a :class:`ShardPlan` (THD) or :class:`BshdPlan` (BSHD).
        rank: the rank's index in its context-parallel group, ``0 <= rank < plan.cp_size``.
        shift: ``k >= 0``; token ``p`` of a sequence receives token ``p + k`` of the same
            sequence, or ``fill`` past its end. ``shift=1`` gives next-token labels; depth ``d`` of
            multi-token prediction uses ``shift=d`` on labels and loss masks. No communication.
        pad_value: the value of pad rows.
        fill: the value of token rows whose shifted source lies past the sequence's end.

    Returns:
        ``(plan.local_len, *trailing)`` for THD, ``(B, plan.local_seq_len, *trailing)`` for BSHD,
        on ``x``'s device. Differentiable with respect to ``x``.

    Example (SPEC.md's worked example)::

        >>> plan = ShardPlan.build([5, 3], cp_size=2)
        >>> shard([torch.arange(5), torch.arange(10, 13)], plan, rank=1)
        tensor([ 2,  3,  4,  0, 11, 12])
        >>> shard([torch.arange(5), torch.arange(10, 13)], plan, rank=1, shift=1, fill=-100)
        tensor([   3,    4, -100,    0,   12, -100])
    """
    if isinstance(plan, BshdPlan):
        return _shard_bshd(x, plan, rank, shift, pad_value, fill)
    if not isinstance(plan, ShardPlan):
        fail("plan", type(plan).__name__, "must be a ShardPlan or BshdPlan", "build one with ShardPlan.build",
             kind=TypeError)
    rank = check_rank(rank, plan.cp_size)
    shift = _check_shift(shift)
    rows = as_flat(x, plan)
    pad_value, fill = check_fill("pad_value", pad_value, rows.dtype), check_fill("fill", fill, rows.dtype)
    return _gather_rows(rows, plan._shard_index(rank, shift, rows.device), pad_value, fill)


def _shard_bshd(x: TokenRows, plan: BshdPlan, rank: int, shift: Any, pad_value: Scalar,
                fill: Scalar) -> torch.Tensor:
    rank = check_rank(rank, plan.cp_size)
    shift = _check_shift(shift)
    if isinstance(x, torch.Tensor) and not x.is_nested:
        b = plan.batch_size
        if x.dim() < 2 or x.shape[0] != b or x.shape[1] < max(plan.seqlens_py):
            fail("x", f"tensor of shape {tuple(x.shape)}",
                 f"a BSHD tensor must be (B={b}, S >= {max(plan.seqlens_py)}, ...), right-padded",
                 "pass the padded batch, or packed token rows as a list or jagged nested tensor")
        stride = x.shape[1]
        rows = x.reshape(b * stride, *x.shape[2:])
    else:
        stride, rows = None, as_flat(x, plan)
    pad_value, fill = check_fill("pad_value", pad_value, rows.dtype), check_fill("fill", fill, rows.dtype)
    out = _gather_rows(rows, plan._shard_index(rank, shift, stride, rows.device), pad_value, fill)
    return out.view(plan.batch_size, plan.local_seq_len, *rows.shape[1:])


def unshard(parts: Sequence[torch.Tensor], plan: Plan) -> torch.Tensor:
    """The per-sequence token rows from every rank's local output: the exact inverse of ``shard``.

    Args:
        parts: ``parts[r]`` is rank ``r``'s output, ``(plan.local_len, *trailing)`` for THD or
            ``(B, plan.local_seq_len, *trailing)`` for BSHD; all of one dtype, trailing shape and
            device.
        plan: the plan the inputs were sharded with.

    Returns:
        A jagged nested tensor ``(B, j, *trailing)`` whose ``values()`` are the token rows in order
        (pad rows dropped) and whose ``offsets()`` are ``cu_seqlens``. Differentiable.
    """
    if not isinstance(plan, (ShardPlan, BshdPlan)):
        fail("plan", type(plan).__name__, "must be a ShardPlan or BshdPlan", "pass the plan used to shard",
             kind=TypeError)
    if isinstance(parts, torch.Tensor) or not isinstance(parts, (list, tuple)):
        fail("parts", type(parts).__name__, "must be a list with one tensor per rank",
             "pass [output of rank 0, ..., output of rank cp_size - 1]", kind=TypeError)
    if len(parts) != plan.cp_size:
        fail("parts", f"list of {len(parts)} tensors", f"must hold one tensor per rank (cp_size={plan.cp_size})",
             "pass every rank's local output, in rank order")
    lead = plan.local_shape
    first = parts[0]
    for r, part in enumerate(parts):
        if not isinstance(part, torch.Tensor):
            fail(f"parts[{r}]", type(part).__name__, "must be a torch.Tensor", "pass tensors", kind=TypeError)
        if tuple(part.shape[:len(lead)]) != lead or part.dim() < len(lead):
            fail(f"parts[{r}]", f"tensor of shape {tuple(part.shape)}",
                 f"must lead with the plan's local_shape = {lead}", "pass each rank's full local output for this plan")
        if part.shape[len(lead):] != first.shape[len(lead):] or part.dtype != first.dtype \
                or part.device != first.device:
            fail(f"parts[{r}]", f"{tuple(part.shape)} {part.dtype} on {part.device}",
                 "must match parts[0]'s trailing shape, dtype and device", "convert the parts to agree")
    if isinstance(plan, BshdPlan):
        trailing = first.shape[2:]
        buf = torch.cat(list(parts), dim=1).reshape(plan.batch_size * plan.seq_len, *trailing)
    else:
        buf = torch.cat(list(parts))
    return rows_to_nested(buf, plan)


def rows_to_nested(buf: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Token rows of a rank-concatenated buffer (``cat`` of every rank's rows) as a jagged tensor."""
    values = buf.index_select(0, plan._unshard_index(buf.device))
    # a copy: the result belongs to the caller, who may edit it; the plan's offsets stay intact
    nt = torch.nested.nested_tensor_from_jagged(values, offsets=plan._offsets(buf.device).clone())
    plan._remember_offsets(nt)
    return nt


def shift(x: TokenRows, plan: Plan, k: int, *, fill: Scalar = 0) -> torch.Tensor:
    """SPEC's ``shift(x, k)`` on unsharded sequences, as a jagged nested tensor.

    Token ``p`` of each sequence receives token ``p + k``, or ``fill`` past the end. Equal to
    ``unshard([shard(x, plan, r, shift=k, fill=fill) for r in range(plan.cp_size)], plan)``.
    """
    k = check_int("k", k, minimum=0)
    rows = as_flat(x, plan)
    fill = check_fill("fill", fill, rows.dtype)

    def make() -> _index.ShardIndex:
        cu = plan._offsets(torch.device("cpu"))
        lens = cu[1:] - cu[:-1]
        whole = _index.Segments(torch.arange(plan.num_seqs), torch.zeros_like(lens), lens, plan.num_tokens)
        return _index.shard_index(whole, lens, cu, k, plan.num_tokens).to(rows.device)

    values = _gather_rows(rows, plan._memo(("shift", k, rows.device), make), 0, fill)
    nt = torch.nested.nested_tensor_from_jagged(values, offsets=plan._offsets(rows.device).clone())
    plan._remember_offsets(nt)
    return nt
