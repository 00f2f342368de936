"""Pure index math for shifting sharded tensors by several shifts at once. No communication here.

Note [Halo exchange for several shifts]
---------------------------------------
Multi-token prediction needs ``shard(shift(x, k))`` for every ``k`` in a set of shifts (labels and
loss mask at depths ``1..N``, one more when labels come from ``input_ids``) while ``x`` exists only
sharded. Take a rank's segment (Note [Which rows a rank holds] in ``_index.py``) of sequence ``i``,
first position ``p0`` and length ``c``. Row ``j`` of it reads position ``p0 + j + k``: inside the
segment while ``j + k < c``, otherwise position ``p0 + c + t`` with ``t = j + k - c < k``. So every
shift ``k <= H`` reads only the segment itself and its **halo**, the ``H`` positions that follow it
(``p0 + c .. p0 + c + H - 1``, cut at the sequence's length ``n_i``: positions past it are never
read, their rows are ``fill``).

One exchange of every segment's halo therefore serves every shift ``k <= H`` and every tensor: the
halo rows held by another rank travel in one ``all_to_all_single`` (the tensors packed side by side
as bytes), the others are local rows. Each shift is then one gather from ``cat([local, received])``
plus the pad and fill rows.

Why not the exchange of ``shift_sharded`` for ``k = H`` (Note [Sharded shift exchange]): it moves
the positions that the *last* ``H`` rows of a segment read, ``p0 + max(c, H) .. p0 + c + H - 1``;
when a segment is shorter than ``H`` (short sequences, many ranks) the first ``H - c`` halo positions
that smaller shifts need are missing. The halo always holds all ``min(H, n_i - p0 - c)`` of them.

Every rank derives the whole exchange from the plan, for all ranks at once, so sender and receiver
agree on the order without a metadata message: rank ``s`` sends rank ``d`` the halo rows ``d``
needs from ``s`` in the order of their halo entries (segment, then offset ``t``). The work is over
segments and halo rows (about ``2 B cp H`` under zigzag) plus a few passes over the rank's rows per
shift.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from cpshard import _index
from cpshard._dtypes import movable

_I64 = torch.int64
Scalar = Union[int, float, bool]


@dataclass(frozen=True)
class MultiShift:
    """One rank's part of shifting its rows by every shift in ``shifts`` with one exchange.

    Row indices refer to the rank's rows flattened to ``(R,)`` (``R = prod(plan.local_shape)``);
    ``base`` below is ``cat([local rows, received rows])``, ``(R + sum(recv_splits),)`` rows.

    Attributes:
        shifts: the shifts ``k >= 0``, in the order of the outputs (``S`` of them).
        send_rows: ``(sum(send_splits),)`` local rows to send, grouped by destination rank.
        send_splits: rows sent to each rank (``cp`` ints; 0 for this rank).
        recv_splits: rows received from each rank.
        source: ``(S, R)`` row of ``base`` each output row of each shift copies (0 on pad and fill
            rows, which are overwritten).
        pad: ``(R,)`` bool, rows past their sequence's length (``pad_value`` for every shift).
        fill: ``(S, R)`` bool, token rows whose shifted source lies past the sequence's end.
        total_remote: halo rows crossing ranks over the whole group (0: no collective is needed).
    """

    shifts: tuple[int, ...]
    send_rows: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    source: torch.Tensor
    pad: torch.Tensor
    fill: torch.Tensor
    total_remote: int

    def to(self, device: torch.device) -> MultiShift:
        move = _index.to_device
        return MultiShift(self.shifts, move(self.send_rows, device), self.send_splits, self.recv_splits,
                          move(self.source, device), move(self.pad, device), move(self.fill, device), self.total_remote)


def build_multi_shift(segments: Sequence[_index.Segments], seqlens: torch.Tensor, rank: int,
                      shifts: Sequence[int]) -> MultiShift:
    """The halo exchange of ``rank`` for ``shifts``, from every rank's segments and the token counts.

    ``segments[r]`` are rank ``r``'s segments in local order (for BSHD: one per row and chunk, the
    "sequence" being the batch row); ``seqlens`` ``(B,)`` int64 are the token counts.
    """
    cp = len(segments)
    shifts = tuple(int(k) for k in shifts)
    halo = max(shifts, default=0)
    every = _index.AllSegments.of(segments)
    seg_rank, seq, pos, length, first = every.rank, every.seq, every.pos, every.length, every.first
    end = pos + length

    # Halo entries (segment g, offset t): positions end[g] + t that exist, for non-empty segments.
    count = torch.where(length > 0, (seqlens[seq] - end).clamp(0, halo), torch.zeros_like(length))
    entry_seg = torch.repeat_interleave(torch.arange(seq.numel()), count)
    entry_t = _index.expand_segments(torch.zeros_like(count), count)
    entry_start = torch.cumsum(count, 0) - count  # entry index of (g, 0)
    want = end[entry_seg] + entry_t

    holder = every.holder(seq[entry_seg], want)  # the segment holding (sequence, position)

    dst_rank, src_rank = seg_rank[entry_seg], seg_rank[holder]
    src_row = first[holder] + (want - pos[holder])
    remote = src_rank != dst_rank
    entries = entry_seg.numel()
    entry_id = torch.arange(entries)

    incoming = torch.nonzero(remote & (dst_rank == rank)).flatten()
    incoming = incoming[torch.argsort(src_rank[incoming] * max(entries, 1) + entry_id[incoming])]
    outgoing = torch.nonzero(remote & (src_rank == rank)).flatten()
    outgoing = outgoing[torch.argsort(dst_rank[outgoing] * max(entries, 1) + entry_id[outgoing])]

    segs = segments[rank]
    rows = segs.total
    # Row of `base` holding each halo entry of this rank: a local row, or a received one after them.
    entry_base = torch.zeros(max(entries, 1), dtype=_I64)
    mine = torch.nonzero((dst_rank == rank) & ~remote).flatten()
    entry_base[mine] = src_row[mine]
    entry_base[incoming] = rows + torch.arange(incoming.numel())

    offset = sum(s.seq.numel() for s in segments[:rank])  # this rank's first segment among all
    local_seg = torch.repeat_interleave(torch.arange(segs.seq.numel()), segs.length, output_size=rows)
    j = _index.expand_segments(torch.zeros_like(segs.length), segs.length, rows)  # row inside its segment
    c = segs.length[local_seg]
    p = segs.pos[local_seg] + j
    n = seqlens[segs.seq][local_seg]
    row = torch.arange(rows)

    k = torch.tensor(shifts, dtype=_I64).view(-1, 1)
    pad = p >= n
    fill = ~pad & (p + k >= n)
    inside = j + k < c
    halo_entry = (entry_start[offset + local_seg] + (j + k - c)).clamp(0, max(entries - 1, 0))
    source = torch.where(inside, row + k, entry_base[halo_entry])
    source = torch.where(pad | fill, torch.zeros_like(source), source)
    return MultiShift(
        shifts=shifts,
        send_rows=src_row[outgoing],
        send_splits=tuple(torch.bincount(dst_rank[outgoing], minlength=cp).tolist()),
        recv_splits=tuple(torch.bincount(src_rank[incoming], minlength=cp).tolist()),
        source=source,
        pad=pad,
        fill=fill,
        total_remote=int(remote.sum()),
    )


def pack_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(R, W)`` uint8: the rows of ``(R, *trailing)`` tensors as bytes, side by side (any dtypes)."""
    rows = tensors[0].shape[0]
    parts = [t.detach().contiguous().view(rows, math.prod(t.shape[1:])).view(torch.uint8) for t in tensors]
    return torch.cat(parts, 1)


