"""Pure index math for shifting a tensor that exists only sharded. No communication here.

Note [Sharded shift exchange]
-----------------------------
``shift_sharded`` must produce ``shard(shift(x, k))`` from the ranks' shards of ``x``. In a rank's
segment (Note [Which rows a rank holds] in ``index/segments.py``) of length ``c``, row ``j`` reads position
``p0 + j + k`` of its sequence: when ``0 <= j + k < c`` that is row ``j + k`` of the same segment, on
the same rank. Only the last ``k`` rows of a segment (looking ahead, ``k > 0``) or its first ``-k``
rows (looking back, ``k < 0``) read elsewhere: from whichever segment holds that position, found by
one ``searchsorted`` over the segments sorted by (sequence, position).
If that segment sits on another rank the row travels, in one ``all_to_all_single``. Every rank
derives its part of the exchange from the plan alone, so sender and receiver agree on the order
without any metadata message: the block rank ``s`` sends rank ``d`` holds the rows ``d`` needs from
``s``, ordered by ``d``'s output row. A rank reads only its own segments and those of the ranks
within ``|k|`` positions of its rows (:func:`reach`: its neighbours, not the group), and whether the
group moves any row at all (every rank must agree on that without a message) is a closed form over
the sequences (:func:`remote_rows`). The work is over those segments and their boundary rows (about
``2 B |k|`` per rank reached), plus one ``arange`` over the rank's rows; under zigzag only the chunk
boundaries whose neighbouring chunk lies on another rank move data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cpshard.base.layout import Layout
from cpshard.index import segments as _index

__all__ = ["Exchange", "ShiftExchange", "all_to_all_in_process", "build_shift_exchange", "reach", "remote_rows"]


@dataclass(frozen=True)
class ShiftExchange:
    """One rank's part of a sharded shift. Indices are int64, on the CPU until moved (:meth:`to`).

    Attributes:
        source: ``(L,)`` local row each output row copies when its source is on this rank (0
            elsewhere; those rows are overwritten).
        send_rows: local rows to send, grouped by destination rank in rank order.
        send_splits: rows sent to each rank (``cp`` ints; 0 for this rank).
        recv_splits: rows received from each rank.
        recv_rows: output rows that take the received rows, in receive order.
        pad_rows, fill_rows: output rows set to ``pad_value`` / ``fill``.
        total_remote: rows crossing ranks over the whole group (0: no collective is needed).
    """

    source: torch.Tensor
    send_rows: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_rows: torch.Tensor
    pad_rows: torch.Tensor
    fill_rows: torch.Tensor
    total_remote: int

    def to(self, device: torch.device) -> ShiftExchange:
        move = {f: _index.to_device(getattr(self, f), device) for f in
                ("source", "send_rows", "recv_rows", "pad_rows", "fill_rows")}
        return ShiftExchange(send_splits=self.send_splits, recv_splits=self.recv_splits,
                             total_remote=self.total_remote, **move)

    def apply(self, local: torch.Tensor, received: torch.Tensor | None, pad_value: Any, fill: Any) -> torch.Tensor:
        """This rank's shifted rows from its ``(L, ...)`` rows and the rows other ranks sent it
        (``received``, in receive order; None when nothing crossed). No gradient bookkeeping: what
        ``cpshard.distributed.shift_sharded``'s forward computes."""
        out = local.index_select(0, self.source)
        if received is not None and received.shape[0]:
            out.index_copy_(0, self.recv_rows, received)
        if self.pad_rows.numel():
            out.index_fill_(0, self.pad_rows, pad_value)
        if self.fill_rows.numel():
            out.index_fill_(0, self.fill_rows, fill)
        return out


Exchange = ShiftExchange  # the name before 0.2 (CHANGELOG)


