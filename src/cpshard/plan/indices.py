"""The index service of one plan: every index tensor derived from it, built on first use and kept.

A plan is a value (``plan.py``); what ``shard``, ``unshard``, ``gather``, the sharded shifts and the
per-rank views need from it are index tensors, derived from its per-rank segments (Note [Which rows
a rank holds] in ``index/segments.py``). :class:`PlanIndices` (``plan.indices()``) builds each on first use
and keeps it, one object per plan, one method per kind of index, so that a training step that
shards tokens, labels and masks and then gathers outputs builds each index once. Pure index math on
the CPU (NumPy); the indices reach other devices through ``_index.to_device``, copied once per
device.

What it keeps, and how much (the ``_BOUND`` most recent entries per kind; a step uses a handful):

==============  ===============================================  ==========================
kind            what                                             key
==============  ===============================================  ==========================
segments        a rank's :class:`~cpshard.index.segments.Segments`       rank
every           every rank's segments side by side (the restore) (one)
view            per-row ids, positions, global rows, label masks rank, what, shift
host            the int32 offsets on the CPU; the rank order     name
device          :class:`~cpshard.plan.DeviceTensors`             device
shard           :class:`~cpshard.index.segments.ShardIndex`              rank, shift, row stride, device
first           per segment, the input row it reads first        rank, row stride
base            the unshifted gather index                       rank, row stride, device
pad             a rank's pad rows                                rank, device
restore         the restore's every-rank order; its runs         (one)
unshard         the restore index; the same by rank (CPU)        device
offsets         the jagged offsets cpshard returns               device
shift_exchange  :class:`~cpshard.index.shift.ShiftExchange`;     rank, shift, device;
                the group's crossing rows                        shift
halo            :class:`~cpshard.index.halo.HaloExchange`;       rank, shifts, device;
                the group's crossing halo rows                   shifts
relayout        where every row goes under a twin plan           the twin
route           :class:`~cpshard.index.route.Route`;             the twin, rank, device;
                the group's moved rows (THD twins)               the twin
blocks          the reference attention's query blocks           rank, device, block size
scan            the reference scan's segments                    (one)
unpadded        the plan of the tokens alone (for ``shift``)     (one)
varlen          a rank's varlen kernel metadata                  rank, window, device
==============  ===============================================  ==========================

The last four are built by the modules that use them (``causal``, ``scan``, ``values``, ``varlen``), through
:meth:`kept_for`.

Not part of the plan's value: equality, hashing and pickling ignore it. Safe to share between
threads: a value is computed outside the lock (it may use the service itself) and the first one
stored wins, so every caller sees one object per key. The lock is re-entrant: looking a key up
hashes it, and the hash of a plan (the key of its twins' indices) is itself kept by its service.
"""

from __future__ import annotations

import hashlib
import math
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from cpshard.base.layout import Layout
from cpshard.index import closed as _closed
from cpshard.index import halo as _halo
from cpshard.index import route as _route
from cpshard.index import segments as _index
from cpshard.index import shift as _exchange

__all__ = ["DeviceTensors", "PlanIndices", "ROWS_PER_RUN"]

_T = TypeVar("_T")
_E = TypeVar("_E", _exchange.ShiftExchange, _halo.HaloExchange)  # what an exchange method keeps
_I32 = torch.int32
_ABOVE = frozenset({"blocks", "scan", "unpadded", "varlen"})  # kinds built by modules above the service (kept_for)
_BOUND = 64  # entries kept per kind (shifts, row strides and devices a program uses; a step needs a few)

ROWS_PER_RUN = 512
"""The restore copies runs of token rows (no row index) where its pieces average this many rows or
more, as under the contiguous layout (about ``B + cp`` pieces); below it (zigzag's ``2 B cp`` short
chunks) one gather by an index is cheaper: each piece costs about a microsecond."""


@dataclass(frozen=True)
class DeviceTensors:
    """A plan's offsets on one device (int32, what attention kernels and ``PackedSeqParams`` take)."""

    seqlens: torch.Tensor  # (B,)
    cu_seqlens: torch.Tensor  # (B + 1,), starting at 0
    cu_seqlens_padded: torch.Tensor  # (B + 1,); for a BshdPlan i * max_seqlen


