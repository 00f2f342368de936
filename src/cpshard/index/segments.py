"""Vectorized index math shared by the THD and BSHD plans. CPU int64 tensors in, out; no data.

The arithmetic runs on NumPy views of those tensors (``Tensor.numpy()`` and ``torch.from_numpy``
share memory, so crossing costs nothing): the arrays here hold a few hundred segments, where
torch's per-call overhead is several times NumPy's, and NumPy's ``repeat`` is the fastest
expansion of per-segment values into rows. Indices reach other devices through :func:`to_device`.

Note [Which rows a rank holds]
------------------------------
The global padded buffer concatenates the padded sequences; sequence ``i`` owns rows
``S_i .. S_i + P_i - 1``. A rank's rows are described as a short list of **segments**
``(sequence i, first position p0, length c)`` in local order:

- zigzag (``cp > 1``): two segments per sequence, its chunks ``r`` and ``2 cp - 1 - r`` of the ``2 cp``
  chunks that tile ``[0, P_i)`` (:func:`zigzag_bounds`); with ``c_i = P_i / (2 cp)`` (every padding
  but ``"none"``) positions ``[r c_i, (r + 1) c_i)`` then ``[(2cp - 1 - r) c_i, (2cp - r) c_i)``;
- contiguous: one per sequence, the intersection of ``[S_i, S_i + P_i)`` with ``[r L, (r + 1) L)``
  (often empty: a rank may hold nothing of a sequence);
- ``cp = 1``: the whole padded sequence.

Note [Zigzag chunks of any length]
----------------------------------
Under ``padding="none"`` a padded length ``P_i`` need not divide by ``2 cp``. Write ``P_i = 2 cp q_i +
m_i`` with ``0 <= m_i < 2 cp``. Chunk ``j`` of sequence ``i`` has ``q_i`` rows, plus one where it takes
one of the ``m_i`` **extra** rows; the chunks still tile ``[0, P_i)`` in order, and rank ``r`` still holds
chunks ``r`` and ``2 cp - 1 - r``. The extras are dealt by one counter running over the whole buffer:
with ``o_i = (m_0 + ... + m_{i-1}) mod cp``, the ``t``-th extra of sequence ``i`` (``0 <= t < m_i``)
goes to rank ``(o_i + t) mod cp``, to its front chunk (``r``) for ``t < cp`` and to its back chunk
(``2 cp - 1 - r``) for ``t >= cp``.

*Chunks differ by at most one row*: each chunk takes at most one extra, since the ``t < cp`` go to
``min(m_i, cp)`` distinct ranks' front chunks and the ``t >= cp`` to ``m_i - cp < cp`` distinct ranks'
back chunks. *Every rank holds exactly* ``T / cp`` *rows*, ``T = sum_i P_i``, whenever ``cp`` divides
``T``: rank ``r`` holds ``2 q_i`` rows of sequence ``i`` plus its extras, and the extras of all
sequences are the counter values ``0 .. M - 1`` (``M = sum_i m_i``), value ``c`` on rank ``c mod cp``.
So rank ``r`` holds ``2 sum_i q_i + #{c < M : c mod cp = r}`` rows, and ``cp`` divides ``M = T - 2 cp
sum_i q_i``, so every rank has ``M / cp`` extras. *Equal chunks where they exist*: with every ``m_i =
0`` this is the zigzag above, so the rule generalises it and nothing changes for any other padding.
*Causal balance*: rank ``r``'s chunks of sequence ``i`` begin within ``m_i < 2 cp`` positions of where
equal chunks of ``P_i / (2 cp)`` rows would, so its work on ``i`` differs from ``1 / cp`` of the
sequence's by ``O(cp P_i)`` pairs against ``O(P_i**2 / cp)``: within rounding, and the counter turns
the ranks that take the extras from one sequence to the next.

Everything per row (global row, sequence id, position, where a shifted row reads from, which rows
are pad or fill) is one expansion of per-segment values: a ``repeat`` of the segment value plus an
``arange`` offset (:func:`expand_np`). The work over rows is a couple of passes, the rest is over segments
(``2 B`` of them). Padding comes first and permuting second, so short and empty sequences need no
special case: a zero-length segment expands to nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cpshard.base.layout import Layout

_I64 = torch.int64
_INT64 = np.dtype(np.int64)


def expand_np(starts: np.ndarray, lengths: np.ndarray, dtype: np.dtype = _INT64) -> np.ndarray:
    """Concatenate ``arange(s, s + n)`` for every segment ``(s, n)``: ``(sum(lengths),)`` of ``dtype``.

    Row ``j`` of segment ``k`` (which begins at output row ``b_k``) is ``s_k + j``, that is
    ``(s_k - b_k) + (b_k + j)``: one ``repeat`` of the per-segment offsets ``s_k - b_k`` plus an
    ``arange`` over every row, read from a kept one. NumPy, not torch, for the work over segments
    and the repeat (torch's per-call overhead is 3-10x NumPy's, and its ``repeat_interleave`` about
    4x slower). The result shares memory with nothing the caller sees.
    """
    begin = np.cumsum(lengths) - lengths
    out = np.repeat((starts - begin).astype(dtype, copy=False), lengths)
    out += _arange(out.size, dtype)
    return out


_ARANGE_CACHED = 1 << 24  # rows: an arange kept for reuse costs at most 128 MiB (int64)
_aranges: dict[np.dtype, np.ndarray] = {}


def _arange(n: int, dtype: np.dtype) -> np.ndarray:
    """``arange(n)``, a read-only view of one kept per dtype (grown to the next power of two)."""
    if n > _ARANGE_CACHED:
        return np.arange(n, dtype=dtype)
    have = _aranges.get(dtype)
    if have is None or have.size < n:
        have = np.arange(1 << max(n - 1, 1).bit_length(), dtype=dtype)
        have.flags.writeable = False
        _aranges[dtype] = have  # one reference swap: readers holding the old one stay valid
    return have[:n]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An index built on the CPU, on ``device``. To CUDA through pinned memory without blocking: a
    plain copy from pageable memory synchronises the host with the stream (what
    ``torch.cuda.set_sync_debug_mode`` reports), once per index and step. The caching host
    allocator keeps the pinned buffer until the copy is done."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def int64_array(values: Sequence[int]) -> np.ndarray:
    """``(len(values),)`` int64 array of Python ints (about 4x faster than ``torch.tensor`` on a list)."""
    return np.array(values, dtype=np.int64)


@dataclass(frozen=True)
class Segments:
    """Rank's rows as runs of consecutive positions of one padded sequence, in local order (Note
    [Which rows a rank holds]); NumPy int64 arrays, one entry per segment. The one segment type:
    every per-row index of a rank and every every-rank view (:class:`AllSegments`) is built from
    these, which a plan's index service keeps once per rank.
    """

    seq: np.ndarray  # (K,) sequence (buffer order; for BSHD the batch row)
    pos: np.ndarray  # (K,) first position inside the padded sequence
    length: np.ndarray  # (K,) rows
    start: np.ndarray  # (K,) local row of the segment's first row
    remaining: np.ndarray  # (K,) the sequence's length minus pos: token rows from the segment's start on
    tokens: np.ndarray  # (K,) the segment's leading token rows; the rest of it is pad
    total: int  # sum(length): the rank's row count

    @staticmethod
    def of(seq: np.ndarray, pos: np.ndarray, length: np.ndarray, total: int, seqlens: np.ndarray) -> Segments:
        remaining = seqlens[seq] - pos
        tokens = np.minimum(np.maximum(remaining, 0), length)
        return Segments(seq, pos, length, np.cumsum(length) - length, remaining, tokens, total)

    def expand(self, per_segment: np.ndarray, dtype: np.dtype = _INT64) -> np.ndarray:
        """``(total,)``: ``per_segment[k] + j`` for row ``j`` of segment ``k``."""
        return expand_np(per_segment, self.length, dtype)

    def seq_ids(self) -> np.ndarray:
        return np.repeat(self.seq, self.length)

    def positions(self) -> np.ndarray:
        return self.expand(self.pos)

    def sourced(self, shift: int) -> tuple[np.ndarray, np.ndarray]:
        """Per segment, the token rows ``[lo, hi)`` (offsets in the segment) whose source ``shift`` away
        exists (:func:`sourced_rows`)."""
        return sourced_rows(self.pos, self.tokens, self.remaining, self.length, shift)

    def pad_rows(self) -> np.ndarray:
        """Local rows past their sequence's end: the same for every shift."""
        return expand_np(self.start + self.tokens, self.length - self.tokens)

    def fill_rows(self, shift: int) -> np.ndarray:
        """Token rows whose source ``shift`` away lies outside their sequence (a few per sequence): past
        its end for ``shift > 0``, before its start for ``shift < 0``."""
        if shift == 0:
            return np.zeros(0, dtype=np.int64)
        lo, hi = self.sourced(shift)
        if shift > 0:
            return expand_np(self.start + hi, self.tokens - hi)
        return expand_np(self.start, lo)