def all_to_all_in_process(parts: Sequence[torch.Tensor], send_rows: Sequence[torch.Tensor],
                          send_splits: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """What one ``all_to_all_single`` delivers, for every rank in one process: rank ``d`` receives
    the concatenation over ``s`` of the rows of ``parts[s]`` that ``s`` sends ``d``
    (``send_rows[s]`` grouped by destination, ``send_splits[s][d]`` of them). For tests, the CLI and
    anyone who wants to see an exchange without processes."""
    blocks = [list(part.index_select(0, rows).split(list(splits)))
              for part, rows, splits in zip(parts, send_rows, send_splits)]
    return [torch.cat([blocks[s][d] for s in range(len(parts))]) for d in range(len(parts))]


def build_shift_exchange(every: _index.AllSegments, segs: _index.Segments, rank: int, shift: int, cp: int,
                         total_remote: int) -> ShiftExchange:
    """The exchange for ``rank`` (whose segments are ``segs``) in a group of ``cp`` ranks, from the
    segments of ``rank`` and of every rank its boundary rows read from or are read by (``every``: all
    ranks, or those :func:`reach` names), and the group's crossing rows (:func:`remote_rows`)."""
    local = segs.total
    seg_rank, seq, pos, length, first = every.rank, every.seq, every.pos, every.length, every.start
    lo, hi = every.sourced(shift)

    # Boundary rows: the rows of each segment with a source, whose source lies outside the segment:
    # its last `shift` rows looking ahead, its first `-shift` rows looking back.
    if shift >= 0:
        first_row = np.maximum(np.maximum(length - shift, 0), lo)
        count = np.maximum(hi - first_row, 0)
    else:
        first_row = lo
        count = np.maximum(np.minimum(hi, -shift) - lo, 0)
    seg_of = np.repeat(np.arange(seq.size), count)
    j = _index.expand_np(first_row, count)
    want = pos[seg_of] + j + shift  # position in the sequence each boundary row reads

    # the segment holding (sequence, position), and its rank (-1: a rank not in `every`, which only
    # the rows of other ranks than `rank` read from)
    holder, src_rank = every.rank_holding(seq[seg_of], want)

    dst_rank, dst_row = seg_rank[seg_of], first[seg_of] + j
    src_row = first[holder] + (want - pos[holder])
    remote = src_rank != dst_rank

    source = segs.expand(segs.start + shift)
    if source.size:
        np.clip(source, 0, local - 1, out=source)  # rows past a segment's end are fixed below or overwritten
    here = (dst_rank == rank) & ~remote
    source[dst_row[here]] = src_row[here]

    width = max(local, 1)
    incoming = np.flatnonzero(remote & (dst_rank == rank))
    incoming = incoming[np.argsort(src_rank[incoming] * width + dst_row[incoming], kind="stable")]
    outgoing = np.flatnonzero(remote & (src_rank == rank))
    outgoing = outgoing[np.argsort(dst_rank[outgoing] * width + dst_row[outgoing], kind="stable")]

    t = torch.from_numpy
    return ShiftExchange(
        source=t(source),
        send_rows=t(src_row[outgoing]),
        send_splits=tuple(np.bincount(dst_rank[outgoing], minlength=cp).tolist()),
        recv_splits=tuple(np.bincount(src_rank[incoming], minlength=cp).tolist()),
        recv_rows=t(dst_row[incoming]),
        pad_rows=t(segs.pad_rows()),
        fill_rows=t(segs.fill_rows(shift)),
        total_remote=total_remote,
    )


def remote_rows(padded: np.ndarray, seqlens: np.ndarray, cp: int, layout: Layout, alone: bool, shift: int) -> int:
    """How many rows cross ranks in the sharded shift by ``shift`` over the whole group (the
    exchange's ``total_remote``), in closed form over the sequences: no segment is built.

    A crossing row is a token pair ``(p, p + k)`` of one sequence (``0 <= p``, ``p + k < n``, ``k =
    |shift|``: looking back pairs the same tokens) whose two rows sit on different ranks. Of the
    ``m = n - k`` pairs of a sequence padded to ``P``:

    - contiguous: rank ``floor(x / L)`` of the row ``x = S + p`` (``S`` the sequence's first row of
      the buffer, ``L`` a rank's rows; for a BSHD row, ``S = 0`` and ``L = M / cp``): the pair
      stays when ``x mod L < L - k``, and ``#{x in [a, b): x mod L < w}`` is ``F(b) - F(a)`` with
      ``F(x) = floor(x / L) w + min(x mod L, w)``;
    - zigzag, chunks of ``c = P / (2 cp)`` rows, chunk ``j`` on rank ``min(j, 2 cp - 1 - j)``: a pair
      stays in its chunk when ``p mod c < c - k`` (counted as above), or joins chunk ``j`` to its
      mirror ``2 cp - 1 - j``, ``d = 2 cp - 1 - 2 j`` chunks on, which a reach of ``k`` allows only
      for ``d`` in ``{floor(k / c), floor(k / c) + 1}``: ``p = j c + a`` with ``d c - k <= a < (d +
      1) c - k``;
    - zigzag chunks of unequal sizes (``padding="none"``), per chunk: the pairs starting in chunk ``j``
      whose second row lies in chunk ``j`` or its mirror.

    >>> remote_rows(np.array([8]), np.array([8]), 2, Layout.ZIGZAG, False, 1)  # chunks 0|1|2|3 on ranks 0|1|1|0
    2
    """
    k = abs(int(shift))
    if cp == 1 or k == 0:
        return 0
    m = np.maximum(seqlens - k, 0)
    if not alone and _index.unequal_chunks(padded, cp, layout):  # chunks of unequal sizes: per chunk
        lo, hi, mirror_lo, mirror_hi = _index.zigzag_pairs(padded, cp)
        first = np.minimum(hi, m[:, None])  # the pairs (p, p + k) starting in chunk j: p in [lo, first)
        stay = _index.overlap(lo, first, lo - k, hi - k) + _index.overlap(lo, first, mirror_lo - k, mirror_hi - k)
        return int(m.sum() - stay.sum())
    if layout is Layout.ZIGZAG:
        c = np.maximum(padded // (2 * cp), 1)  # an empty sequence (P = 0) has no pair: any c counts none
        w = np.maximum(c - k, 0)
        stay = (m // c) * w + np.minimum(m % c, w)
        for d in (k // c, k // c + 1):
            j = (2 * cp - 1 - d) // 2
            begin = j * c + np.maximum(d * c - k, 0)
            end = np.minimum(j * c + np.minimum(c, (d + 1) * c - k), m)
            mirror = (d % 2 == 1) & (d <= 2 * cp - 1)
            stay += np.where(mirror, np.maximum(end - begin, 0), 0)
        return int((m - stay).sum())
    if alone:
        local, start = np.maximum(padded // cp, 1), np.zeros_like(padded)
    else:
        local, start = max(int(padded.sum()) // cp, 1), np.cumsum(padded) - padded
    w = np.maximum(local - k, 0)

    def below(x: np.ndarray) -> np.ndarray:  # #{y in [0, x): y mod L < w}
        return (x // local) * w + np.minimum(x % local, w)
    return int((m - (below(start + m) - below(start))).sum())


def reach(padded: np.ndarray, seqlens: np.ndarray, cp: int, layout: Layout, alone: bool, rank: int,
          span: int) -> list[int]:
    """The ranks (ascending, ``rank`` among them) holding every row within ``span`` positions of one of
    ``rank``'s rows in its sequence: what ``rank``'s shift or halo exchange reads from or is read by,
    so that it needs only these ranks' segments. Contiguous: the ranks of the buffer's rows ``[r L -
    span, (r + 1) L + span)`` (of the columns for a BSHD plan, whose ``padded`` are ``M``); zigzag:
    the ranks of the chunks within ``ceil(span / c)`` of ``rank``'s two, ``c`` the shortest chunk of
    a sequence holding a token (every chunk of it has at least ``P // (2 cp)`` rows; where that is 0,
    under ``padding="none"``, empty chunks lie between held ones, and every rank is named).

    >>> reach(np.array([16, 16]), np.array([16, 16]), 4, Layout.ZIGZAG, False, 0, 1)  # chunks 0, 7 -> 1, 6
    [0, 1]
    """
    if cp == 1:
        return [0]
    if layout is Layout.ZIGZAG:
        filled = padded[seqlens > 0] // (2 * cp)
        if filled.size and not filled.min():  # a sequence shorter than 2 cp rows has empty chunks to skip
            return list(range(cp))
        c = max(int(filled.min()), 1) if filled.size else 1
        w = -(-span // c)
        # the chunks within w of either of the rank's two, clipped to the 2 cp chunks: at most 2 cp
        # of them whatever the span (a loop over all 2 w + 1 took minutes for |k| near 2**31)
        chunks = {j for mid in (rank, 2 * cp - 1 - rank) for j in range(max(mid - w, 0), min(mid + w, 2 * cp - 1) + 1)}
        return sorted({min(j, 2 * cp - 1 - j) for j in chunks})
    local = max((int(padded.max()) if alone else int(padded.sum())) // cp, 1)
    return list(range(max(rank * local - span, 0) // local, min(((rank + 1) * local + span - 1) // local, cp - 1) + 1))
