"""Pure index math for shifting a tensor that exists only sharded. No communication here.

Note [Sharded shift exchange]
-----------------------------
``shift_sharded`` must produce ``shard(shift(x, k))`` from the ranks' shards of ``x``. In a rank's
segment (Note [Which rows a rank holds] in ``_index.py``) of length ``c``, row ``j`` reads position
``p0 + j + k`` of its sequence: when ``j + k < c`` that is row ``j + k`` of the same segment, on the
same rank. Only the last ``k`` rows of a segment read elsewhere: from whichever segment holds that
position, found by one ``searchsorted`` over all ranks' segments sorted by (sequence, position).
If that segment sits on another rank the row travels, in one ``all_to_all_single``. Every rank
derives the whole exchange from the plan alone, for all ranks at once, so sender and receiver agree
on the order without any metadata message: the block rank ``s`` sends rank ``d`` holds the rows
``d`` needs from ``s``, ordered by ``d``'s output row. The work is over segments and boundary rows
(about ``2 B cp k``), plus one ``arange`` over the rank's rows; under zigzag only the chunk
boundaries whose successor chunk lies on another rank move data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cpshard import _index


@dataclass(frozen=True)
class Exchange:
    """One rank's part of a sharded shift. Indices are int64 on CPU until moved by the caller.

    Attributes:
        local_src: ``(L,)`` local row each output row copies when its source is on this rank
            (0 elsewhere; those rows are overwritten).
        send_rows: local rows to send, grouped by destination rank in rank order.
        send_splits: rows sent to each rank (``cp`` ints; 0 for this rank).
        recv_splits: rows received from each rank.
        recv_rows: output rows that take the received rows, in receive order.
        pad_rows, fill_rows: output rows set to ``pad_value`` / ``fill``.
        total_remote: rows crossing ranks over the whole group (0: no collective is needed).
    """

    local_src: torch.Tensor
    send_rows: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_rows: torch.Tensor
    pad_rows: torch.Tensor
    fill_rows: torch.Tensor
    total_remote: int

    def to(self, device: torch.device) -> Exchange:
        move = {f: _index.to_device(getattr(self, f), device) for f in
                ("local_src", "send_rows", "recv_rows", "pad_rows", "fill_rows")}
        return Exchange(send_splits=self.send_splits, recv_splits=self.recv_splits,
                        total_remote=self.total_remote, **move)


def build_exchange(segments: list[_index.Segments], seqlens: torch.Tensor, rank: int, shift: int) -> Exchange:
    """The exchange for ``rank``, from every rank's segments (``segments[r]``) and the token counts."""
    cp = len(segments)
    local = segments[rank].total
    every = _index.AllSegments.of(segments)
    seg_rank, seq, pos, length, first = every.rank, every.seq, every.pos, every.length, every.first
    rows = [_index.RankRows.of(s, seqlens) for s in segments]
    sourced = torch.from_numpy(np.concatenate([r.sourced(shift) for r in rows]))

    # Boundary rows: the last `shift` rows of each segment that have a source.
    tail = (length - shift).clamp(min=0)
    count = (sourced - tail).clamp(min=0)
    seg_of = torch.repeat_interleave(torch.arange(seq.numel()), count)
    j = _index.expand_segments(tail, count)
    want = pos[seg_of] + j + shift  # position in the sequence each boundary row reads

    holder = every.holder(seq[seg_of], want)  # the segment holding (sequence, position)

    dst_rank, dst_row = seg_rank[seg_of], first[seg_of] + j
    src_rank, src_row = seg_rank[holder], first[holder] + (want - pos[holder])
    remote = src_rank != dst_rank

    segs = segments[rank]
    local_src = segs.expand(segs.local_start + shift)
    if local_src.numel():
        local_src.clamp_(0, local - 1)  # rows past a segment's end are fixed below or overwritten
    here = (dst_rank == rank) & ~remote
    local_src[dst_row[here]] = src_row[here]

    incoming = torch.nonzero(remote & (dst_rank == rank)).flatten()
    incoming = incoming[torch.argsort(src_rank[incoming] * max(local, 1) + dst_row[incoming], stable=True)]
    outgoing = torch.nonzero(remote & (src_rank == rank)).flatten()
    outgoing = outgoing[torch.argsort(dst_rank[outgoing] * max(local, 1) + dst_row[outgoing], stable=True)]

    pad_rows, fill_rows = rows[rank].pad_rows(), rows[rank].fill_rows(shift)
    return Exchange(
        local_src=local_src,
        send_rows=src_row[outgoing],
        send_splits=tuple(torch.bincount(dst_rank[outgoing], minlength=cp).tolist()),
        recv_splits=tuple(torch.bincount(src_rank[incoming], minlength=cp).tolist()),
        recv_rows=dst_row[incoming],
        pad_rows=pad_rows,
        fill_rows=fill_rows,
        total_remote=int(remote.sum()),
    )
