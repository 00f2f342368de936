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
``arange`` offset (:func:`expand_segments`). The work over rows is a couple of passes, the rest is over segments
(``2 B`` of them). Padding comes first and permuting second, so short and empty sequences need no
special case: a zero-length segment expands to nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cpshard.layout import Layout

_I64 = torch.int64
_INT64 = np.dtype(np.int64)


def expand_segments(starts: torch.Tensor, lengths: torch.Tensor, total: int | None = None,
                    dtype: torch.dtype = _I64) -> torch.Tensor:
    """Concatenate ``arange(s, s + n)`` for every segment ``(s, n)``; ``total == lengths.sum()``.

    Row ``j`` of segment ``k`` (which begins at output row ``b_k``) is ``s_k + j``, that is
    ``(s_k - b_k) + (b_k + j)``: one ``repeat`` of the per-segment offsets ``s_k - b_k`` plus an
    ``arange`` over every row, read from a cached one. NumPy, not torch, for the work over
    segments and the repeat (torch's per-call overhead is 3-10x NumPy's, and its
    ``repeat_interleave`` about 4x slower): about 2.5x faster than a running sum of ones with
    jumps, which is what this was before (``benchmarks/step.py``). The result shares memory with
    nothing the caller sees. CPU only, as all of cpshard's index math.
    """
    out = expand_np(starts.numpy(), lengths.numpy(), _NP[dtype])
    if total is not None and out.size != total:
        raise AssertionError(f"expand_segments: {out.size} rows, expected {total}")
    return torch.from_numpy(out)


def expand_np(starts: np.ndarray, lengths: np.ndarray, dtype: np.dtype = _INT64) -> np.ndarray:
    """:func:`expand_segments` on NumPy arrays: ``(sum(lengths),)`` of ``dtype``."""
    begin = np.cumsum(lengths) - lengths
    out = np.repeat((starts - begin).astype(dtype, copy=False), lengths)
    out += _arange(out.size, dtype)
    return out


_NP: dict[torch.dtype, np.dtype] = {torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32)}
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


@dataclass(frozen=True)
class Segments:
    """A rank's rows as runs of consecutive positions of one padded sequence, in local order."""

    seq: torch.Tensor  # (K,) sequence id
    pos: torch.Tensor  # (K,) first position inside the padded sequence
    length: torch.Tensor  # (K,) rows
    total: int  # sum(length): the rank's row count

    @property
    def local_start(self) -> torch.Tensor:
        """``(K,)`` local row of each segment's first row."""
        length = self.length.numpy()
        return torch.from_numpy(np.cumsum(length) - length)

    def expand(self, per_segment_start: torch.Tensor) -> torch.Tensor:
        """``(total,)``: ``per_segment_start[k] + j`` for row ``j`` of segment ``k``."""
        return expand_segments(per_segment_start, self.length, self.total)

    def seq_ids(self) -> torch.Tensor:
        return torch.repeat_interleave(self.seq, self.length, output_size=self.total)

    def positions(self) -> torch.Tensor:
        return self.expand(self.pos)

    def rows(self, cu_padded: torch.Tensor) -> torch.Tensor:
        """Global padded row of every local row."""
        return self.expand(cu_padded[self.seq] + self.pos)


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


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """``(len(values),)`` int64 CPU tensor of Python ints (through NumPy: about 4x faster than
    ``torch.tensor`` on a list)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def rank_segments(padded: torch.Tensor, cp_size: int, layout: Layout, rank: int) -> Segments:
    """``rank``'s segments for sequences padded to ``padded`` ``(B,)`` int64 (Note above)."""
    p = padded.numpy()
    b = p.size
    total = int(p.sum())
    local = total // cp_size
    ids = np.arange(b, dtype=np.int64)
    if cp_size == 1:
        return _segments(ids, np.zeros(b, dtype=np.int64), p.copy(), total)
    if layout is Layout.ZIGZAG:
        chunk = p // (2 * cp_size)
        pos = np.stack([rank * chunk, (2 * cp_size - 1 - rank) * chunk], 1).reshape(-1)
        return _segments(np.repeat(ids, 2), pos, np.repeat(chunk, 2), local)
    starts = np.cumsum(p) - p
    lo = starts.clip(rank * local, (rank + 1) * local)
    hi = (starts + p).clip(rank * local, (rank + 1) * local)
    return _segments(ids, lo - starts, hi - lo, local)


def _segments(seq: np.ndarray, pos: np.ndarray, length: np.ndarray, total: int) -> Segments:
    return Segments(torch.from_numpy(seq), torch.from_numpy(pos), torch.from_numpy(length), total)