def sourced_rows(pos: np.ndarray, tokens: np.ndarray, remaining: np.ndarray, length: np.ndarray,
                 shift: int) -> tuple[np.ndarray, np.ndarray]:
    """Per segment, the token rows ``[lo, hi)`` (offsets in the segment) whose source, ``shift``
    positions away in the same sequence, exists: ``0 <= p + shift < n``. Looking ahead (``shift >
    0``) drops the segment's last token rows, looking back (``shift < 0``) its first, where the
    segment starts fewer than ``-shift`` positions into its sequence."""
    if shift >= 0:
        return np.zeros_like(tokens), (tokens if shift == 0 else np.minimum(np.maximum(remaining - shift, 0), length))
    return np.minimum(np.maximum(-shift - pos, 0), tokens), tokens


def document_runs(positions: np.ndarray) -> tuple[list[np.ndarray], tuple[int, int] | None]:
    """The documents of packed rows of position ids ``positions`` ``(B, S)`` int64, each document a run
    ``0, 1, ..., n - 1`` (a 0 starts one): per row, its documents' lengths; and the first entry ``(b, t)``
    that breaks the rule (a row not starting at 0 first, then the first step that is neither ``+1`` nor back
    to 0), or None. What the adapters that read documents from position ids share (torchtitan's rows, HF's
    padding-free collators); each names the entry in its own words.

    >>> lengths, bad = document_runs(np.array([[0, 1, 2, 0, 1, 0, 0, 1]]))
    >>> [row.tolist() for row in lengths], bad
    ([[3, 2, 1, 2]], None)
    >>> document_runs(np.array([[0, 1, 3]]))[1]
    (0, 2)
    """
    starts = positions == 0
    bad = np.flatnonzero(~starts[:, 0])
    if bad.size:
        return [], (int(bad[0]), 0)
    steps = starts[:, 1:] | (positions[:, 1:] == positions[:, :-1] + 1)
    if not steps.all():
        b, t = (int(v) for v in np.argwhere(~steps)[0])
        return [], (b, t + 1)
    size = positions.shape[1]
    return [np.diff(np.append(np.flatnonzero(row), size)) for row in starts], None


