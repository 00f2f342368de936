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

- zigzag (``cp > 1``), with ``c_i = P_i / (2 cp)``: two segments per sequence, positions
  ``[r c_i, (r + 1) c_i)`` then ``[(2cp - 1 - r) c_i, (2cp - r) c_i)``;
- contiguous: one per sequence, the intersection of ``[S_i, S_i + P_i)`` with ``[r L, (r + 1) L)``
  (often empty: a rank may hold nothing of a sequence);
- ``cp = 1``: the whole padded sequence.

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


def rank_segments(padded: np.ndarray, seqlens: np.ndarray, cp_size: int, layout: Layout, rank: int) -> Segments:
    """``rank``'s segments for sequences of ``seqlens`` tokens padded to ``padded`` (Note above)."""
    b = padded.size
    total = int(padded.sum())
    local = total // cp_size
    ids = np.arange(b, dtype=np.int64)
    if cp_size == 1:
        return Segments.of(ids, np.zeros(b, dtype=np.int64), padded.copy(), total, seqlens)
    if layout is Layout.ZIGZAG:
        chunk = padded // (2 * cp_size)
        pos = np.stack([rank * chunk, (2 * cp_size - 1 - rank) * chunk], 1).reshape(-1)
        return Segments.of(np.repeat(ids, 2), pos, np.repeat(chunk, 2), local, seqlens)
    starts = np.cumsum(padded) - padded
    lo = starts.clip(rank * local, (rank + 1) * local)
    hi = (starts + padded).clip(rank * local, (rank + 1) * local)
    return Segments.of(ids, lo - starts, hi - lo, local, seqlens)


def held_segments(padded: np.ndarray, cp_size: int, layout: Layout, alone: bool = False) -> int:
    """How many non-empty segments every rank's lists hold together, for sequences padded to ``padded``
    (:func:`rank_segments` of every rank, those of positive length counted), in closed form: no
    segment is built. A padded sequence of ``P > 0`` rows gives ``2 cp`` chunks of ``P / (2 cp) > 0``
    rows under zigzag (``cp > 1``), one segment at ``cp = 1``, and under contiguous one per rank its
    rows ``[S, S + P)`` meet: ``ceil((S + P) / L) - floor(S / L)`` with ``L`` a rank's rows. With
    ``alone`` each sequence is split over the ranks on its own (the rows of a BSHD batch): ``cp``
    segments each under contiguous.

    >>> held_segments(np.array([6, 4, 0]), 2, Layout.CONTIGUOUS), held_segments(np.array([8, 0]), 2, Layout.ZIGZAG)
    (3, 4)
    """
    filled = padded > 0
    if cp_size == 1:
        return int(filled.sum())
    if layout is Layout.ZIGZAG or alone:
        return (2 if layout is Layout.ZIGZAG else 1) * cp_size * int(filled.sum())
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