class Plan(Protocol):
    """What the index service reads of a plan: the value fields and sizes every plan kind has
    (``cpshard.plan.values.Plan``, which sits above this module and owns one service each), and what
    each kind answers for itself (its segments, its padded offsets, its key)."""

    seqlens_py: tuple[int, ...]
    cp_size: int
    tp_size: int
    layout: Layout
    order: tuple[int, ...] | None

    @property
    def local_shape(self) -> tuple[int, ...]: ...
    @property
    def total_len(self) -> int: ...
    @property
    def local_len(self) -> int: ...
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def cu_seqlens_py(self) -> tuple[int, ...]: ...
    @property
    def input_seqlens_py(self) -> tuple[int, ...]: ...
    @property
    def input_cu_seqlens_py(self) -> tuple[int, ...]: ...
    def _cu_padded_py(self) -> tuple[int, ...]: ...
    def _closed_form_work(self) -> list[int] | None: ...
    def _closed_form_restore(self) -> np.ndarray | None: ...
    def _closed_form_restore_by_rank(self) -> tuple[list[np.ndarray], list[int], np.ndarray] | None: ...
    def _rank_segments(self, cp_rank: int, lengths: np.ndarray) -> _index.Segments: ...
    def _split(self) -> tuple[np.ndarray, bool]: ...
    def _key(self) -> tuple[Any, ...]: ...
    def indices(self) -> PlanIndices: ...