def unpack_rows(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows`: ``packed.shape[0]`` rows typed and shaped as the rows of ``like``."""
    rows, out, col = packed.shape[0], [], 0
    for t in like:
        width = t.element_size() * math.prod(t.shape[1:])
        # a fresh copy, not .contiguous(): a one-row slice counts as contiguous but keeps the packed row
        # stride, which view(dtype) refuses when the widths of mixed dtypes do not divide it
        part = packed.new_empty((rows, width)).copy_(packed[:, col:col + width])
        out.append(part.view(t.dtype).view(rows, *t.shape[1:]))
        col += width
    return out


def apply_multi_shift(ms: MultiShift, local: torch.Tensor, received: torch.Tensor | None, pad_value: Any,
                      fill: Any) -> torch.Tensor:
    """``(S, R, *trailing)``: ``local`` ``(R, *trailing)`` shifted by every shift of ``ms``.

    ``received`` holds the rows other ranks sent (``None`` or empty when nothing crossed). Values
    are checked by the caller; no gradient flows (labels and masks).
    """
    moved = movable(local, pad_value, fill)
    if moved is not None:  # fp8, uintN: no masked_fill; move the bits, fill with the values' bit patterns
        carried, pad_bits, fill_bits = moved
        got = None if received is None else received.view(carried.dtype)
        return apply_multi_shift(ms, carried, got, pad_bits, fill_bits).view(local.dtype)
    base = local if received is None or received.shape[0] == 0 else torch.cat([local, received])
    s, rows = ms.source.shape
    if base.shape[0] == 0:
        out = local.new_zeros((s, rows, *local.shape[1:]))
    else:
        out = base.index_select(0, ms.source.reshape(-1)).view(s, rows, *local.shape[1:])
    extra = (1,) * (local.dim() - 1)
    out = out.masked_fill(ms.pad.view(1, rows, *extra), pad_value)
    return out.masked_fill(ms.fill.view(s, rows, *extra), fill)