def unequal_chunks(padded: np.ndarray, cp_size: int, layout: Layout) -> bool:
    """Whether some zigzag sequence's chunks differ in size (a padded length not a multiple of ``2 cp``,
    which only ``padding="none"`` builds): the closed forms that take one chunk size per sequence
    (``index/closed.py``) do not apply, and the index service falls back to the segments."""
    return layout is Layout.ZIGZAG and cp_size > 1 and bool((padded % (2 * cp_size)).any())


def _windowed(x: np.ndarray | int, start: np.ndarray, width: np.ndarray, cp: int) -> np.ndarray:
    """``#{s in [0, x): (s - start) mod cp < width}`` for ``0 <= x, width <= cp`` and ``0 <= start < cp``:
    how many of the ranks below ``x`` lie in the cyclic window of ``width`` ranks from ``start``."""
    end = np.minimum(start + width, cp)
    return np.clip(x - start, 0, end - start) + np.minimum(x, np.maximum(start + width - cp, 0))


def zigzag_extras(padded: np.ndarray, cp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(q, front, back, start)`` per sequence (buffer order): the zigzag chunk size ``q = P // (2 cp)``,
    how many front chunks (``0 .. cp - 1``) and back chunks (``cp .. 2 cp - 1``) hold one extra row, and
    the rank the first extra goes to (Note [Zigzag chunks of any length])."""
    q, m = np.divmod(padded, 2 * cp)
    start = (np.cumsum(m) - m) % cp
    front = np.minimum(m, cp)
    return q, front, m - front, start


def zigzag_bounds(padded: np.ndarray, cp: int) -> np.ndarray:
    """``(B, 2 cp + 1)`` int64: the first position of each of a sequence's ``2 cp`` zigzag chunks, and
    ``P`` (Note [Zigzag chunks of any length]); chunk ``j`` is ``[bounds[j], bounds[j + 1])``, held by
    rank ``min(j, 2 cp - 1 - j)``. Equal chunks of ``P / (2 cp)`` rows where ``2 cp`` divides ``P``.

    >>> zigzag_bounds(np.array([8, 5, 3]), 2).tolist()  # the 5's extra: rank 0; the 3's: ranks 1, 0, then 1
    [[0, 2, 4, 6, 8], [0, 2, 3, 4, 5], [0, 1, 2, 3, 3]]
    """
    q, front, back, start = (v[:, None] for v in zigzag_extras(padded, cp))
    j = np.arange(cp + 1, dtype=np.int64)[None, :]
    low = j * q + _windowed(j, start, front, cp)  # chunks 0 .. cp - 1 begin here (then the back chunks)
    high = padded[:, None] - j * q - _windowed(j, start, back, cp)  # the back chunk of rank j - 1 begins here
    return np.concatenate([low, high[:, -2::-1]], axis=1)


def zigzag_pairs(padded: np.ndarray, cp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(lo, hi, mirror_lo, mirror_hi)``, each ``(B, 2 cp)``: every zigzag chunk ``j`` as ``[lo, hi)`` and
    the chunk ``2 cp - 1 - j`` its rank also holds (:func:`zigzag_bounds`)."""
    bounds = zigzag_bounds(padded, cp)
    lo, hi = bounds[:, :-1], bounds[:, 1:]
    return lo, hi, lo[:, ::-1], hi[:, ::-1]


def overlap(lo1: np.ndarray, hi1: np.ndarray, lo2: np.ndarray, hi2: np.ndarray) -> np.ndarray:
    """How many positions ``[lo1, hi1)`` and ``[lo2, hi2)`` share (elementwise)."""
    return np.maximum(np.minimum(hi1, hi2) - np.maximum(lo1, lo2), 0)


def zigzag_held(padded: np.ndarray, cp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(seq, rank, start, length)``: every non-empty zigzag chunk, its sequence, the rank holding it, its
    first position and rows (:func:`zigzag_bounds`' chunks), each rank's in its local order once sorted
    stably by rank. ``O(sum_i min(P_i, 2 cp))``: a sequence shorter than ``2 cp`` rows lists only the
    chunks that take its extra rows, so a batch of many short sequences at a large ``cp`` stays cheap."""
    q, front, back, start = zigzag_extras(padded, cp)
    count = np.where(q > 0, 2 * cp, front + back)
    seq = np.repeat(np.arange(padded.size, dtype=np.int64), count)
    t = expand_np(np.zeros(padded.size, dtype=np.int64), count)  # the chunk's index in its sequence's list
    q, front, back, start, p = q[seq], front[seq], back[seq], start[seq], padded[seq]
    extra = (start + t) % cp  # a short sequence's extra t: on that rank, its first chunk for t < cp
    j = np.where(q > 0, t, np.where(t < cp, extra, 2 * cp - 1 - extra))
    rank = np.minimum(j, 2 * cp - 1 - j)
    first = _windowed(rank, start, np.where(j < cp, front, back), cp)
    upto = _windowed(rank + 1, start, np.where(j < cp, front, back), cp)
    begin = np.where(j < cp, rank * q + first, p - (rank + 1) * q - upto)
    return seq, rank, begin, q + upto - first


def zigzag_chunks(padded: np.ndarray, cp: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(front_pos, front_len, back_pos, back_len)`` per sequence: ``rank``'s chunks ``rank`` and
    ``2 cp - 1 - rank`` (:func:`zigzag_bounds`'s, over one rank: ``O(B)``)."""
    q, front, back, start = zigzag_extras(padded, cp)
    before, upto = _windowed(rank, start, front, cp), _windowed(rank + 1, start, front, cp)
    back_upto = _windowed(rank + 1, start, back, cp)
    back_len = q + back_upto - _windowed(rank, start, back, cp)
    return rank * q + before, q + upto - before, padded - (rank + 1) * q - back_upto, back_len


def rank_segments(padded: np.ndarray, seqlens: np.ndarray, cp_size: int, layout: Layout, rank: int) -> Segments:
    """``rank``'s segments for sequences of ``seqlens`` tokens padded to ``padded`` (Note above)."""
    b = padded.size
    total = int(padded.sum())
    local = total // cp_size
    ids = np.arange(b, dtype=np.int64)
    if cp_size == 1:
        return Segments.of(ids, np.zeros(b, dtype=np.int64), padded.copy(), total, seqlens)
    if layout is Layout.ZIGZAG:
        front_pos, front_len, back_pos, back_len = zigzag_chunks(padded, cp_size, rank)
        pos = np.stack([front_pos, back_pos], 1).reshape(-1)
        return Segments.of(np.repeat(ids, 2), pos, np.stack([front_len, back_len], 1).reshape(-1), local, seqlens)
    starts = np.cumsum(padded) - padded
    lo = starts.clip(rank * local, (rank + 1) * local)
    hi = (starts + padded).clip(rank * local, (rank + 1) * local)
    return Segments.of(ids, lo - starts, hi - lo, local, seqlens)


def held_segments(padded: np.ndarray, cp_size: int, layout: Layout, alone: bool = False) -> int:
    """How many non-empty segments every rank's lists hold together, for sequences padded to ``padded``
    (:func:`rank_segments` of every rank, those of positive length counted), in closed form: no
    segment is built. A padded sequence of ``P > 0`` rows gives ``2 cp`` non-empty chunks under zigzag
    (``cp > 1``) where ``P >= 2 cp``, else ``P`` chunks of one row (Note [Zigzag chunks of any
    length]), one segment at ``cp = 1``, and under contiguous one per rank its rows ``[S, S + P)``
    meet: ``ceil((S + P) / L) - floor(S / L)`` with ``L`` a rank's rows. With ``alone`` each sequence
    is split over the ranks on its own (the rows of a BSHD batch): ``cp`` segments each under contiguous.

    >>> held_segments(np.array([6, 4, 0]), 2, Layout.CONTIGUOUS), held_segments(np.array([8, 0]), 2, Layout.ZIGZAG)
    (3, 4)
    """
    filled = padded > 0
    if cp_size == 1:
        return int(filled.sum())
    if layout is Layout.ZIGZAG:
        return int(np.minimum(padded, 2 * cp_size).sum())
    if alone:
        return cp_size * int(filled.sum())
    local = int(padded.sum()) // cp_size
    starts = (np.cumsum(padded) - padded)[filled]
    ends = starts + padded[filled]
    return int((-(-ends // local) - starts // local).sum())


def repeat_segments(single: Segments, seqlens: np.ndarray) -> Segments:
    """BSHD: the segments of one sequence of length ``M``, repeated for every batch row (row ``b``
    holding ``seqlens[b]`` tokens)."""
    batch, k = seqlens.size, single.seq.size
    return Segments.of(np.repeat(np.arange(batch, dtype=np.int64), k), np.tile(single.pos, batch),
                       np.tile(single.length, batch), single.total * batch, seqlens)


@dataclass(frozen=True)
class AllSegments:
    """Several ranks' segments side by side, in rank order: for index math that crosses ranks (the
    shift and halo exchanges, the restore), which every rank derives alike from the plan. A view of
    the per-rank :class:`Segments`, built from them: of every rank (the restore), or of one rank and
    the ranks its exchange can reach (``PlanIndices.near``)."""

    rank: np.ndarray  # (K,) the rank holding each segment
    seq: np.ndarray
    pos: np.ndarray
    length: np.ndarray
    start: np.ndarray  # local row of the segment's first row on its rank
    remaining: np.ndarray
    tokens: np.ndarray
    offsets: tuple[int, ...]  # the segments of ranks[i] are [offsets[i], offsets[i + 1])
    ranks: tuple[int, ...] = ()  # the ranks held, ascending (empty: 0 .. len(offsets) - 2)

    @staticmethod
    def of(segments: Sequence[Segments], ranks: Sequence[int] | None = None) -> AllSegments:
        """The segments of ``ranks`` (ascending; default every rank, ``0 .. len(segments) - 1``)."""
        held = tuple(range(len(segments))) if ranks is None else tuple(ranks)
        sizes = [s.seq.size for s in segments]
        seq, pos, length, start, remaining, tokens = (np.concatenate([getattr(s, f) for s in segments])
                                                      for f in ("seq", "pos", "length", "start", "remaining", "tokens"))
        return AllSegments(np.repeat(np.array(held, dtype=np.int64), sizes), seq, pos, length, start,
                           remaining, tokens, tuple(itertools.accumulate(sizes, initial=0)),
                           () if ranks is None else held)

    def first_of(self, rank: int) -> int:
        """The index of ``rank``'s first segment here (``rank`` must be held)."""
        return self.offsets[self.ranks.index(rank) if self.ranks else rank]

    def sourced(self, shift: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`Segments.sourced` of every segment."""
        return sourced_rows(self.pos, self.tokens, self.remaining, self.length, shift)

    def holder(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """The segment holding position ``pos`` of sequence ``seq``, for each query (every query must be
        a row some segment holds): one ``searchsorted`` over the non-empty segments sorted by key."""
        end = self.pos + self.length
        stride = int(end.max()) + 1 if end.size else 1
        nonempty = np.flatnonzero(self.length > 0)
        if not nonempty.size:
            return np.zeros_like(seq)
        keys = self.seq[nonempty] * stride + self.pos[nonempty]
        order = np.argsort(keys, kind="stable")
        found = np.searchsorted(keys[order], seq * stride + pos, side="right") - 1
        return nonempty[order[np.maximum(found, 0)]]

    def rank_holding(self, seq: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(segment, rank)``: :meth:`holder` of each query, and the rank holding it, or -1 where none of
        the ranks here holds it (a row of a neighbour that reads from a rank further away)."""
        g = self.holder(seq, pos)
        if not g.size:
            return g, g
        held = (self.seq[g] == seq) & (self.pos[g] <= pos) & (pos < self.pos[g] + self.length[g])
        return g, np.where(held, self.rank[g], -1)


@dataclass(frozen=True)
class ShardIndex:
    """How ``shard`` builds a rank's rows: one gather, then two fills.

    A shift needs no index of its own: output row ``j`` reads input row ``src[j] + shift``, that is
    row ``src[j]`` of the input without its first ``shift`` rows (a view). Only rows whose
    ``src[j]`` lies in the input's last ``shift`` rows would read past that view, and those are all
    fill or pad rows (Note [Which rows a rank holds]); ``safe`` lists the output row ranges free of
    them (``None``: every row), and the gather skips the others, which the fills then write.
    """

    source: torch.Tensor  # (rows,) input row each output row copies, unshifted (clamped where overwritten)
    pad_rows: torch.Tensor  # output rows past their sequence's length: pad_value
    fill_rows: torch.Tensor  # token rows whose shifted source lies past the end: fill
    shift: int = 0
    safe: tuple[tuple[int, int], ...] | None = None
