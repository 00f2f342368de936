"""Moving data by a plan: ``shard`` (with shifts) and its exact inverse ``unshard``. No communication.

Each call is one gather (``index_select``) of the input rows by an index the plan caches per rank
(every shift reads it from a shifted view of the input), plus ``index_fill_`` of the pad and fill
rows; rows of 1, 2, 4 or 8 bytes move as one integer each (:func:`as_packed`). ``unshard`` copies
the token rows back in order: by runs where the plan's segments are long (the contiguous layout,
``PlanIndices.runs``), else one ``cat`` and one gather by an index. THD and BSHD plans take the same
path (a BSHD rank's ``(B, M / cp)`` block is its flattened rows). No Python loop over tokens; the
only loop over sequences is the run copy, whose pieces average at least 512 rows.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import torch

from cpshard.base.dtypes import check_fill, movable
from cpshard.base.errors import check_rank, check_tensor, fail, parse_choice
from cpshard.base.types import Scalar, TokenRows
from cpshard.index import segments as _index
from cpshard.plan.args import check_shift, jagged, jagged_lengths
from cpshard.plan.indices import ROWS_PER_RUN
from cpshard.plan.values import Plan, check_plan_type

__all__ = ["shard", "shift", "unshard"]


def as_flat(x: TokenRows, plan: Plan, name: str = "x") -> torch.Tensor:
    """The batch's token rows concatenated, ``(sum(seqlens), *trailing)``, checked against ``plan``.

    ``x`` may be a jagged nested tensor (its offsets are checked against the plan's: one
    device-to-host copy; shard ``ShardPlan.from_nested``'s values to avoid it), a list of
    ``(n_i, *trailing)`` tensors (one ``cat``), or the flat tensor.
    """
    lens = plan.input_seqlens_py
    if isinstance(x, torch.Tensor):
        check_tensor(name, x)
    if isinstance(x, torch.Tensor) and x.is_nested:
        got = jagged_lengths(x, name)
        if got != lens:
            fail(name, f"nested tensor with lengths {list(got)}", f"must match the plan's seqlens {list(lens)}",
                 "build the plan from this batch's lengths")
        return x.values()
    if isinstance(x, torch.Tensor):
        plan.padded_rows(x, name, allowed=False)  # a BshdPlan reads a plain tensor as the padded batch: an error
        if x.dim() == 0 or x.shape[0] != plan.num_tokens:
            padded = ("; a padded (B, S) batch is turned into packed rows by cpshard.from_padded(x, attention_mask)"
                      if x.dim() >= 2 and x.shape[0] == plan.num_seqs else "")
            fail(name, f"tensor of shape {tuple(x.shape)}",
                 f"a flat tensor must have sum(seqlens) = {plan.num_tokens} rows",
                 "pass the concatenated token rows, a list of per-sequence tensors, or a jagged nested tensor" + padded)
        return x
    if isinstance(x, (list, tuple)):
        if len(x) != len(lens):
            fail(name, f"list of {len(x)} tensors", f"must hold the plan's {len(lens)} sequences",
                 "pass one tensor per sequence")
        for i, (t, n) in enumerate(zip(x, lens)):
            check_tensor(f"{name}[{i}]", t)
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


def pad_and_fill(pad_value: Any, fill: Any, shift: int, dtype: torch.dtype) -> tuple[Scalar, Scalar]:
    """SPEC's pad and fill values, checked against ``dtype``: pad rows default to ``fill`` when shifted.

    A shifted tensor is labels or a loss mask, whose pad rows must not train: ``fill`` (an ignore
    index, or False) is the safe value there. Unshifted rows pad with 0 unless told otherwise.
    """
    fill = check_fill("fill", fill, dtype)
    if pad_value is None:
        return (fill if shift else check_fill("pad_value", 0, dtype)), fill
    return check_fill("pad_value", pad_value, dtype), fill


def gather_rows(rows: torch.Tensor, index: _index.ShardIndex, pad_value: Scalar, fill: Scalar) -> torch.Tensor:
    """One gather of ``rows`` by ``index``, then the pad and fill rows. Values checked by the caller."""
    moved = movable(rows, pad_value, fill)
    if moved is not None:  # fp8, uintN: move the bits, fill with the values' bit patterns
        carried, pad_bits, fill_bits = moved
        return gather_rows(carried, index, pad_bits, fill_bits).view(rows.dtype)
    src, pad_rows, fill_rows, k = index.source, index.pad_rows, index.fill_rows, index.shift
    n = rows.shape[0]
    if n <= k or (k and index.safe == ()):  # nothing to read: every output row is a pad or fill row
        out = rows.new_full((src.numel(), *rows.shape[1:]), pad_value)
        if rows.requires_grad:  # keep the (empty) graph, so that backward() still reaches the input
            out = out + rows.sum() * 0
    else:
        view = rows.narrow(0, k, n - k) if k else rows  # row src[j] of the view is input row src[j] + k
        if index.safe is None:
            out = select_rows(view, src)
        elif rows.requires_grad:  # index_select(out=) records no autograd: a shifted index instead
            out = rows.index_select(0, (src + k).clamp_max_(n - 1))
        else:
            out = rows.new_empty((src.numel(), *rows.shape[1:]))
            packed, packed_out = as_packed(view), as_packed(out)
            if packed is None or packed_out is None:
                packed, packed_out = view, out
            for lo, hi in index.safe:  # the other rows are fill or pad rows, written below
                torch.index_select(packed, 0, src[lo:hi], out=packed_out[lo:hi])
        if pad_rows.numel():
            out.index_fill_(0, pad_rows, pad_value)
    if fill_rows.numel():
        out.index_fill_(0, fill_rows, fill)
    return out


_PACKED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_packed(rows: torch.Tensor) -> torch.Tensor | None:
    """``rows`` as a 1-D view of one integer per row, when a row is 1, 2, 4 or 8 contiguous bytes of a
    CPU tensor that records no autograd; else None.

    CPU ``index_select`` is fastest on 1-D integer rows: by an int32 index, float32, bfloat16 and
    bool rows take about 1.4x as long as the same bytes as int32, int16 and uint8, and ``(N, 1)``
    rows about 4x as long as ``(N,)`` (torch 2.13; ``benchmarks/step.py``). Moving bytes never
    looks at values, so the result is bit-for-bit the same.
    """
    if rows.device.type != "cpu" or rows.requires_grad or rows.is_complex() or not rows.is_contiguous():
        return None
    per_row = math.prod(rows.shape[1:])
    carrier = _PACKED.get(rows.element_size() * per_row)
    if carrier is None or rows.storage_offset() % per_row:
        return None
    if rows.dim() == 1 and rows.dtype == carrier:
        return rows
    return rows.view(rows.shape[0], per_row).view(carrier).view(rows.shape[0])


def select_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows.index_select(0, index)``, through :func:`as_packed` where it applies."""
    packed = as_packed(rows)
    if packed is None:
        return rows.index_select(0, index)
    return packed.index_select(0, index).view(rows.dtype).view(index.numel(), *rows.shape[1:])


def shard(x: TokenRows, plan: Plan, cp_rank: int, *, shift: int = 0, pad_value: Scalar | None = None,
          fill: Scalar = 0) -> torch.Tensor:
    """Rank ``cp_rank``'s local rows of ``x``, optionally shifted (SPEC.md, "Shifts").

    Args:
        x: the batch's token rows, any dtype and trailing shape: a jagged nested tensor, a list of
            ``(n_i, ...)`` tensors, or the flat ``(sum(seqlens), ...)`` tensor. For a
            :class:`BshdPlan` a plain tensor is the right-padded ``(B, S, ...)`` batch
            (``S >= max(seqlens)``); pass packed rows there as a list or nested tensor.
        plan: a :class:`ShardPlan` (THD) or :class:`BshdPlan` (BSHD).
        cp_rank: the rank's index in its context-parallel group, ``0 <= cp_rank < plan.cp_size``.
        shift: ``k``; token ``p`` of a sequence receives token ``p + k`` of the same sequence, or
            ``fill`` past its end. ``shift=1`` gives next-token labels; depth ``d`` of multi-token
            prediction uses ``shift=d`` on labels and loss masks. ``k < 0`` looks back (token ``p -
            |k|``, ``fill`` before the start): a causal convolution's inputs. No communication.
        pad_value: the value of pad rows; default ``fill`` when ``shift != 0`` (so labels filled
            with an ignore index never train on padding), else 0.
        fill: the value of token rows whose shifted source lies outside the sequence.

    Returns:
        ``plan.local_shape + trailing``: ``(L, ...)`` for THD, ``(B, M / cp, ...)`` for BSHD, on
        ``x``'s device. Differentiable with respect to ``x``.

    Example (SPEC.md's worked example)::

        >>> from cpshard import ShardPlan
        >>> plan = ShardPlan.build([5, 3], cp_size=2)
        >>> shard([torch.arange(5), torch.arange(10, 13)], plan, 1)
        tensor([ 2,  3,  4,  0, 11, 12])
        >>> shard([torch.arange(5), torch.arange(10, 13)], plan, 1, shift=1, fill=-100)
        tensor([   3,    4, -100, -100,   12, -100])
    """
    check_plan_type(plan)
    cp_rank = check_rank(cp_rank, plan.cp_size)
    shift = check_shift(shift)
    stride: int | None = None
    plain = isinstance(x, torch.Tensor) and not check_tensor("x", x).is_nested
    padded = plan.padded_rows(x, "x") if plain else None  # type: ignore[arg-type]
    if padded is not None:  # the plan kind reads a plain tensor as the padded (B, S, ...) batch (BSHD)
        rows, stride = padded
    else:
        rows = as_flat(x, plan)
    pad, fil = pad_and_fill(pad_value, fill, shift, rows.dtype)
    out = gather_rows(rows, plan.indices().shard(cp_rank, shift, rows.device, stride), pad, fil)
    return out.view(*plan.local_shape, *rows.shape[1:])


def unshard(parts: Sequence[torch.Tensor], plan: Plan) -> torch.Tensor:
    """The per-sequence token rows from every rank's local output: the exact inverse of ``shard``.

    Args:
        parts: ``parts[r]`` is rank ``r``'s output, ``plan.local_shape + trailing`` (``(L, ...)``
            for THD, ``(B, M / cp, ...)`` for BSHD); all of one dtype, trailing shape and device.
        plan: the plan the inputs were sharded with.

    Returns:
        A jagged nested tensor ``(B, j, *trailing)`` whose ``values()`` are the token rows in order
        (pad rows dropped) and whose ``offsets()`` are ``cu_seqlens``. Differentiable.
    """
    check_plan_type(plan, "pass the plan used to shard")
    if isinstance(parts, torch.Tensor) or not isinstance(parts, (list, tuple)):
        fail("parts", type(parts).__name__, "must be a list with one tensor per rank",
             "pass [output of rank 0, ..., output of rank cp_size - 1]", kind=TypeError)
    if len(parts) != plan.cp_size:
        fail("parts", f"list of {len(parts)} tensors", f"must hold one tensor per rank (cp_size={plan.cp_size})",
             "pass every rank's local output, in rank order")
    lead = plan.local_shape
    first = parts[0]
    for r, part in enumerate(parts):
        check_tensor(f"parts[{r}]", part)
        if tuple(part.shape[:len(lead)]) != lead or part.dim() < len(lead):
            fail(f"parts[{r}]", f"tensor of shape {tuple(part.shape)}",
                 f"must lead with the plan's local_shape = {lead}", "pass each rank's full local output for this plan")
        if part.shape[len(lead):] != first.shape[len(lead):] or part.dtype != first.dtype \
                or part.device != first.device:
            fail(f"parts[{r}]", f"{tuple(part.shape)} {part.dtype} on {part.device}",
                 "must match parts[0]'s trailing shape, dtype and device", "convert the parts to agree")
    return unshard_by(parts, plan, RestoreBy.AUTO)


class RestoreBy(str, enum.Enum):
    """How the restore reads the token rows back (:func:`token_rows`): ``AUTO`` copies runs where they
    are long and gathers by an index elsewhere, from each rank's part where the parts are large
    (:data:`BY_RANK_ROWS`); ``RUNS``, ``INDEX`` (from the parts concatenated) and ``RANKS`` (from
    each rank's part) force one way."""

    AUTO = "auto"
    RUNS = "runs"
    INDEX = "index"
    RANKS = "ranks"


BY_RANK_ROWS = 1 << 22
"""From this many rows in all the ranks' parts (4M) the restore gathers each rank's token rows
without concatenating the parts (``PlanIndices.unshard_by_rank``): the concatenation copies every
padded row and, with torch's threads contending for a busy machine's cores, takes 0.5 s for 12.8M rows
(100,000 sequences of 1..64 tokens at cp = 64); below it, sorting the tokens by rank costs more than
the concatenation saves (``benchmarks/scale.py``)."""


def unshard_by(parts: Sequence[torch.Tensor], plan: Plan, by: RestoreBy | str) -> torch.Tensor:
    """:func:`unshard` of checked ``parts``, the restore forced to copy runs or to gather by an index
    (``by``, a :class:`RestoreBy` or its value): for tests and benchmarks that compare the two ways."""
    by = parse_choice(RestoreBy, by, "by", "restore method", "cpshard.ops.sharding.RestoreBy")
    lead = plan.local_shape
    rows = math.prod(lead)
    return as_nested(token_rows([p.reshape(rows, *p.shape[len(lead):]) for p in parts], plan, by), plan)


def token_rows(rows: torch.Tensor | Sequence[torch.Tensor], plan: Plan,
               by: RestoreBy = RestoreBy.AUTO) -> torch.Tensor:
    """The batch's token rows, in the caller's order, from every rank's flattened local rows: the
    rank-concatenated buffer ``(cp * R, ...)`` or a list of the ranks' ``(R, ...)`` rows.

    Copied run by run where the runs are long (``PlanIndices.runs``: no index to build, no
    concatenation of the parts first), else one gather from the buffer by ``PlanIndices.unshard``,
    or, for large parts (:data:`BY_RANK_ROWS`), from each part (``PlanIndices.unshard_by_rank``).
    ``by`` forces one way (tests compare them; the result is the same).
    """
    runs = None if by in (RestoreBy.INDEX, RestoreBy.RANKS) else \
        plan.indices().runs(0 if by is RestoreBy.RUNS else ROWS_PER_RUN)
    if runs is not None:
        sizes, keep = runs
        parts = rows.split(math.prod(plan.local_shape)) if isinstance(rows, torch.Tensor) else rows
        pieces = [piece for part, cut in zip(parts, sizes) for piece in part.split(cut)]
        return torch.cat([pieces[i] for i in keep])
    large = plan.cp_size * math.prod(plan.local_shape) >= BY_RANK_ROWS
    if not isinstance(rows, torch.Tensor) and (by is RestoreBy.RANKS or (by is RestoreBy.AUTO and large)):
        by_rank = _gather_by_rank(rows, plan)
        if by_rank is not None:
            return by_rank
    buf = rows if isinstance(rows, torch.Tensor) else torch.cat(list(rows))
    index = plan.indices().unshard(buf.device)
    moved = movable(buf, 0, 0)
    if moved is not None:
        return select_rows(moved[0], index).view(buf.dtype)
    return select_rows(buf, index)


def _gather_by_rank(parts: Sequence[torch.Tensor], plan: Plan) -> torch.Tensor | None:
    """:func:`token_rows` of the ranks' CPU parts without concatenating them first
    (``PlanIndices.unshard_by_rank``): each part's token rows, then one gather into the caller's
    order. None where the parts record autograd (``index_select(out=)`` records none) or are not
    plain CPU rows of one integer each (:func:`as_packed`): the caller concatenates them."""
    packed = [as_packed(p) for p in parts]
    if any(p is None for p in packed):
        return None
    rows, bounds, back = plan.indices().unshard_by_rank()
    first = parts[0]
    grouped = packed[0].new_empty(bounds[-1])  # type: ignore[union-attr]
    for part, index, lo, hi in zip(packed, rows, bounds[:-1], bounds[1:]):
        torch.index_select(part, 0, index, out=grouped[lo:hi])
    return grouped.index_select(0, back).view(first.dtype).view(back.numel(), *first.shape[1:])


def as_nested(values: torch.Tensor, plan: Plan) -> torch.Tensor:
    """``values`` (the batch's token rows) as a jagged nested tensor with the plan's offsets."""
    # the offsets are a copy: the result belongs to the caller, who may edit it
    return jagged(values, plan.indices().offsets(values.device).clone())


def shift(x: TokenRows, plan: Plan, k: int | None = None, *, shift: int | None = None, fill: Scalar = 0) -> Any:
    """SPEC's ``shift(x, k)`` on unsharded sequences, in the form ``x`` came in.

    Token ``p`` of each sequence receives token ``p + k``, or ``fill`` past the end. A jagged
    nested tensor gives a jagged nested tensor, a list of ``(n_i, ...)`` tensors a list, the flat
    ``(sum(seqlens), ...)`` tensor a flat tensor. Equal to
    ``unshard([shard(x, plan, r, shift=k, fill=fill) for r in range(plan.cp_size)], plan)``.
    The shift is ``shift=`` (the keyword ``shard`` and ``shift_sharded`` take) or, as before,
    the third positional argument; default 1, as ``shift_sharded``'s.
    """
    check_plan_type(plan)
    if k is not None and shift is not None:
        fail("shift", shift, f"was given twice (k={k} as well)", "pass the shift once, as shift=")
    k = check_shift(1 if k is None and shift is None else (k if shift is None else shift))
    rows = as_flat(x, plan)
    fill = check_fill("fill", fill, rows.dtype)
    values = gather_rows(rows, plan.unpadded().indices().shard(0, k, rows.device), 0, fill)
    if isinstance(x, torch.Tensor) and x.is_nested:
        return as_nested(values, plan)
    if isinstance(x, (list, tuple)):
        return list(values.split(list(plan.input_seqlens_py)))
    return values
