"""Pure index math for shifting sharded tensors by several shifts at once. No communication here.

Note [Halo exchange for several shifts]
---------------------------------------
Multi-token prediction needs ``shard(shift(x, k))`` for every ``k`` in a set of shifts (labels and
loss mask at depths ``1..N``, one more when labels come from ``input_ids``) while ``x`` exists only
sharded. Take a rank's segment (Note [Which rows a rank holds] in ``index/segments.py``) of sequence ``i``,
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

Looking back (``k < 0``, a causal convolution's inputs) is the mirror image: the ``-min(shifts)``
positions just before each segment (``p0 - 1``, ``p0 - 2``, ..., cut at the sequence's start) form a
second halo, exchanged in the same collective. Every rank derives its part of the exchange from the
plan, so sender and receiver agree on the order without a metadata message: rank ``s`` sends rank
``d`` the halo rows ``d`` needs from ``s`` in the order of their halo entries (segment, then offset
``t``). A rank reads only the segments of the ranks its halos reach or are reached from
(``index.shift.reach``), and the group's count of crossing halo rows is a closed form over the
sequences (:func:`remote_halo_rows`). The work is over those segments and their halo rows (about
``2 B H`` per rank reached under zigzag) plus a few passes over the rank's rows per shift.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cpshard.base.dtypes import bit_pattern, movable
from cpshard.base.layout import Layout
from cpshard.index import segments as _index
from cpshard.index.balance import tri

__all__ = ["HaloExchange", "build_halo_exchange", "pack_rows", "remote_halo_rows", "unpack_rows"]


@dataclass(frozen=True)
class HaloExchange:
    """One rank's part of shifting its rows by every shift in ``shifts`` with one exchange.

    Row indices refer to the rank's rows flattened to ``(R,)`` (``R = prod(plan.local_shape)``);
    ``base`` below is ``cat([local rows, received rows])``, ``(R + sum(recv_splits),)`` rows.

    Attributes:
        shifts: the shifts ``k`` (negative ones look back), in the order of the outputs (``S`` of them).
        send_rows: ``(sum(send_splits),)`` local rows to send, grouped by destination rank.
        send_splits: rows sent to each rank (``cp`` ints; 0 for this rank).
        recv_splits: rows received from each rank.
        source: ``(S, R)`` row of ``base`` each output row of each shift copies (0 on pad and fill
            rows, which are overwritten).
        pad_rows: rows past their sequence's length (``pad_value`` for every shift).
        fill_rows: per shift, the token rows whose shifted source lies past the sequence's end.
        total_remote: halo rows crossing ranks over the whole group (0: no collective is needed).
    """

    shifts: tuple[int, ...]
    send_rows: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    source: torch.Tensor
    pad_rows: torch.Tensor
    fill_rows: tuple[torch.Tensor, ...]
    total_remote: int

    def to(self, device: torch.device) -> HaloExchange:
        move = _index.to_device
        return HaloExchange(self.shifts, move(self.send_rows, device), self.send_splits, self.recv_splits,
                            move(self.source, device), move(self.pad_rows, device),
                            tuple(move(f, device) for f in self.fill_rows), self.total_remote)

    def apply(self, local: torch.Tensor, received: torch.Tensor | None, pad_value: Any, fill: Any) -> torch.Tensor:
        """``(S, R, *trailing)``: ``local`` ``(R, *trailing)`` shifted by every shift.

        ``received`` holds the rows other ranks sent (``None`` or empty when nothing crossed).
        ``pad_value``: the pad rows' value for every shift, or a sequence of one per shift (SPEC's
        default differs between a shifted entry and an unshifted one). Values are checked by the
        caller; no gradient flows (labels and masks).
        """
        pads = list(pad_value) if isinstance(pad_value, (list, tuple)) else [pad_value] * len(self.shifts)
        moved = movable(local, pads[0], fill)
        if moved is not None:  # fp8, uintN: no index_fill; move the bits, fill with the values' bit patterns
            carried, _, fill_bits = moved
            pad_bits = [bit_pattern(p, local.dtype) for p in pads]
            got = None if received is None else received.view(carried.dtype)
            return self.apply(carried, got, pad_bits, fill_bits).view(local.dtype)
        base = local if received is None or received.shape[0] == 0 else torch.cat([local, received])
        s, rows = self.source.shape
        if base.shape[0] == 0:
            out = local.new_zeros((s, rows, *local.shape[1:]))
        else:
            out = base.index_select(0, self.source.reshape(-1)).view(s, rows, *local.shape[1:])
        if self.pad_rows.numel() and len(set(pads)) == 1:
            out.index_fill_(1, self.pad_rows, pads[0])
        elif self.pad_rows.numel():
            for shifted, pad in zip(out, pads):
                shifted.index_fill_(0, self.pad_rows, pad)
        for shifted, fill_rows in zip(out, self.fill_rows):
            if fill_rows.numel():
                shifted.index_fill_(0, fill_rows, fill)
        return out


def build_halo_exchange(every: _index.AllSegments, segs: _index.Segments, seqlens: np.ndarray, rank: int,
                        shifts: Sequence[int], cp: int, total_remote: int) -> HaloExchange:
    """The halo exchange of ``rank`` (whose segments are ``segs``) in a group of ``cp`` ranks for
    ``shifts``, from the segments of ``rank`` and of every rank its halos reach or are reached from
    (``every``: all ranks, or those ``index.shift.reach`` names), the token counts ``seqlens`` (for
    BSHD: of the batch rows) and the group's crossing halo rows (:func:`remote_halo_rows`). Shifts
    may look ahead (``k > 0``: the halo after each segment) and back (``k < 0``: the halo before it)."""
    shifts = tuple(int(k) for k in shifts)
    ahead, back = max(max(shifts, default=0), 0), max(-min(shifts, default=0), 0)
    seg_rank, seq, pos, length, first = every.rank, every.seq, every.pos, every.length, every.start
    end = pos + length

    # Halo entries of segment g: after it, offsets t -> position end[g] + t (that exist); before it,
    # offsets t -> position pos[g] - 1 - t (>= 0). Only segments holding a token need any.
    after = np.where(every.tokens > 0, np.clip(seqlens[seq] - end, 0, ahead), 0)
    before = np.where(every.tokens > 0, np.minimum(pos, back), 0)
    count = after + before
    entry_seg = np.repeat(np.arange(seq.size), count)
    entry_t = _index.expand_np(np.zeros_like(count), count)  # < after[g]: after; else before, t - after[g]
    entry_start = np.cumsum(count) - count  # entry index of (g, 0)
    is_after = entry_t < after[entry_seg]
    want = np.where(is_after, end[entry_seg] + entry_t, pos[entry_seg] - 1 - (entry_t - after[entry_seg]))

    # the segment holding (sequence, position), and its rank (-1: a rank not in `every`, which only
    # the halos of other ranks than `rank` reach)
    holder, src_rank = every.rank_holding(seq[entry_seg], want)

    dst_rank = seg_rank[entry_seg]
    src_row = first[holder] + (want - pos[holder])
    remote = src_rank != dst_rank
    entries = entry_seg.size
    entry_id = np.arange(entries)

    incoming = np.flatnonzero(remote & (dst_rank == rank))
    incoming = incoming[np.argsort(src_rank[incoming] * max(entries, 1) + entry_id[incoming], kind="stable")]
    outgoing = np.flatnonzero(remote & (src_rank == rank))
    outgoing = outgoing[np.argsort(dst_rank[outgoing] * max(entries, 1) + entry_id[outgoing], kind="stable")]

    rows = segs.total
    # Row of `base` holding each halo entry of this rank: a local row, or a received one after them.
    entry_base = np.zeros(max(entries, 1), dtype=np.int64)
    mine = np.flatnonzero((dst_rank == rank) & ~remote)
    entry_base[mine] = src_row[mine]
    entry_base[incoming] = rows + np.arange(incoming.size)

    g = every.first_of(rank) + np.repeat(np.arange(segs.seq.size), segs.length)  # each row's segment among all
    j = _index.expand_np(np.zeros_like(segs.length), segs.length)  # row inside its segment
    c = length[g]
    p = pos[g] + j
    n = seqlens[seq[g]]
    row = np.arange(rows)

    k = np.array(shifts, dtype=np.int64).reshape(-1, 1)
    pad = p >= n
    fill = ~pad & ((p + k >= n) | (p + k < 0))
    inside = (j + k >= 0) & (j + k < c)
    # outside the segment: after it at offset j + k - c, before it at offset -(j + k) - 1
    offset = np.where(j + k >= c, j + k - c, after[g] + (-(j + k) - 1))
    halo_entry = np.clip(entry_start[g] + offset, 0, max(entries - 1, 0))
    source = np.where(inside, row + k, entry_base[halo_entry])
    source[pad | fill] = 0
    t = torch.from_numpy
    return HaloExchange(
        shifts=shifts,
        send_rows=t(src_row[outgoing]),
        send_splits=tuple(np.bincount(dst_rank[outgoing], minlength=cp).tolist()),
        recv_splits=tuple(np.bincount(src_rank[incoming], minlength=cp).tolist()),
        source=t(np.ascontiguousarray(source)),
        pad_rows=t(segs.pad_rows()),
        fill_rows=tuple(t(np.flatnonzero(f)) for f in fill),
        total_remote=total_remote,
    )


def remote_halo_rows(padded: np.ndarray, seqlens: np.ndarray, cp: int, layout: Layout, alone: bool,
                     shifts: Sequence[int]) -> int:
    """How many halo rows cross ranks over the whole group for ``shifts`` (the exchange's
    ``total_remote``), in closed form over the sequences: no segment is built.

    A segment holding a token has ``min(A, n - e)`` entries after it (``A`` the largest look-ahead,
    ``e`` its end) and ``min(s, B)`` before it (``B`` the largest look-back, ``s`` its first
    position). Contiguous: a segment ends inside its sequence only at a rank's last row, so every
    such entry lies on another rank; one sum over the ``cp - 1`` rank boundaries (per distinct
    length for a BSHD batch, whose rows are split alone). Zigzag, chunks of ``c`` rows: chunk ``j``
    (``j c < n``) has ``min(A, n - (j + 1) c)`` entries after and ``min(j c, B)`` before, summed over
    ``j`` as arithmetic series; of them only those in the mirror chunk ``2 cp - 1 - j`` stay on the
    rank: the after-halo of chunk ``cp - 1 - u`` at offsets ``[2 u c, (2 u + 1) c)``, the
    before-halo of chunk ``cp + u`` at the same offsets (``u < A / 2`` resp. ``B / 2``). Zigzag chunks
    of unequal sizes (``padding="none"``): per chunk, the halo less its overlap with the mirror chunk.

    >>> remote_halo_rows(np.array([8]), np.array([8]), 2, Layout.ZIGZAG, False, (1,))  # chunk 2's halo is rank 0's
    2
    """
    ahead, back = max(max(shifts, default=0), 0), max(-min(shifts, default=0), 0)
    if cp == 1 or not (ahead or back):
        return 0
    n = seqlens
    if not alone and _index.unequal_chunks(padded, cp, layout):  # chunks of unequal sizes: per chunk
        lo, hi, mirror_lo, mirror_hi = _index.zigzag_pairs(padded, cp)
        n = n[:, None]
        after_end = hi + np.clip(n - hi, 0, ahead)
        before_lo = lo - np.minimum(lo, back)
        crossing = (after_end - hi - _index.overlap(hi, after_end, mirror_lo, mirror_hi)
                    + lo - before_lo - _index.overlap(before_lo, lo, mirror_lo, mirror_hi))
        return int(np.where((hi > lo) & (lo < n), crossing, 0).sum())
    if layout is Layout.ZIGZAG:
        c = np.maximum(padded // (2 * cp), 1)
        last = np.maximum(-(-n // c) - 1, 0)  # the last chunk holding a token (0 for an empty sequence)
        i1 = np.clip((n - ahead) // c, 0, last)  # chunks 1..i1 end at least `ahead` tokens before the end
        after = ahead * i1 + (last - i1) * n - c * (tri(last) - tri(i1))
        i2 = np.clip(back // c, 0, last)  # chunks 0..i2 start at most `back` positions in
        before = c * tri(i2) + back * (last - i2)
        total = int((after + before).sum())
        for u in range(min(cp, (ahead + 1) // 2)):  # after-halo of chunk cp - 1 - u reaching its mirror
            j = cp - 1 - u
            got = np.minimum(ahead, np.maximum(n - (j + 1) * c, 0))
            total -= int(np.maximum(np.minimum((2 * u + 1) * c, got) - 2 * u * c, 0).sum())
        for u in range(min(cp, (back + 1) // 2)):  # before-halo of chunk cp + u reaching its mirror
            j = cp + u
            got = np.where(j * c < n, np.minimum(j * c, back), 0)
            total -= int(np.maximum(np.minimum((2 * u + 1) * c, got) - 2 * u * c, 0).sum())
        return total
    if alone:  # BSHD: every row split alone at the columns b L, b = 1 .. cp - 1
        local = int(padded.max()) // cp if padded.size else 0
        lens, rows = np.unique(n, return_counts=True)
        first, length = np.arange(1, cp, dtype=np.int64)[None, :] * local, lens[:, None]
        weight = rows[:, None]
    else:  # THD: the buffer split at the rows b L; the sequence holding each boundary strictly inside
        local = int(padded.sum()) // cp
        starts = np.cumsum(padded) - padded
        bound = np.arange(1, cp, dtype=np.int64) * local
        seq = np.searchsorted(starts, bound, side="right") - 1
        first, length, weight = bound - starts[seq], n[seq], np.ones(cp - 1, dtype=np.int64)
    inside = (first > 0) & (first < length)
    per = np.minimum(ahead, length - first) + np.minimum(first, back)
    return int((np.where(inside, per, 0) * weight).sum())


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