class PlanIndices:
    """Every index derived from one plan, built on first use and kept (module docstring)."""

    __slots__ = ("_data", "_lock", "_plan")

    def __init__(self, plan: Plan) -> None:
        # a weak reference: the plan owns its service, and a cycle between them would keep a dropped
        # plan's indices (megabytes at a million tokens) alive until the cyclic collector runs, which
        # then frees them at a random point of some later step
        self._plan = weakref.ref(plan)
        self._data: dict[str, OrderedDict[Hashable, Any]] = {}
        self._lock = threading.RLock()  # re-entered when a key's hash is itself kept (a twin plan)

    @property
    def plan(self) -> Plan:
        plan = self._plan()
        assert plan is not None, "a plan's index service outlived its plan"
        return plan

    def _kept(self, kind: str, key: Hashable, make: Callable[[], _T]) -> _T:
        with self._lock:
            entries = self._data.get(kind)
            if entries is not None and key in entries:
                entries.move_to_end(key)
                return entries[key]
        value = make()
        with self._lock:
            entries = self._data.setdefault(kind, OrderedDict())
            value = entries.setdefault(key, value)
            while len(entries) > _BOUND:
                entries.popitem(last=False)
            return value

    def kept_for(self, kind: str, key: Hashable, make: Callable[[], _T]) -> _T:
        """An index a module above builds itself and the plan keeps: one of the kinds :data:`_ABOVE`
        lists (the table in the module docstring), so that what a plan keeps stays listed in one place."""
        if kind not in _ABOVE:
            raise AssertionError(f"{kind!r} is not a kind a plan keeps for other modules ({sorted(_ABOVE)})")
        return self._kept(kind, key, make)

    def hash_of(self, key: Callable[[], Any]) -> int:
        """The plan's hash, computed once from its value ``key()``."""
        return self._kept("host", "hash", lambda: hash(key()))

    def kept(self) -> dict[str, int]:
        """How many entries each kind holds now (for tests and for a look at a long-running job)."""
        with self._lock:
            return {kind: len(entries) for kind, entries in self._data.items()}

    # -- segments ---------------------------------------------------------------------------

    def lengths(self) -> np.ndarray:
        """``(B,)`` int64 token counts in buffer order (for BSHD, of the batch rows)."""
        return self._kept("host", "lengths", lambda: _index.int64_array(self.plan.seqlens_py))

    def segments(self, cp_rank: int) -> _index.Segments:
        """``cp_rank``'s segments (checked by the caller)."""
        return self._kept("segments", cp_rank, lambda: self.plan._rank_segments(cp_rank, self.lengths()))

    def every(self) -> _index.AllSegments:
        """Every rank's segments side by side, rank 0's first."""
        return self._kept("every", None, lambda: _index.AllSegments.of(
            [self.segments(r) for r in range(self.plan.cp_size)]))

    def view(self, what: str, cp_rank: int, shift: int = 0) -> np.ndarray:
        """``cp_rank``'s flattened rows: ``"seq"`` (sequence ids), ``"pos"`` (positions), ``"rows"``
        (global padded rows, THD) or ``"label"`` (the loss mask of labels shifted by ``shift``)."""
        def make() -> np.ndarray:
            segs = self.segments(cp_rank)
            if what == "seq":
                return segs.seq_ids()
            if what == "pos":
                return segs.positions()
            if what == "rows":
                cu = _index.int64_array(self.plan.cu_seqlens_padded_py)  # type: ignore[attr-defined]
                return segs.expand(cu[segs.seq] + segs.pos)
            if what == "label":  # a token whose source `shift` away exists: 0 <= p + shift < n
                p = segs.positions()
                n = np.repeat(self.lengths()[segs.seq], segs.length)
                return (p < n) & (p + shift < n) & (p + shift >= 0)
            raise AssertionError(what)
        return self._kept("view", (what, cp_rank, shift), make)

    def work(self) -> list[int]:
        """Per rank, the (query, key) pairs its causal attention scores: ``sum(pos + 1)`` over its token
        rows (``causal.attention_work``). With ``tri(x) = x (x + 1) / 2``, the positions ``[s, e)`` of
        a sequence of ``n`` tokens hold ``tri(min(e, n)) - tri(min(s, n))`` pairs, below 2**63 as a
        plan has fewer than 2**31 rows. THD plans in the balancer's closed forms over the sequences
        (no segments; ``ShardPlan._closed_form_work``): ``index.balance.zigzag_works``, and
        ``rank_work`` for the contiguous layout (Note [Causal work under the contiguous layout]). BSHD
        plans per segment."""
        return self._kept("host", "work", self._work)

    def _work(self) -> list[int]:
        closed = self.plan._closed_form_work()  # the plan kind's, where it has one (THD)
        if closed is not None:
            return closed
        out = []
        for r in range(self.plan.cp_size):
            seg = self.segments(r)
            t, p = seg.tokens, seg.pos
            out.append(int((t * p + t * (t + 1) // 2).sum()))
        return out

    # -- offsets ----------------------------------------------------------------------------

    def host(self, name: str) -> torch.Tensor:
        """The plan's int32 offsets ``name`` (``seqlens``, ``cu_seqlens``, ``padded_seqlens``,
        ``cu_seqlens_padded``) as a CPU tensor, built once (shared: not to be edited in place)."""
        return self._kept("host", name, lambda: torch.tensor(getattr(self.plan, f"{name}_py"), dtype=_I32))

    def device_tensors(self, device: torch.device) -> DeviceTensors:
        plan = self.plan

        def make() -> DeviceTensors:
            host = torch.tensor([plan.seqlens_py, plan.cu_seqlens_py[:-1], plan.cu_seqlens_py[1:],
                                 plan._cu_padded_py()[1:]], dtype=_I32)
            if device.type == "cuda":
                host = host.pin_memory()
            on = host.to(device, non_blocking=True)
            zero = on.new_zeros(1)
            return DeviceTensors(on[0], torch.cat([zero, on[2]]), torch.cat([zero, on[3]]))
        return self._kept("device", device, make)

    def offsets(self, device: torch.device) -> torch.Tensor:
        """The caller's ``cu_seqlens`` as int64 on ``device``: the offsets of the jagged tensors cpshard returns."""
        return self._kept("offsets", device, lambda: _index.to_device(
            torch.from_numpy(_index.int64_array(self.plan.input_cu_seqlens_py)), device))

    def fingerprint(self) -> torch.Tensor:
        """``(8,)`` int64 summary of the plan (``cpshard.distributed.plan_fingerprint``), hashed once:
        hashing 100k lengths takes about 40 ms."""
        plan = self.plan

        def make() -> torch.Tensor:
            digest = hashlib.blake2b(repr(plan._key()).encode(), digest_size=16).digest()
            h1, h2 = (int.from_bytes(digest[i:i + 8], "little") >> 1 for i in (0, 8))
            layout = 0 if plan.layout is Layout.ZIGZAG else 1
            alone = self.split()[1]  # a BSHD plan (its rows split alone) or THD
            return torch.tensor([int(alone), plan.cp_size, plan.tp_size, layout, plan.num_seqs,
                                 plan.total_len, h1, h2], dtype=torch.int64)
        return self._kept("host", "fingerprint", make)

    # -- shard ------------------------------------------------------------------------------

    def _first_rows(self, cp_rank: int, row_stride: int | None) -> np.ndarray:
        """Per segment, the input row its first row reads (unshifted). ``row_stride`` is ``S`` for a
        padded ``(B, S, ...)`` input (sequence ``b`` starts at row ``b * S``), or None for packed
        token rows in the caller's order (buffer sequence ``j`` is input sequence ``order[j]``)."""
        plan = self.plan

        def make() -> np.ndarray:
            seg = self.segments(cp_rank)
            if row_stride is None:
                cu = _index.int64_array(plan.input_cu_seqlens_py[:-1])
                starts = cu if plan.order is None else cu[np.array(plan.order)]
            else:
                starts = np.arange(plan.num_seqs, dtype=np.int64) * row_stride
            return starts[seg.seq] + seg.pos
        return self._kept("first", (cp_rank, row_stride), make)

    def _input_rows(self, row_stride: int | None) -> int:
        return self.plan.num_tokens if row_stride is None else self.plan.num_seqs * row_stride

    def _base(self, cp_rank: int, row_stride: int | None, device: torch.device) -> torch.Tensor:
        # Every shift's gather reads this index from a shifted view of the input (ShardIndex). int32
        # where the input has fewer than 2**31 rows (every packed input: a plan's offsets are int32):
        # half the memory traffic of int64, and index_select takes it. A padded (B, S) input wider
        # than the plan can have more rows (B * S): int64 there, never a wrapped index. Pad rows of
        # the last sequences may point past the input: clamped, segment by segment.
        def make() -> torch.Tensor:
            seg = self.segments(cp_rank)
            rows = self._input_rows(row_stride)
            first = self._first_rows(cp_rank, row_stride)
            src = _index.expand_np(first, seg.length, np.dtype(np.int32 if rows < 2**31 else np.int64))
            last = max(rows - 1, 0)
            over = np.flatnonzero(first + seg.length - 1 > last)
            if over.size > 8:
                np.minimum(src, last, out=src)
            else:
                for lo, n in zip(seg.start[over].tolist(), seg.length[over].tolist()):
                    np.minimum(src[lo:lo + n], last, out=src[lo:lo + n])
            return _index.to_device(torch.from_numpy(src), device)
        return self._kept("base", (cp_rank, row_stride, device), make)

    def _safe_ranges(self, cp_rank: int, shift: int, row_stride: int | None) -> tuple[tuple[int, int], ...] | None:
        # Output rows whose unshifted source lies in the input's last `shift` rows (the only ones a
        # shifted view cannot serve): per segment, from the first such row to the segment's end
        # (its later rows are pad rows, clamped to the last input row). Work over segments only.
        seg = self.segments(cp_rank)
        first = self._first_rows(cp_rank, row_stride)
        start = np.maximum(self._input_rows(row_stride) - shift - first, 0)
        hit = np.flatnonzero(start < seg.length)
        if not hit.size:
            return None
        begin = seg.start[hit]
        bad = np.stack([begin + start[hit], begin + seg.length[hit]], 1).tolist()
        out, at = [], 0
        for lo, hi in sorted(bad):
            if lo > at:
                out.append((at, lo))
            at = max(at, hi)
        if at < seg.total:
            out.append((at, seg.total))
        return tuple(out)

    def shard(self, cp_rank: int, shift: int, device: torch.device, row_stride: int | None = None) -> _index.ShardIndex:
        """Gather and fill rows of ``cp_rank``'s flattened local rows, on ``device``.

        A look-ahead (``shift >= 0``) reads the unshifted index from a shifted view of the input
        (:class:`~cpshard.index.segments.ShardIndex`); a look-back (``shift < 0``) has an index of its own,
        the unshifted one minus ``-shift`` (clamped at the first row: the first ``-shift`` token rows
        of each sequence are fill rows)."""
        def make() -> _index.ShardIndex:
            seg = self.segments(cp_rank)
            pad = self._kept("pad", (cp_rank, device),
                             lambda: _index.to_device(torch.from_numpy(seg.pad_rows()), device))
            fill = _index.to_device(torch.from_numpy(seg.fill_rows(shift)), device)
            if shift < 0:
                rows = self._input_rows(row_stride)
                first = self._first_rows(cp_rank, row_stride) + shift
                back = _index.expand_np(first, seg.length, np.dtype(np.int32 if rows < 2**31 else np.int64))
                np.clip(back, 0, max(rows - 1, 0), out=back)
                return _index.ShardIndex(_index.to_device(torch.from_numpy(back), device), pad, fill)
            safe = self._safe_ranges(cp_rank, shift, row_stride) if shift else None
            return _index.ShardIndex(self._base(cp_rank, row_stride, device), pad, fill, shift, safe)
        return self._kept("shard", (cp_rank, shift, row_stride, device), make)

    # -- restore ----------------------------------------------------------------------------

    def _restore_order(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's held segments side by side, rank 0's first: ``(rank, start, length, tokens,
        order)``, with ``order`` the segments holding tokens in the caller's (sequence, position) order.

        Sorted so, the segments' token rows tile the batch's tokens in order: what the restore copies
        (by runs, :meth:`runs`) or gathers (by an index, :meth:`unshard`), without a permutation of
        the whole padded buffer.
        """
        plan = self.plan

        def make() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            every = self.every()
            held = np.flatnonzero(every.length)  # contiguous: most (rank, sequence) segments are empty
            rank, start, length, tokens, seq, pos = (getattr(every, f)[held] for f in
                                                     ("rank", "start", "length", "tokens", "seq", "pos"))
            caller = seq if plan.order is None else np.array(plan.order, dtype=np.int64)[seq]
            stride = int((pos + length).max()) + 1 if pos.size else 1
            order = np.argsort(caller * stride + pos, kind="stable")
            return rank, start, length, tokens, order[tokens[order] > 0]
        return self._kept("restore", "order", make)

    def unshard(self, device: torch.device) -> torch.Tensor:
        """``(N,)`` int32: the row of the rank-concatenated flat buffer (``cat`` of every rank's flattened
        local rows) that holds each token, tokens in the caller's order (int32, as a plan's buffers
        hold fewer than 2**31 rows). One expansion of the segments of :meth:`_restore_order`, or, for
        plans whose segments average fewer than 16 tokens, the plan kind's closed form per token
        (:func:`~cpshard.index.closed.thd_restore`, ``plan.bshd``'s): it builds no segments of every
        rank (for long segments their one expansion is cheaper)."""
        plan = self.plan

        def make() -> torch.Tensor:
            index = plan._closed_form_restore() if _segments_per_token(plan) > 1 / 16 else None
            if index is None:
                rank, start, _, tokens, order = self._restore_order()
                first = rank * math.prod(plan.local_shape) + start
                index = _index.expand_np(first[order], tokens[order], np.dtype(np.int32))
            return _index.to_device(torch.from_numpy(index), device)
        return self._kept("unshard", device, make)

    def unshard_by_rank(self) -> tuple[list[torch.Tensor], list[int], torch.Tensor]:
        """The restore from the ranks' parts without concatenating them: ``(rows, bounds, back)`` such
        that, with ``grouped[bounds[r]:bounds[r + 1]] = part[r][rows[r]]`` (rank ``r``'s token rows, in
        an order of the index's making), ``grouped[back]`` is :meth:`unshard`'s gather (CPU, int32).

        Concatenating the parts copies every padded row (four times the tokens of a batch of 1..64
        tokens at cp = 64, zigzag); this reads the token rows alone, twice. The plan kind's closed form
        where it has one (zigzag with one chunk size, :func:`~cpshard.index.closed.zigzag_by_rank`: no
        index of every token, no sort of the tokens), else one stable sort of :meth:`unshard`'s index
        by rank (a radix sort of 16-bit keys; the rows of a rank in the caller's order).
        """
        plan = self.plan

        def make() -> tuple[list[torch.Tensor], list[int], torch.Tensor]:
            grouped = plan._closed_form_restore_by_rank()
            if grouped is not None:
                local, bounds, back = grouped
                return [torch.from_numpy(rows) for rows in local], bounds, torch.from_numpy(back)
            flat = self.unshard(torch.device("cpu")).numpy()
            cp, rows = plan.cp_size, math.prod(plan.local_shape)
            rank = flat // max(rows, 1)
            order = np.argsort(rank.astype(np.uint16) if cp <= 1 << 16 else rank, kind="stable")
            counts = np.bincount(rank, minlength=cp)
            local = flat[order]
            local -= np.repeat((np.arange(cp, dtype=np.int64) * rows).astype(flat.dtype), counts)
            back = np.empty(order.size, dtype=np.int32)
            back[order] = np.arange(order.size, dtype=np.int32)
            bounds = [0, *np.cumsum(counts).tolist()]
            return ([torch.from_numpy(local[a:b]) for a, b in zip(bounds[:-1], bounds[1:])], bounds,
                    torch.from_numpy(back))
        return self._kept("unshard", "by rank", make)

    def runs(self, rows_per_run: int = ROWS_PER_RUN) -> tuple[list[list[int]], list[int]] | None:
        """The restore as runs: ``(sizes, keep)`` such that, with ``pieces`` the concatenation of
        ``part[r].split(sizes[r])`` over the ranks' flat rows, ``cat([pieces[i] for i in keep])`` is
        :meth:`unshard`'s gather; or None where the pieces average fewer than ``rows_per_run`` rows
        (:data:`ROWS_PER_RUN`).

        ``sizes[r]`` cut rank ``r``'s rows into each held segment's token rows and pad rows, in local
        order; ``keep`` lists the token pieces in the caller's (sequence, position) order. None too for
        a plan of no tokens.
        """
        def make() -> tuple[list[list[int]], list[int]]:
            rank, _, length, tokens, order = self._restore_order()
            cuts = np.stack([tokens, length - tokens], 1)
            bounds = np.searchsorted(rank, np.arange(self.plan.cp_size + 1))
            sizes = [cuts[a:b].reshape(-1).tolist() for a, b in zip(bounds[:-1], bounds[1:])]
            return sizes, (2 * order).tolist()
        pieces = self.held()
        if not pieces or not self.plan.num_tokens or 2 * pieces * rows_per_run > self.plan.num_tokens:
            return None  # no runs to copy (a batch of empty sequences gathers its zero rows by the index)
        return self._kept("restore", "runs", make)

    def held(self) -> int:
        """How many non-empty segments every rank holds together (the restore's pieces), in closed form
        (``_index.held_segments``): :meth:`runs` asks it first, and builds every rank's segments only
        where the runs are long enough to use (a plan of 100,000 short sequences at cp = 64 has 12.8M
        zigzag chunks, which take seconds to build and are never read)."""
        plan = self.plan

        def make() -> int:
            padded, alone = self.split()
            return _index.held_segments(padded, plan.cp_size, plan.layout, alone)
        return self._kept("host", "held", make)

    # -- exchanges --------------------------------------------------------------------------

    def canonical(self, cp_rank: int) -> np.ndarray:
        """``(R,)`` int64: each of ``cp_rank``'s flattened local rows as its row of the padded buffer laid
        out in the caller's order (Note [Twin plans and their route] in ``twins.py``): a row at padded
        position ``p`` of caller's sequence ``i`` is ``cu_padded_caller[i] + p``. Not kept: the
        permutation built from it is."""
        segs = self.segments(cp_rank)
        return segs.expand(self._caller_starts()[segs.seq] + segs.pos)

    def _caller_starts(self) -> np.ndarray:
        """Per buffer sequence, its first row in the caller's padded buffer (:meth:`canonical`'s numbering)."""
        plan = self.plan
        cu = _index.int64_array(plan._cu_padded_py())  # buffer order
        start = cu[:-1]
        if plan.order is not None:  # buffer sequence j is the caller's order[j]
            order = np.array(plan.order, dtype=np.int64)
            caller = np.empty_like(start)
            caller[order] = np.diff(cu)
            start = np.concatenate([[0], np.cumsum(caller)])[order]
        return start

    def permutation(self, dst: Plan) -> tuple[np.ndarray, np.ndarray, int]:
        """Where every rank's rows go under the twin ``dst`` (``route.permutation``): two
        ``(cp * R,)`` int64 arrays, kept for a few twins."""
        def make() -> tuple[np.ndarray, np.ndarray, int]:
            cp = self.plan.cp_size
            src_rows = np.concatenate([self.canonical(r) for r in range(cp)])
            dst_rows = np.concatenate([dst.indices().canonical(r) for r in range(cp)])
            return _route.permutation(src_rows, dst_rows, cp, math.prod(self.plan.local_shape))
        return self._kept("relayout", dst, make)

    def relayout(self, dst: Plan, cp_rank: int, device: torch.device) -> _route.Route:
        """``cp_rank``'s :class:`~cpshard.index.route.Route` from this plan's rows to the twin ``dst``'s."""
        def make() -> _route.Route:
            if device.type != "cpu":
                return self.relayout(dst, cp_rank, torch.device("cpu")).to(device)
            plan, rows = self.plan, math.prod(self.plan.local_shape)
            (padded, alone), (dst_padded, dst_alone) = self.split(), dst.indices().split()
            if not (alone or dst_alone or self.unequal_chunks() or dst.indices().unequal_chunks()):
                # THD twins of equal zigzag chunks: this rank's rows, by closed forms (index/closed.py)
                moved = self._kept("route", ("moved", dst), lambda: _closed.thd_moved(plan, dst, (padded, dst_padded)))
                return _route.rank_route(_closed.thd_rows(dst, self.canonical(cp_rank), dst_padded),
                                         _closed.thd_rows(plan, dst.indices().canonical(cp_rank), padded),
                                         moved, plan.cp_size, rows, cp_rank)
            return _route.build_route(*self.permutation(dst), plan.cp_size, rows, cp_rank)
        return self._kept("route", (dst, cp_rank, device), make)

    def rank_order(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rearrange, restore)``, two ``(T,)`` int64 arrays of a THD plan, kept: ``rearrange[k]`` is the
        row of the caller's padded buffer (each sequence padded to its padded length, in the caller's
        order: :meth:`canonical`'s numbering) that rank-concatenated row ``k`` holds (rank 0's local
        rows, then rank 1's, ...), and ``restore`` its inverse. What a load balancer that rearranges
        the caller's buffer before cutting it into ``cp`` equal pieces hands its framework
        (``cpshard.compat.torch_cp``). Over the rows at once, by the closed forms of
        ``index/closed.py`` (no rank's segments); zigzag's from its held chunks, of any sizes."""
        def make() -> tuple[np.ndarray, np.ndarray]:
            total = self.plan.total_len
            every = np.arange(total, dtype=np.int64)
            if self.plan.layout is Layout.ZIGZAG and self.plan.cp_size > 1:  # every rank's chunks at once
                seq, rank, start, length = _index.zigzag_held(self.split()[0], self.plan.cp_size)
                by_rank = np.argsort(rank.astype(np.uint16) if rank.size and rank.max() < 1 << 16 else rank,
                                     kind="stable")  # a radix sort of 16-bit keys
                rearrange = _index.expand_np((self._caller_starts()[seq] + start)[by_rank], length[by_rank])
                return rearrange, np.argsort(rearrange, kind="stable")
            restore = _closed.thd_rows(self.plan, every, self.split()[0])
            rearrange = np.empty(total, dtype=np.int64)
            rearrange[restore] = every
            return rearrange, restore
        return self._kept("host", "rank_order", make)

    def split(self) -> tuple[np.ndarray, bool]:
        """``(padded, alone)``: the padded lengths in buffer order (int64) and whether each sequence
        is split over the ranks on its own (a BSHD row) rather than the buffer as a whole (THD): what
        the closed forms of the exchanges read (the plan kind's ``_split``)."""
        return self._kept("host", "split", self.plan._split)

    def unequal_chunks(self) -> bool:
        """Whether some zigzag chunks differ in size (``padding="none"``): ``index/closed.py`` then does not apply."""
        def make() -> bool:
            padded, alone = self.split()
            return not alone and _index.unequal_chunks(padded, self.plan.cp_size, self.plan.layout)
        return self._kept("host", "unequal", make)

    def near(self, cp_rank: int, span: int) -> _index.AllSegments:
        """The segments of ``cp_rank`` and of every rank holding a row within ``span`` positions of one
        of its rows (``index.shift.reach``): all that its shift or halo exchange reads, a few ranks'
        where the whole group's would be ``cp`` times as many."""
        padded, alone = self.split()
        plan = self.plan
        ranks = _exchange.reach(padded, self.lengths(), plan.cp_size, plan.layout, alone, cp_rank, span)
        return _index.AllSegments.of([self.segments(r) for r in ranks], ranks)

    def shift_exchange(self, cp_rank: int, shift: int, device: torch.device) -> _exchange.ShiftExchange:
        """What ``cp_rank`` sends, receives and copies locally to shift a sharded tensor by ``shift``:
        from its own segments and its neighbours' (:meth:`near`), the group's count in closed form
        (``index.shift.remote_rows``)."""
        def make() -> _exchange.ShiftExchange:
            remote = self._crossing("shift_exchange", shift, _exchange.remote_rows)
            return _exchange.build_shift_exchange(self.near(cp_rank, abs(shift)), self.segments(cp_rank), cp_rank,
                                                  shift, self.plan.cp_size, remote)
        return self._exchange("shift_exchange", (cp_rank, shift), device, make)

    def halo(self, cp_rank: int, shifts: tuple[int, ...], device: torch.device) -> _halo.HaloExchange:
        """What ``cp_rank`` sends, receives and gathers to shift sharded tensors by every shift in
        ``shifts``: from its own segments and its neighbours' (:meth:`near`), the group's count in
        closed form (``index.halo.remote_halo_rows``)."""
        def make() -> _halo.HaloExchange:
            remote = self._crossing("halo", shifts, _halo.remote_halo_rows)
            span = max((abs(k) for k in shifts), default=0)
            return _halo.build_halo_exchange(self.near(cp_rank, span), self.segments(cp_rank), self.lengths(),
                                             cp_rank, shifts, self.plan.cp_size, remote)
        return self._exchange("halo", (cp_rank, shifts), device, make)

    def _exchange(self, kind: str, key: tuple[Any, ...], device: torch.device, build: Callable[[], _E]) -> _E:
        """The exchange ``kind`` of ``key`` on ``device``, kept: ``build`` makes it on the CPU, and another
        device's is a copy of the CPU one."""
        def make() -> _E:
            return build() if device.type == "cpu" else self._exchange(kind, key, torch.device("cpu"), build).to(device)
        return self._kept(kind, (*key, device), make)

    def _crossing(self, kind: str, shifts: Any, count: Callable[..., int]) -> int:
        """How many rows cross ranks in the whole group for the exchange ``kind`` of ``shifts``, kept:
        ``count`` (``index.shift.remote_rows``, ``index.halo.remote_halo_rows``) over the sequences."""
        plan = self.plan
        padded, alone = self.split()
        return self._kept(kind, ("crossing", shifts), lambda: count(padded, self.lengths(), plan.cp_size, plan.layout,
                                                                      alone, shifts))


def _segments_per_token(plan: Any) -> float:
    """How many segments every rank's lists hold per token (each rank lists every sequence: one
    segment under contiguous, two chunks under zigzag), known before any is built."""
    per_seq = 2 if plan.layout is Layout.ZIGZAG and plan.cp_size > 1 else 1
    return plan.num_seqs * plan.cp_size * per_seq / max(plan.num_tokens, 1)
