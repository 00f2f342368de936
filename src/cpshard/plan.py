"""The shard plan: one immutable description of a packed (THD) micro-batch's context-parallel layout.

Everything cpshard does to a THD batch (shard, shift, unshard, gather, exchange boundary rows) is
derived from a :class:`ShardPlan`, so tokens, labels, loss masks, router indices and model outputs
of one step can never disagree about which rank holds which row.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from cpshard import _index
from cpshard._errors import check_int, check_rank, fail
from cpshard._exchange import Exchange, build_exchange
from cpshard.layout import Layout, alignment, fp8_alignment, fp8_total_alignment

__all__ = ["PlanCache", "ShardPlan", "parse_plan_args", "parse_seqlens"]

_I32 = torch.int32


def parse_seqlens(seqlens: Any, name: str = "seqlens") -> tuple[int, ...]:
    """Sequence lengths as a tuple of Python ints, from ints, a 1-D integer tensor or a jagged tensor.

    A tensor costs exactly one device-to-host copy here; nothing later reads lengths back.
    """
    values: list[Any]
    if isinstance(seqlens, torch.Tensor) and seqlens.is_meta:
        fail(name, "a tensor on the meta device", "must hold real values", "pass the lengths on a real device")
    if isinstance(seqlens, torch.Tensor) and seqlens.is_nested:
        values = list(jagged_lengths(seqlens, name))
    elif isinstance(seqlens, torch.Tensor):
        if seqlens.dim() != 1:
            fail(name, f"tensor of shape {tuple(seqlens.shape)}", "must be 1-D, one length per sequence",
                 "pass a (B,) tensor or a list of ints")
        if seqlens.dtype.is_floating_point or seqlens.dtype.is_complex or seqlens.dtype == torch.bool:
            fail(name, f"tensor of dtype {seqlens.dtype}", "must hold integers",
                 "pass an integer tensor (e.g. torch.int32) or a list of ints", kind=TypeError)
        values = seqlens.tolist()
    elif hasattr(seqlens, "tolist") and getattr(seqlens, "ndim", None) == 1:  # a NumPy array
        values = list(seqlens.tolist())
    elif isinstance(seqlens, (str, bytes)) or not isinstance(seqlens, Sequence):
        fail(name, repr(seqlens), "must be a sequence of ints or a 1-D integer tensor",
             "pass e.g. seqlens=[5, 3]", kind=TypeError)
    else:
        values = list(seqlens)
    if not values:
        fail(name, seqlens, "must hold at least one sequence (B >= 1)", "pass the lengths of a non-empty batch")
    out = []
    for i, n in enumerate(values):
        if isinstance(n, bool) or not hasattr(type(n), "__index__"):
            fail(f"{name}[{i}]", repr(n), "must be an integer", "pass whole token counts", kind=TypeError)
        n = int(n)
        if n < 0:
            fail(f"{name}[{i}]", n, "must be >= 0 (a length counts tokens)", "drop or fix the negative length")
        out.append(n)
    return tuple(out)


def _jagged_offsets(nt: torch.Tensor, name: str) -> torch.Tensor:
    """The offsets of a compact jagged nested tensor (checks layout, holes, ragged dim; no device copy)."""
    if nt.layout != torch.jagged:
        fail(name, f"nested tensor with layout={nt.layout}", "must use layout=torch.jagged",
             "build it with torch.nested.nested_tensor(..., layout=torch.jagged) or pass a list", kind=TypeError)
    if getattr(nt, "_lengths", None) is not None:
        fail(name, "non-contiguous jagged tensor", "must have no holes (lengths=None)",
             "call torch.nested.nested_tensor_from_jagged(values, offsets) with compact values")
    ragged = getattr(nt, "_ragged_idx", 1)
    if ragged != 1:
        fail(name, f"nested tensor of shape {tuple(nt.shape)} with its ragged dimension at {ragged}",
             "the ragged (sequence) dimension must be dimension 1", "transpose it back before sharding")
    return nt.offsets()  # type: ignore[attr-defined]


def jagged_lengths(nt: torch.Tensor, name: str) -> tuple[int, ...]:
    """The sequence lengths of a compact jagged nested tensor: one device-to-host copy."""
    offsets = _jagged_offsets(nt, name).tolist()
    if offsets[0] != 0:
        fail(name, f"nested tensor with offsets starting at {offsets[0]}", "offsets must start at 0",
             "build it with nested_tensor_from_jagged(values, offsets) where offsets[0] == 0")
    return tuple(b - a for a, b in zip(offsets[:-1], offsets[1:]))


def parse_plan_args(seqlens: Any, cp_size: Any, tp_size: Any, layout: Any,
                    fp8: Any) -> tuple[tuple[int, ...], int, int, Layout, bool]:
    """Validate the arguments every plan builder shares."""
    lens = parse_seqlens(seqlens)
    cp_size = check_int("cp_size", cp_size, minimum=1)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    layout = Layout.parse(layout)
    if not isinstance(fp8, bool):
        fail("fp8", repr(fp8), "must be a bool", "pass fp8=True or fp8=False", kind=TypeError)
    return lens, cp_size, tp_size, layout, fp8


class PlanCache:
    """Per-plan memo of derived index tensors (keyed by rank, shift, device), and value semantics.

    Subclasses are frozen dataclasses with a ``_cache`` dict field and a ``_key()`` of Python values.
    """

    _cache: dict[Any, Any]

    def _remember_offsets(self, nt: Any) -> None:
        """Record that a jagged tensor's offsets match this plan, so ``shard`` need not re-read them.

        Keyed by identity and checked against the tensor's version counter, so offsets rewritten in
        place are read again. Only the few most recent are kept.
        """
        if not (isinstance(nt, torch.Tensor) and nt.is_nested):
            return
        offsets = nt.offsets()  # type: ignore[attr-defined]
        known = self._memo("known-offsets", dict)
        known[id(offsets)] = (weakref.ref(offsets), offsets._version)
        while len(known) > 16:
            del known[next(iter(known))]

    def _offsets_known(self, offsets: torch.Tensor) -> bool:
        entry = self._cache.get("known-offsets", {}).get(id(offsets))
        return entry is not None and entry[0]() is offsets and entry[1] == offsets._version

    def __getstate__(self) -> dict[str, Any]:
        # Pickle the plan, not its caches (device tensors, weak references): they are rebuilt on demand.
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def _memo(self, key: Any, make: Any) -> Any:
        try:
            return self._cache[key]
        except KeyError:
            value = self._cache[key] = make()
            return value

    def _key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlanCache) and type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _padded_lengths(
    seqlens: tuple[int, ...],
    cp_size: int,
    tp_size: int,
    layout: Layout,
    fp8: bool,
    min_local_rows: int | None,
    length_bucket: int | None,
) -> tuple[int, tuple[int, ...]]:
    """``(per-sequence alignment, padded lengths)`` per SPEC.md, "Padding".

    The extensions (fp8 total, ``min_local_rows``, ``length_bucket``) only lengthen the last
    sequence, each by a multiple of the per-sequence alignment, so every invariant still holds; a
    target that would break one is rounded up to the nearest one that keeps them all, and under fp8
    every target is also kept a multiple of the fp8 total alignment.
    """
    base = alignment(cp_size, tp_size, layout)
    unit = fp8_alignment(base) if fp8 else base
    padded = [_round_up(n, unit) for n in seqlens]
    total = sum(padded)
    keep = math.lcm(unit, fp8_total_alignment(base)) if fp8 else unit
    if fp8:
        total = _round_up(total, keep)
    if min_local_rows is not None:
        total = max(total, _round_up(min_local_rows * cp_size, keep))
    if length_bucket is not None:
        total = _round_up(total, math.lcm(length_bucket, cp_size, keep))
    padded[-1] += total - sum(padded)
    return unit, tuple(padded)


@dataclass(frozen=True, eq=False, repr=False)
class ShardPlan(PlanCache):
    """Which rows of a packed (THD) micro-batch each context-parallel rank holds.

    Build it with :meth:`ShardPlan.build`. Every offset is kept as Python ints (``*_py``; host
    code never syncs) and as int32 CPU tensors (what Megatron's ``PackedSeqParams`` and
    TransformerEngine take). Index tensors derived from it are cached per rank and device.

    Example, SPEC.md's ``ShardPlan.build([5, 3], cp_size=2)`` (zigzag, ``a = 2 * cp * tp = 4``)::

        padded_seqlens    = [8, 4]        cu_seqlens_padded = [0, 8, 12]
        total_len  T = 12                 local_len  L = 6         max_seqlen = 8

        global  : s0p0 s0p1 s0p2 s0p3 s0p4 pad  pad  pad  | s1p0 s1p1 s1p2 pad
        rank 0  : s0p0 s0p1 | pad  pad  | s1p0 | pad        (chunks 0 and 3 of each sequence)
        rank 1  : s0p2 s0p3 | s0p4 pad  | s1p1 | s1p2       (chunks 1 and 2)

        global_rows(0) = [0, 1, 6, 7, 8, 11]    global_rows(1) = [2, 3, 4, 5, 9, 10]

    ``cpshard plan --lengths 5,3 --cp 2`` prints the same picture.
    """

    seqlens_py: tuple[int, ...]
    padded_seqlens_py: tuple[int, ...]
    cp_size: int
    tp_size: int = 1
    layout: Layout = Layout.ZIGZAG
    alignment: int = 1
    _cache: dict[Any, Any] = field(init=False, repr=False, compare=False)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        seqlens: Sequence[int] | torch.Tensor,
        *,
        cp_size: int,
        tp_size: int = 1,
        layout: Layout | str = Layout.ZIGZAG,
        fp8: bool = False,
        min_local_rows: int | None = None,
        length_bucket: int | None = None,
    ) -> ShardPlan:
        """Plan a micro-batch of sequences with lengths ``seqlens`` (ints or a ``(B,)`` int tensor).

        ``fp8`` pads each sequence to ``lcm(16, a)`` and the total to ``a * 128``;
        ``min_local_rows`` makes every rank hold at least that many rows; ``length_bucket`` makes
        the total a multiple of ``lcm(length_bucket, cp_size)``. Extensions lengthen only the last
        sequence and are rounded up until every invariant holds.
        """
        lens, cp_size, tp_size, layout, fp8 = parse_plan_args(seqlens, cp_size, tp_size, layout, fp8)
        if min_local_rows is not None:
            min_local_rows = check_int("min_local_rows", min_local_rows, minimum=0)
        if length_bucket is not None:
            length_bucket = check_int("length_bucket", length_bucket, minimum=1)
        unit, padded = _padded_lengths(lens, cp_size, tp_size, layout, fp8, min_local_rows, length_bucket)
        plan = cls(lens, padded, cp_size, tp_size, layout, unit)
        plan._remember_offsets(seqlens)
        return plan

    def __post_init__(self) -> None:
        # Runs for hand-built plans too (and dataclasses.replace): an invalid plan cannot exist, and
        # every plan starts with its own empty cache.
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "layout", Layout.parse(self.layout))
        cp, tp = check_int("cp_size", self.cp_size, minimum=1), check_int("tp_size", self.tp_size, minimum=1)
        lens, padded = tuple(self.seqlens_py), tuple(self.padded_seqlens_py)
        object.__setattr__(self, "seqlens_py", lens)
        object.__setattr__(self, "padded_seqlens_py", padded)
        if len(lens) != len(padded) or not lens:
            fail("padded_seqlens_py", padded, f"must hold one length per sequence ({len(lens)})",
                 "build plans with ShardPlan.build")
        for i, (n, p) in enumerate(zip(lens, padded)):
            if n < 0 or p < n:
                fail(f"padded_seqlens_py[{i}]", p, f"must be >= the sequence length {n} >= 0",
                     "build plans with ShardPlan.build")
        total = sum(padded)
        if total >= 2**31:
            fail("seqlens", f"a batch of {total} padded rows", "must stay below 2**31 (cu_seqlens are int32, as "
                 "Megatron and TransformerEngine take them)", "split the micro-batch")
        if total % cp or (total // cp) % tp:
            fail("padded_seqlens_py", padded, f"total {total} must split into cp_size={cp} equal parts "
                 f"each divisible by tp_size={tp}", "build plans with ShardPlan.build")
        if self.layout is Layout.ZIGZAG and cp > 1 and any(p % (2 * cp) for p in padded):
            fail("padded_seqlens_py", padded, f"every zigzag length must divide by 2 * cp_size = {2 * cp}",
                 "build plans with ShardPlan.build")

    # -- sizes and offsets -----------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens_py)

    @property
    def num_tokens(self) -> int:
        """Token rows in the batch, ``sum(seqlens)``."""
        return self.cu_seqlens_py[-1]

    @property
    def total_len(self) -> int:
        """Rows of the global padded buffer, ``T = sum(padded_seqlens)``."""
        return self.cu_seqlens_padded_py[-1]

    @property
    def local_len(self) -> int:
        """Rows each rank holds, ``L = T / cp_size`` (divisible by ``tp_size``)."""
        return self.total_len // self.cp_size

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Leading shape of a rank's local tensor: ``(local_len,)``."""
        return (self.local_len,)

    @property
    def max_seqlen(self) -> int:
        """Longest padded sequence (what attention kernels take as ``max_seqlen``)."""
        return max(self.padded_seqlens_py)

    @cached_property
    def cu_seqlens_py(self) -> tuple[int, ...]:
        return _cumsum(self.seqlens_py)

    @cached_property
    def cu_seqlens_padded_py(self) -> tuple[int, ...]:
        return _cumsum(self.padded_seqlens_py)

    @property
    def seqlens(self) -> torch.Tensor:
        """``(B,)`` int32, a new CPU tensor on every access (the plan's own values cannot be edited)."""
        return torch.tensor(self.seqlens_py, dtype=_I32)

    @property
    def padded_seqlens(self) -> torch.Tensor:
        """``(B,)`` int32."""
        return torch.tensor(self.padded_seqlens_py, dtype=_I32)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``(B + 1,)`` int32, starting at 0."""
        return torch.tensor(self.cu_seqlens_py, dtype=_I32)

    @property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """``(B + 1,)`` int32, starting at 0."""
        return torch.tensor(self.cu_seqlens_padded_py, dtype=_I32)

    @property
    def padding_overhead(self) -> float:
        """Pad rows over token rows (0.0 when nothing is padded)."""
        return (self.total_len - self.num_tokens) / max(self.num_tokens, 1)

    # -- per-rank views (CPU, int64) -------------------------------------------------------

    # Each per-rank view is a new CPU tensor (a copy of the cached one): editing it cannot change
    # the plan. Move it to the device once per step, like any other input.

    def global_rows(self, rank: int) -> torch.Tensor:
        """``(L,)`` int64: the global padded row each of ``rank``'s local rows holds."""
        return self._per_rank("rows", rank, lambda segs: segs.rows(self._i64("cu_padded"))).clone()

    def sequence_ids(self, rank: int) -> torch.Tensor:
        """``(L,)`` int64: the sequence each local row belongs to (pad rows included)."""
        return self._per_rank("seq", rank, lambda segs: segs.seq_ids()).clone()

    def position_ids(self, rank: int) -> torch.Tensor:
        """``(L,)`` int64: each local row's position inside its padded sequence."""
        return self._per_rank("pos", rank, lambda segs: segs.positions()).clone()

    def token_mask(self, rank: int) -> torch.Tensor:
        """``(L,)`` bool: True on token rows, False on pad rows."""
        return self.position_ids(rank) < self._i64("lens")[self.sequence_ids(rank)]

    # -- internals ---------------------------------------------------------------------------

    def _i64(self, what: str) -> torch.Tensor:
        source = {"lens": self.seqlens_py, "padded": self.padded_seqlens_py,
                  "cu": self.cu_seqlens_py, "cu_padded": self.cu_seqlens_padded_py}[what]
        return self._memo(("i64", what), lambda: torch.tensor(source, dtype=torch.int64))

    def _segments(self, rank: int) -> _index.Segments:
        """``rank``'s rows as segments (Note [Which rows a rank holds] in ``_index.py``)."""
        return self._memo(("segs", rank), lambda: _index.rank_segments(
            self._i64("padded"), self.cp_size, self.layout, rank))

    def _per_rank(self, what: str, rank: int, make: Any) -> torch.Tensor:
        rank = check_rank(rank, self.cp_size)
        return self._memo((what, rank), lambda: make(self._segments(rank)))

    def _shard_index(self, rank: int, shift: int, device: torch.device) -> _index.ShardIndex:
        """Cached gather and fill rows on ``device`` for ``shard`` of packed token input."""
        return self._memo(("shard", rank, shift, device), lambda: _index.shard_index(
            self._segments(rank), self._i64("lens"), self._i64("cu"), shift, self.num_tokens).to(device))

    def _exchange(self, rank: int, shift: int, device: torch.device) -> Exchange:
        """Cached rows ``rank`` sends and receives for a sharded shift (Note [Sharded shift exchange])."""
        return self._memo(("exchange", rank, shift, device), lambda: build_exchange(
            [self._segments(r) for r in range(self.cp_size)], self._i64("lens"), rank, shift).to(device))

    def _unshard_index(self, device: torch.device) -> torch.Tensor:
        """Cached ``(N,)``: row of the rank-concatenated buffer holding each token, in token order."""
        def make() -> torch.Tensor:
            segs = [self._segments(r) for r in range(self.cp_size)]
            start = torch.cat([r * self.local_len + s.local_start for r, s in enumerate(segs)])
            return _index.token_gather_index(
                torch.cat([s.seq for s in segs]), torch.cat([s.pos for s in segs]),
                torch.cat([s.length for s in segs]), start, self._i64("lens"), self.num_tokens).to(device)
        return self._memo(("unshard", device), make)

    def _offsets(self, device: torch.device) -> torch.Tensor:
        """``cu_seqlens`` as int64 on ``device`` (the offsets of jagged nested tensors)."""
        return self._memo(("offsets", device), lambda: self._i64("cu").to(device))

    # -- value semantics ---------------------------------------------------------------------

    def _key(self) -> tuple[Any, ...]:
        return (self.seqlens_py, self.padded_seqlens_py, self.cp_size, self.tp_size, self.layout.value)

    def __repr__(self) -> str:
        lens: list[object] = list(self.seqlens_py)
        shown = lens if len(lens) <= 8 else lens[:6] + ["..."] + lens[-1:]
        return (f"ShardPlan(seqlens={shown}, cp_size={self.cp_size}, tp_size={self.tp_size}, "
                f"layout={self.layout.value!r}, alignment={self.alignment}, total_len={self.total_len}, "
                f"local_len={self.local_len})")


def _cumsum(values: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)