@dataclass(frozen=True)
class AllSegments:
    """Every rank's segments side by side, rank 0's first: for index math that crosses ranks (the
    sharded-shift and halo exchanges), which every rank derives alike from the plan."""

    rank: torch.Tensor  # (K,) the rank holding each segment
    seq: torch.Tensor  # (K,) sequence id
    pos: torch.Tensor  # (K,) first position inside the padded sequence
    length: torch.Tensor  # (K,) rows
    first: torch.Tensor  # (K,) local row of the segment's first row on its rank

    @staticmethod
    def of(segments: Sequence[Segments]) -> AllSegments:
        return AllSegments(torch.cat([torch.full_like(s.seq, r) for r, s in enumerate(segments)]),
                           torch.cat([s.seq for s in segments]), torch.cat([s.pos for s in segments]),
                           torch.cat([s.length for s in segments]), torch.cat([s.local_start for s in segments]))

    def holder(self, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The segment holding position ``pos`` of sequence ``seq``, for each query (every query must be
        a row some segment holds): one ``searchsorted`` over the non-empty segments sorted by key."""
        end = self.pos + self.length
        stride = int(end.max()) + 1 if end.numel() else 1
        nonempty = torch.nonzero(self.length > 0).flatten()
        if not nonempty.numel():
            return torch.zeros_like(seq)
        keys, order = torch.sort(self.seq[nonempty] * stride + self.pos[nonempty])
        found = torch.searchsorted(keys, seq * stride + pos, right=True) - 1
        return nonempty[order[found.clamp(min=0)]]


def repeat_segments(single: Segments, batch: int) -> Segments:
    """BSHD: the segments of one sequence of length ``M``, repeated for rows ``0 .. batch - 1``."""
    k = single.seq.numel()
    return Segments(torch.arange(batch, dtype=_I64).repeat_interleave(k), single.pos.repeat(batch),
                    single.length.repeat(batch), single.total * batch)


@dataclass(frozen=True)
class ShardIndex:
    """How ``shard`` builds a rank's rows: one gather, then two fills.

    A shift needs no index of its own: output row ``j`` reads input row ``src[j] + shift``, that is
    row ``src[j]`` of the input without its first ``shift`` rows (a view). Only rows whose
    ``src[j]`` lies in the input's last ``shift`` rows would read past that view, and those are all
    fill or pad rows (Note [Which rows a rank holds]); ``safe`` lists the output row ranges free of
    them (``None``: every row), and the gather skips the others, which the fills then write.
    """

    src: torch.Tensor  # (rows,) input row each output row copies, unshifted (clamped where overwritten)
    pad_rows: torch.Tensor  # output rows past their sequence's length: pad_value
    fill_rows: torch.Tensor  # token rows whose shifted source lies past the end: fill
    shift: int = 0
    safe: tuple[tuple[int, int], ...] | None = None


@dataclass(frozen=True)
class RankRows:
    """One rank's segments as NumPy arrays with what every row index of ``shard`` derives from them:
    built once per rank and plan, so the base, pad and fill rows of every shift share the work."""

    seq: np.ndarray  # (K,) sequence id
    pos: np.ndarray  # (K,) first position inside the padded sequence
    length: np.ndarray  # (K,) rows
    begin: np.ndarray  # (K,) local row of the segment's first row
    remaining: np.ndarray  # (K,) the sequence's length minus pos: token rows from the segment's start on
    tokens: np.ndarray  # (K,) the segment's leading token rows; the rest of it is pad
    total: int

    @staticmethod
    def of(segs: Segments, seqlens: torch.Tensor) -> RankRows:
        seq, pos, length = segs.seq.numpy(), segs.pos.numpy(), segs.length.numpy()
        remaining = seqlens.numpy()[seq] - pos
        tokens = np.minimum(np.maximum(remaining, 0), length)
        return RankRows(seq, pos, length, segs.local_start.numpy(), remaining, tokens, segs.total)

    def sourced(self, shift: int) -> np.ndarray:
        """Per segment, its leading token rows whose source ``shift`` ahead exists."""
        return self.tokens if shift == 0 else np.minimum(np.maximum(self.remaining - shift, 0), self.length)

    def pad_rows(self) -> torch.Tensor:
        """Local rows past their sequence's end: the same for every shift."""
        return torch.from_numpy(expand_np(self.begin + self.tokens, self.length - self.tokens))

    def fill_rows(self, shift: int) -> torch.Tensor:
        """Token rows whose source ``shift`` ahead lies past their sequence's end (a few per sequence)."""
        if shift == 0:
            return torch.zeros(0, dtype=_I64)
        sourced = self.sourced(shift)
        return torch.from_numpy(expand_np(self.begin + sourced, self.tokens - sourced))
