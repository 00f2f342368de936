"""The shard plan: one immutable description of a packed (THD) micro-batch's context-parallel layout.

Everything cpshard does to a THD batch (shard, shift, unshard, gather, exchange boundary rows) is
derived from a :class:`ShardPlan`, so tokens, labels, loss masks, router indices and model outputs
of one step can never disagree about which rank holds which row.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import numpy as np
import torch

from cpshard import _halo, _index
from cpshard._errors import check_int, check_rank, fail
from cpshard._exchange import Exchange, build_exchange
from cpshard.layout import Layout, Padding, alignment, fp8_alignment, fp8_total_alignment

__all__ = ["DeviceTensors", "ShardPlan", "shift_exchange"]

_I32 = torch.int32
_T = TypeVar("_T")


def parse_seqlens(seqlens: Any, name: str = "seqlens") -> tuple[int, ...]:
    """Sequence lengths as a tuple of Python ints, from ints, a 1-D integer tensor or a jagged tensor.

    A tensor costs exactly one device-to-host copy here; nothing later reads lengths back.
    """
    values: list[Any]
    if type(seqlens) in (list, tuple) and _plain_ints(seqlens):
        return tuple(seqlens)  # the common case, checked at C speed
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
        if isinstance(n, torch.Tensor) and (n.dim() != 0 or n.dtype.is_floating_point or n.dtype.is_complex
                                            or n.dtype == torch.bool):
            fail(f"{name}[{i}]", f"tensor of shape {tuple(n.shape)} and dtype {n.dtype}",
                 "must be a whole number (an int, or a 0-d integer tensor)", "pass whole token counts",
                 kind=TypeError)
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
    rows = nt.values().shape[0]
    if offsets[-1] != rows:
        fail(name, f"nested tensor with {rows} value rows and offsets ending at {offsets[-1]}",
             "its offsets must end at the number of value rows", "build it with "
             "nested_tensor_from_jagged(values, offsets) where offsets[-1] == values.shape[0]")
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
    if cp_size * tp_size >= 2**31:  # before any NumPy arithmetic on them (int64 would overflow first)
        fail("cp_size", cp_size, f"with tp_size={tp_size} every padded batch has at least cp_size * tp_size rows, "
             "which must stay below 2**31 (cu_seqlens are int32, as Megatron and TransformerEngine take them)",
             "pass the sizes of your context- and tensor-parallel groups")
    return lens, cp_size, tp_size, layout, fp8


class _Cache:
    """Index tensors derived from one plan, keyed by what they are for (rank, shift, device).

    Not part of the plan's value: equality, hashing and pickling ignore it. Safe to share between
    threads: a value is computed outside the lock (it may use the cache itself) and the first one
    stored wins, so every caller sees one object per key.
    """

    __slots__ = ("_data", "_lock")

    def __init__(self) -> None:
        self._data: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Any, make: Callable[[], _T]) -> _T:
        with self._lock:
            if key in self._data:
                return self._data[key]
        value = make()
        with self._lock:
            return self._data.setdefault(key, value)


@dataclass(frozen=True)
class DeviceTensors:
    """A plan's offsets on one device (int32, what attention kernels and ``PackedSeqParams`` take)."""

    seqlens: torch.Tensor  # (B,)
    cu_seqlens: torch.Tensor  # (B + 1,), starting at 0
    cu_seqlens_padded: torch.Tensor  # (B + 1,); for a BshdPlan i * max_seqlen


class PlanBase:
    """What :class:`ShardPlan` and :class:`~cpshard.BshdPlan` share: one name for one thing.

    A plan is a pure value: equality, hashing and pickling use its fields alone (``_key``), and the
    index tensors derived from it live in a private cache that every copy builds afresh. Both plan
    kinds describe a rank's local rows, flattened in local order (``prod(local_shape)`` of them), as
    segments of consecutive positions of one sequence (Note [Which rows a rank holds] in
    ``_index.py``); every per-rank view and every index is one expansion of those segments, so THD
    and BSHD share one index path.
    """

    seqlens_py: tuple[int, ...]
    cp_size: int
    tp_size: int
    layout: Layout
    fp8: bool
    alignment: int
    max_seqlen: int  # longest padded sequence (what attention kernels take as ``max_seqlen``)
    padding: Padding = Padding.ALIGNED
    order: tuple[int, ...] | None = None  # buffer position -> the caller's sequence index (None: same)
    _cache: _Cache

    # -- what a plan kind defines -------------------------------------------------------------

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Leading shape of a rank's local tensor."""
        raise NotImplementedError

    @property
    def total_len(self) -> int:
        """Length of the global padded sequence dimension (``cp_size * local_len``)."""
        raise NotImplementedError

    def _build_segments(self, cp_rank: int) -> _index.Segments:
        raise NotImplementedError

    def _key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    # -- shared sizes and offsets -------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        """Sequences in the batch, ``B``."""
        return len(self.seqlens_py)

    @property
    def num_tokens(self) -> int:
        """Token rows in the batch, ``sum(seqlens)``."""
        return self.cu_seqlens_py[-1]

    @property
    def local_len(self) -> int:
        """Length of a rank's share of the sequence dimension, ``total_len / cp_size``."""
        return self.total_len // self.cp_size

    @property
    def padding_overhead(self) -> float:
        """Pad rows over token rows, across all ranks (0.0 when nothing is padded)."""
        padded = self.cp_size * math.prod(self.local_shape)
        return (padded - self.num_tokens) / max(self.num_tokens, 1)

    @cached_property
    def cu_seqlens_py(self) -> tuple[int, ...]:
        return _cumsum(self.seqlens_py)

    @cached_property
    def input_seqlens_py(self) -> tuple[int, ...]:
        """The lengths in the caller's order: what ``shard`` takes and ``unshard`` returns.

        Equal to ``seqlens_py`` unless the plan reordered the sequences (``order``), in which case
        ``seqlens_py``, ``cu_seqlens*`` and every per-rank view follow the buffer's order.
        """
        if self.order is None:
            return self.seqlens_py
        out = [0] * len(self.seqlens_py)
        for j, i in enumerate(self.order):
            out[i] = self.seqlens_py[j]
        return tuple(out)

    @cached_property
    def input_cu_seqlens_py(self) -> tuple[int, ...]:
        return self.cu_seqlens_py if self.order is None else _cumsum(self.input_seqlens_py)

    @property
    def seqlens(self) -> torch.Tensor:
        """``(B,)`` int32 on the CPU, built once per plan (shared: do not edit it in place)."""
        return self._cache.get("seqlens", lambda: torch.tensor(self.seqlens_py, dtype=_I32))

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``(B + 1,)`` int32 on the CPU, starting at 0; built once per plan (do not edit it in place)."""
        return self._cache.get("cu_seqlens", lambda: torch.tensor(self.cu_seqlens_py, dtype=_I32))

    def _cu_padded_py(self) -> tuple[int, ...]:
        return tuple(i * self.max_seqlen for i in range(self.num_seqs + 1))

    def device_tensors(self, device: torch.device | str) -> DeviceTensors:
        """The int32 offsets on ``device``, copied once per plan and device (pinned, non-blocking).

        What a training step hands its attention kernel, as xformers' attention biases keep device
        copies: ``plan.device_tensors("cuda").cu_seqlens_padded``. Shared: do not edit in place.
        """
        device = torch.device(device)

        def make() -> DeviceTensors:
            host = torch.tensor([self.seqlens_py, self.cu_seqlens_py[:-1], self.cu_seqlens_py[1:],
                                 self._cu_padded_py()[1:]], dtype=_I32)
            if device.type == "cuda":
                host = host.pin_memory()
            on = host.to(device, non_blocking=True)
            zero = on.new_zeros(1)
            return DeviceTensors(on[0], torch.cat([zero, on[2]]), torch.cat([zero, on[3]]))
        return self._cache.get(("device", device), make)

    # -- per-rank views (CPU; each a new tensor, so editing one cannot change the plan) ------------

    def _segments(self, cp_rank: Any) -> _index.Segments:
        cp_rank = check_rank(cp_rank, self.cp_size)
        return self._cache.get(("segs", cp_rank), lambda: self._build_segments(cp_rank))

    def _view(self, what: str, cp_rank: Any, make: Callable[[_index.Segments], torch.Tensor]) -> torch.Tensor:
        cp_rank = check_rank(cp_rank, self.cp_size)
        flat = self._cache.get((what, cp_rank), lambda: make(self._segments(cp_rank)))
        return flat.view(self.local_shape).clone()

    def _lens64(self) -> torch.Tensor:
        return self._cache.get("lens64", lambda: _index.int64_tensor(self.seqlens_py))

    def sequence_ids(self, cp_rank: int) -> torch.Tensor:
        """``local_shape`` int64: the sequence each local row belongs to (pad rows included)."""
        return self._view("seq", cp_rank, lambda segs: segs.seq_ids())

    def position_ids(self, cp_rank: int) -> torch.Tensor:
        """``local_shape`` int64: each local row's position inside its padded sequence."""
        return self._view("pos", cp_rank, lambda segs: segs.positions())

    def token_mask(self, cp_rank: int) -> torch.Tensor:
        """``local_shape`` bool: True on rows that hold a token, False on pad rows."""
        return self.label_mask(cp_rank, shift=0)

    def label_mask(self, cp_rank: int, shift: int = 1) -> torch.Tensor:
        """``local_shape`` bool: True on token rows whose ``shift``-th successor exists.

        The loss mask of labels sharded with ``shift``: False on pad rows and on the last ``shift``
        tokens of every sequence (the rows that hold ``fill``). ``shift=0`` is :meth:`token_mask`.
        """
        shift = check_int("shift", shift, minimum=0)
        return self._view(f"label{shift}", cp_rank,
                          lambda segs: segs.positions() + shift < self._lens64()[segs.seq_ids()])

    # -- value semantics ----------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __getstate__(self) -> dict[str, Any]:
        # Pickle the value, not its cache (device tensors, a lock): a copy rebuilds what it needs.
        state = dict(self.__dict__)
        del state["_cache"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_cache", _Cache())


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _unit(cp_size: int, tp_size: int, layout: Layout, fp8: bool, padding: Padding) -> int:
    """The per-sequence multiple: the layout's alignment for ``padding``, ``lcm(16, .)`` under fp8."""
    unit = alignment(cp_size, tp_size, layout, padding)
    return fp8_alignment(unit) if fp8 else unit


def _padded_lengths(
    seqlens: tuple[int, ...],
    cp_size: int,
    tp_size: int,
    layout: Layout,
    fp8: bool,
    min_local_rows: int | None,
    length_bucket: int | None,
    padding: Padding = Padding.ALIGNED,
) -> tuple[int, ...]:
    """Padded lengths per SPEC.md, "Padding".

    Each sequence is rounded up to the unit; the total must then split into ``cp`` shares of a
    multiple of ``tp`` rows (already so for aligned padding, reached through the last sequence for
    minimal padding). The extensions (fp8 total, ``min_local_rows``, ``length_bucket``) only
    lengthen the last sequence, each by a multiple of the per-sequence alignment, so every invariant
    still holds; a target that would break one is rounded up to the nearest one that keeps them all,
    and under fp8 every target is also kept a multiple of the fp8 total alignment.
    """
    unit = _unit(cp_size, tp_size, layout, fp8, padding)
    if max(seqlens) < 2**62:  # NumPy for long batches (the common case); Python ints beyond int64
        padded = (-(-np.array(seqlens, dtype=np.int64) // unit) * unit).tolist()
    else:
        padded = [-(-n // unit) * unit for n in seqlens]
    keep = math.lcm(unit, cp_size * tp_size)
    if fp8:
        keep = math.lcm(keep, fp8_total_alignment(alignment(cp_size, tp_size, layout)))
    total = _round_up(sum(padded), keep)
    if min_local_rows is not None:
        total = max(total, _round_up(min_local_rows * cp_size, keep))
    if length_bucket is not None:
        total = _round_up(total, math.lcm(length_bucket, cp_size, keep))
    padded[-1] += total - sum(padded)
    return tuple(padded)


def _plain_ints(values: Sequence[Any]) -> bool:
    """Non-empty, every value a plain ``int`` (not bool) and >= 0: the fast path of every check."""
    return bool(values) and set(map(type, values)) == {int} and min(values) >= 0


def _int_tuple(name: str, values: Sequence[Any]) -> tuple[int, ...]:
    """``values`` as a tuple of ints >= 0; a fast path for plain ints (plans of thousands of sequences)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        fail(name, repr(values), "must be a sequence of non-negative ints", f"pass {name} as a tuple of ints",
             kind=TypeError)
    out = tuple(values)
    if _plain_ints(out):
        return out
    return tuple(check_int(f"{name}[{i}]", v, minimum=0) for i, v in enumerate(out))


def check_value_fields(plan: PlanBase, derive: Callable[[int, int, Layout, bool], int]) -> None:
    """Normalise and check the fields every plan kind shares (runs for hand-built plans too)."""
    object.__setattr__(plan, "_cache", _Cache())
    object.__setattr__(plan, "layout", Layout.parse(plan.layout))
    object.__setattr__(plan, "cp_size", check_int("cp_size", plan.cp_size, minimum=1))
    object.__setattr__(plan, "tp_size", check_int("tp_size", plan.tp_size, minimum=1))
    if not isinstance(plan.fp8, bool):
        fail("fp8", repr(plan.fp8), "must be a bool", "pass fp8=True or fp8=False", kind=TypeError)
    lens = _int_tuple("seqlens_py", plan.seqlens_py)
    if not lens:
        fail("seqlens_py", lens, "must hold at least one sequence (B >= 1)", "pass the lengths of a non-empty batch")
    object.__setattr__(plan, "seqlens_py", lens)
    if plan.alignment is None:
        object.__setattr__(plan, "alignment", derive(plan.cp_size, plan.tp_size, plan.layout, plan.fp8))
    else:
        object.__setattr__(plan, "alignment", check_int("alignment", plan.alignment, minimum=1))


@dataclass(frozen=True, eq=False, repr=False)
class ShardPlan(PlanBase):
    """Which rows of a packed (THD) micro-batch each context-parallel rank holds.

    Build it with :meth:`ShardPlan.build`. Every offset is kept as Python ints (``*_py``; host
    code never syncs) and as int32 CPU tensors (what Megatron's ``PackedSeqParams`` and
    TransformerEngine take), built once per plan; :meth:`device_tensors` copies them to a device
    once. Index tensors derived from it are cached per rank and device, outside its value.

    Example, SPEC.md's ``ShardPlan.build([5, 3], cp_size=2)`` (zigzag, ``a = 2 * cp * tp = 4``)::

        padded_seqlens    = [8, 4]        cu_seqlens_padded = [0, 8, 12]
        total_len  T = 12                 local_len  L = 6         max_seqlen = 8

        global  : s0p0 s0p1 s0p2 s0p3 s0p4 pad  pad  pad  | s1p0 s1p1 s1p2 pad
        rank 0  : s0p0 s0p1 | pad  pad  | s1p0 | pad        (chunks 0 and 3 of each sequence)
        rank 1  : s0p2 s0p3 | s0p4 pad  | s1p1 | s1p2       (chunks 1 and 2)

        global_rows(0) = [0, 1, 6, 7, 8, 11]    global_rows(1) = [2, 3, 4, 5, 9, 10]

    ``cpshard plan --lengths 5,3 --cp 2`` prints the same picture. A hand-built plan is checked
    like a built one; its ``alignment`` defaults to the one SPEC derives from the sizes, layout and
    ``fp8``, and is part of its value.
    """

    seqlens_py: tuple[int, ...]
    padded_seqlens_py: tuple[int, ...]
    cp_size: int
    tp_size: int = 1
    layout: Layout = Layout.ZIGZAG
    fp8: bool = False
    alignment: int = None  # type: ignore[assignment]  # None: derived in __post_init__
    padding: Padding = Padding.ALIGNED
    order: tuple[int, ...] | None = None
    _cache: _Cache = field(init=False, repr=False, compare=False)

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
        padding: Padding | str = Padding.ALIGNED,
        reorder: str | None = None,
    ) -> ShardPlan:
        """Plan a micro-batch of sequences with lengths ``seqlens``.

        ``seqlens``: ints, a ``(B,)`` integer tensor or NumPy array, or the batch itself as a jagged
        nested tensor (one host copy of its offsets; see also :meth:`from_nested`). ``fp8`` pads
        each sequence to ``lcm(16, a)`` and the total to ``a * 128``; ``min_local_rows`` makes
        every rank hold at least that many rows; ``length_bucket`` makes the total a multiple of
        ``lcm(length_bucket, cp_size)``. Extensions lengthen only the last sequence and are rounded
        up until every invariant holds.

        ``padding="minimal"`` pads each sequence only as far as the layout needs (``2 * cp`` for
        zigzag, nothing for contiguous; the last sequence keeps every rank's rows divisible by
        ``tp``). ``reorder="balanced"`` (contiguous layout) permutes the sequences so that causal
        attention work is spread evenly over the ranks: ``order`` records the permutation,
        ``seqlens``/``cu_seqlens*`` and the per-rank views follow the new order, and ``shard``
        takes, ``unshard``/``gather`` return, the caller's order.
        """
        lens, cp_size, tp_size, layout, fp8 = parse_plan_args(seqlens, cp_size, tp_size, layout, fp8)
        padding = Padding.parse(padding)
        if min_local_rows is not None:
            min_local_rows = check_int("min_local_rows", min_local_rows, minimum=0)
        if length_bucket is not None:
            length_bucket = check_int("length_bucket", length_bucket, minimum=1)
        if reorder is not None:
            if reorder != "balanced":
                fail("reorder", repr(reorder), "must be None or 'balanced'", "pass reorder='balanced' or leave it None")
            if layout is not Layout.CONTIGUOUS:
                fail("reorder", repr(reorder), f"balances the contiguous layout (zigzag is balanced by its chunks; "
                     f"layout={layout.value!r})", "pass layout='contiguous', or drop reorder")
        padded = _padded_lengths(lens, cp_size, tp_size, layout, fp8, min_local_rows, length_bucket, padding)
        order = None
        if reorder is not None and cp_size > 1:
            # each sequence keeps its padded length (extensions included: the balance sees the final rows)
            from cpshard._balance import balanced_order
            order = tuple(balanced_order(lens, padded, cp_size))
            lens, padded = tuple(lens[i] for i in order), tuple(padded[i] for i in order)
        return cls._built(lens, padded, cp_size, tp_size, layout, fp8, padding, order)

    @classmethod
    def _built(cls, seqlens: tuple[int, ...], padded: tuple[int, ...], cp_size: int, tp_size: int, layout: Layout,
               fp8: bool, padding: Padding, order: tuple[int, ...] | None) -> ShardPlan:
        """The plan of :meth:`build`'s own values, which are valid by construction: ``__post_init__``'s
        checks (for hand-built plans) would repeat every pass over the lengths that ``build`` made.
        ``tests/test_plan_props.py`` checks that both ways give equal plans. What construction does not
        guarantee, the int32 range of the offsets, is checked here."""
        _check_total(sum(padded))
        plan = object.__new__(cls)
        if order is not None and order == tuple(range(len(order))):
            order = None
        for name, value in (("seqlens_py", seqlens), ("padded_seqlens_py", padded), ("cp_size", cp_size),
                            ("tp_size", tp_size), ("layout", layout), ("fp8", fp8),
                            ("alignment", _unit(cp_size, tp_size, layout, fp8, padding)), ("padding", padding),
                            ("order", order), ("_cache", _Cache())):
            object.__setattr__(plan, name, value)
        return plan

    @classmethod
    def from_nested(cls, nt: torch.Tensor, **kwargs: Any) -> tuple[ShardPlan, torch.Tensor]:
        """``(plan, values)`` for a jagged nested tensor batch: one host copy of its offsets.

        ``values`` is ``nt.values()``, the flat ``(num_tokens, ...)`` rows; shard those with the
        plan and nothing reads the lengths back again (a nested tensor passed to ``shard`` is
        checked against the plan, which costs one host copy per call). ``kwargs`` are
        :meth:`build`'s.
        """
        if not (isinstance(nt, torch.Tensor) and nt.is_nested):
            fail("nt", type(nt).__name__, "must be a jagged nested tensor", "pass the batch as "
                 "torch.nested.nested_tensor(..., layout=torch.jagged), or use ShardPlan.build", kind=TypeError)
        return cls.build(jagged_lengths(nt, "nt"), **kwargs), nt.values()

    def __post_init__(self) -> None:
        # Runs for hand-built plans too (and dataclasses.replace): an invalid plan cannot exist, and
        # every plan starts with its own empty cache.
        object.__setattr__(self, "padding", Padding.parse(self.padding))
        check_value_fields(self, lambda cp, tp, layout, fp8: _unit(cp, tp, layout, fp8, self.padding))
        base = alignment(self.cp_size, self.tp_size, self.layout)
        cp, tp, lens = self.cp_size, self.tp_size, self.seqlens_py
        padded = _int_tuple("padded_seqlens_py", self.padded_seqlens_py)
        object.__setattr__(self, "padded_seqlens_py", padded)
        if len(lens) != len(padded):
            fail("padded_seqlens_py", padded, f"must hold one length per sequence ({len(lens)})",
                 "build plans with ShardPlan.build")
        if self.order is not None:
            order = _int_tuple("order", self.order)
            if sorted(order) != list(range(len(lens))):
                fail("order", order, f"must be a permutation of range({len(lens)}) (buffer position -> the "
                     "caller's sequence)", "build plans with ShardPlan.build(..., reorder='balanced')")
            object.__setattr__(self, "order", None if order == tuple(range(len(lens))) else order)
        a = self.alignment
        total = sum(padded)
        if total < 2**31 and max(lens) < 2**31:  # one vectorized pass (the common case); the message names the first
            n_, p_ = np.array(lens, dtype=np.int64), np.array(padded, dtype=np.int64)
            bad = np.flatnonzero((p_ < n_) | (p_ % a != 0))
            first_bad = int(bad[0]) if bad.size else None
        else:
            first_bad = next((i for i, (n, p) in enumerate(zip(lens, padded)) if p < n or p % a), None)
        if first_bad is not None:
            i = first_bad
            fail(f"padded_seqlens_py[{i}]", padded[i], f"must be >= the sequence length {lens[i]} and a multiple "
                 f"of alignment={a}", "build plans with ShardPlan.build")
        _check_total(total)
        if total % cp or (total // cp) % tp:
            fail("padded_seqlens_py", padded, f"total {total} must split into cp_size={cp} equal parts "
                 f"each divisible by tp_size={tp}", "build plans with ShardPlan.build")
        if self.layout is Layout.ZIGZAG and cp > 1 and a % (2 * cp) and any(p % (2 * cp) for p in padded):
            fail("padded_seqlens_py", padded, f"every zigzag length must divide by 2 * cp_size = {2 * cp}",
                 "build plans with ShardPlan.build")
        if self.fp8 and total % fp8_total_alignment(base):
            fail("padded_seqlens_py", padded, f"with fp8 the total {total} must divide by "
                 f"{fp8_total_alignment(base)}", "build plans with ShardPlan.build(..., fp8=True)")

    # -- sizes and offsets -----------------------------------------------------------------

    @property
    def total_len(self) -> int:
        """Rows of the global padded buffer, ``T = sum(padded_seqlens)``."""
        return self.cu_seqlens_padded_py[-1]

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Leading shape of a rank's local tensor: ``(local_len,)``."""
        return (self.local_len,)

    @property
    def max_seqlen(self) -> int:  # type: ignore[override]
        """Longest padded sequence (what attention kernels take as ``max_seqlen``)."""
        return max(self.padded_seqlens_py)

    @cached_property
    def cu_seqlens_padded_py(self) -> tuple[int, ...]:
        return _cumsum(self.padded_seqlens_py)

    def _cu_padded_py(self) -> tuple[int, ...]:
        return self.cu_seqlens_padded_py

    @property
    def padded_seqlens(self) -> torch.Tensor:
        """``(B,)`` int32 on the CPU, built once per plan (do not edit it in place)."""
        return self._cache.get("padded_seqlens", lambda: torch.tensor(self.padded_seqlens_py, dtype=_I32))

    @property
    def cu_seqlens_padded(self) -> torch.Tensor:
        """``(B + 1,)`` int32 on the CPU, starting at 0; built once per plan (do not edit it in place)."""
        return self._cache.get("cu_seqlens_padded", lambda: torch.tensor(self.cu_seqlens_padded_py, dtype=_I32))

    def global_rows(self, cp_rank: int) -> torch.Tensor:
        """``(L,)`` int64: the global padded row each of ``cp_rank``'s local rows holds."""
        cu = self._cache.get("cu_padded64", lambda: _index.int64_tensor(self.cu_seqlens_padded_py))
        return self._view("rows", cp_rank, lambda segs: segs.rows(cu))

    def _build_segments(self, cp_rank: int) -> _index.Segments:
        padded = _index.int64_tensor(self.padded_seqlens_py)
        return _index.rank_segments(padded, self.cp_size, self.layout, cp_rank)

    # -- value semantics ---------------------------------------------------------------------

    def _key(self) -> tuple[Any, ...]:
        return (self.seqlens_py, self.padded_seqlens_py, self.cp_size, self.tp_size, self.layout.value,
                self.fp8, self.alignment, self.padding.value, self.order)

    def __repr__(self) -> str:
        lens: list[object] = list(self.seqlens_py)
        shown = lens if len(lens) <= 8 else lens[:6] + ["..."] + lens[-1:]
        extra = (", fp8=True" if self.fp8 else "") + (", padding='minimal'" if self.padding is Padding.MINIMAL
                                                       else "") + (", reordered" if self.order else "")
        return (f"ShardPlan(seqlens={shown}, cp_size={self.cp_size}, tp_size={self.tp_size}, "
                f"layout={self.layout.value!r}{extra}, alignment={self.alignment}, total_len={self.total_len}, "
                f"local_len={self.local_len})")


def _check_total(total: int) -> None:
    if total >= 2**31:
        fail("seqlens", f"a batch of {total} padded rows", "must stay below 2**31 (cu_seqlens are int32, as "
             "Megatron and TransformerEngine take them)", "split the micro-batch")


def _cumsum(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(itertools.accumulate(values, initial=0))


# ---------------------------------------------------------------------------------------------
# The internal API between plans and the modules that move data (``ops``, ``distributed``): index
# tensors derived from a plan, cached per plan outside its value. Both plan kinds take one path.


def shard_index(plan: PlanBase, cp_rank: int, shift: int, device: torch.device,
                row_stride: int | None = None) -> _index.ShardIndex:
    """Gather and fill rows of ``cp_rank``'s flattened local rows, on ``device``.

    ``row_stride`` is ``S`` for a padded ``(B, S, ...)`` input (sequence ``b`` starts at row
    ``b * S``), or None for packed token rows (sequence ``b`` starts at ``cu_seqlens[b]``).
    """
    def first_rows() -> np.ndarray:  # per segment, the input row its first row reads (unshifted)
        seg = rank_rows(plan, cp_rank)
        if row_stride is None:  # packed input in the caller's order: buffer sequence j is input sequence order[j]
            cu = np.array(plan.input_cu_seqlens_py[:-1], dtype=np.int64)
            starts = cu if plan.order is None else cu[np.array(plan.order)]
        else:
            starts = np.arange(plan.num_seqs, dtype=np.int64) * row_stride
        return starts[seg.seq] + seg.pos

    rows = plan.num_tokens if row_stride is None else plan.num_seqs * row_stride

    def base() -> torch.Tensor:
        # every shift's gather reads this index from a shifted view of the input (ShardIndex). int32
        # where the input has fewer than 2**31 rows (every packed input: a plan's offsets are int32):
        # half the memory traffic of int64, and index_select takes it. A padded (B, S) input wider
        # than the plan can have more rows (B * S): int64 there, never a wrapped index. Pad rows of
        # the last sequences may point past the input: clamped, segment by segment
        seg = rank_rows(plan, cp_rank)
        first = plan._cache.get(("first-rows", cp_rank, row_stride), first_rows)
        src = _index.expand_np(first, seg.length, np.dtype(np.int32 if rows < 2**31 else np.int64))
        last = max(rows - 1, 0)
        over = np.flatnonzero(first + seg.length - 1 > last)
        if over.size > 8:
            np.minimum(src, last, out=src)
        else:
            for lo, n in zip(seg.begin[over].tolist(), seg.length[over].tolist()):
                np.minimum(src[lo:lo + n], last, out=src[lo:lo + n])
        return _index.to_device(torch.from_numpy(src), device)

    def safe_ranges() -> tuple[tuple[int, int], ...] | None:
        # Output rows whose unshifted source lies in the input's last `shift` rows (the only ones a
        # shifted view cannot serve): per segment, from the first such row to the segment's end
        # (its later rows are pad rows, clamped to the last input row). Work over segments only.
        seg = rank_rows(plan, cp_rank)
        first = plan._cache.get(("first-rows", cp_rank, row_stride), first_rows)
        start = np.maximum(rows - shift - first, 0)
        hit = np.flatnonzero(start < seg.length)
        if not hit.size:
            return None
        begin = seg.begin[hit]
        bad = np.stack([begin + start[hit], begin + seg.length[hit]], 1).tolist()
        out, at = [], 0
        for lo, hi in sorted(bad):
            if lo > at:
                out.append((at, lo))
            at = max(at, hi)
        if at < seg.total:
            out.append((at, seg.total))
        return tuple(out)

    def make() -> _index.ShardIndex:
        src = plan._cache.get(("shard-base", cp_rank, row_stride, device), base)
        seg = rank_rows(plan, cp_rank)
        pad = plan._cache.get(("pad", cp_rank, device), lambda: _index.to_device(seg.pad_rows(), device))
        fill = _index.to_device(seg.fill_rows(shift), device)
        return _index.ShardIndex(src, pad, fill, shift, safe_ranges() if shift else None)
    return plan._cache.get(("shard", cp_rank, shift, row_stride, device), make)


def unpadded(plan: PlanBase) -> ShardPlan:
    """The plan of ``plan``'s tokens, unpadded, in the caller's order, on one rank (for ``shift``)."""
    return plan._cache.get("unpadded", lambda: ShardPlan(plan.input_seqlens_py, plan.input_seqlens_py, 1,
                                                         alignment=1))


def rank_rows(plan: PlanBase, cp_rank: int) -> _index.RankRows:
    """``cp_rank``'s segments as NumPy arrays with their local starts and token counts, once per plan."""
    return plan._cache.get(("rank-rows", cp_rank), lambda: _index.RankRows.of(plan._segments(cp_rank),
                                                                                plan._lens64()))


def _restore_order(plan: PlanBase) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's held segments side by side, rank 0's first: ``(rank, begin, length, tokens,
    order)``, with ``order`` the segments holding tokens in the caller's (sequence, position) order.

    Sorted so, the segments' token rows tile the batch's tokens in order: what the restore copies
    (by runs, :func:`token_runs`) or gathers (by an index, :func:`unshard_index`), without a
    permutation of the whole padded buffer.
    """
    def make() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        every = [rank_rows(plan, r) for r in range(plan.cp_size)]
        rank = np.repeat(np.arange(plan.cp_size), [x.length.size for x in every])
        begin, length, tokens, seq, pos = (np.concatenate([getattr(x, f) for x in every])
                                           for f in ("begin", "length", "tokens", "seq", "pos"))
        held = np.flatnonzero(length)  # contiguous: most (rank, sequence) segments are empty
        rank, begin, length, tokens, seq, pos = (a[held] for a in (rank, begin, length, tokens, seq, pos))
        caller = seq if plan.order is None else np.array(plan.order, dtype=np.int64)[seq]
        stride = int((pos + length).max()) + 1 if pos.size else 1
        order = np.argsort(caller * stride + pos, kind="stable")
        return rank, begin, length, tokens, order[tokens[order] > 0]
    return plan._cache.get("restore-order", make)


def unshard_index(plan: PlanBase, device: torch.device) -> torch.Tensor:
    """``(N,)`` int32: the row of the rank-concatenated flat buffer (``cat`` of every rank's flattened
    local rows) that holds each token, tokens in the caller's order (one expansion of the segments in
    :func:`_restore_order`; int32, as a plan's buffers hold fewer than 2**31 rows)."""
    def make() -> torch.Tensor:
        if isinstance(plan, ShardPlan) and _segments_per_token(plan) > 1 / 16:
            index = _thd_unshard_np(plan)  # short chunks (many sequences, large cp): per token is cheaper
        else:
            rank, begin, _, tokens, order = _restore_order(plan)
            start = rank * math.prod(plan.local_shape) + begin
            index = _index.expand_np(start[order], tokens[order], np.dtype(np.int32))
        return _index.to_device(torch.from_numpy(index), device)
    return plan._cache.get(("unshard", device), make)


def _segments_per_token(plan: ShardPlan) -> float:
    """How many segments every rank's lists hold per token (each rank lists every sequence: one
    segment under contiguous, two chunks under zigzag), known before any is built."""
    per_seq = 2 if plan.layout is Layout.ZIGZAG and plan.cp_size > 1 else 1
    return plan.num_seqs * plan.cp_size * per_seq / max(plan.num_tokens, 1)


def _thd_unshard_np(plan: ShardPlan) -> np.ndarray:
    """:func:`unshard_index` of a THD plan in closed form, per token (no segments of every rank).

    With ``P`` a sequence's padded length and ``c = P / cp`` rows on each rank: under contiguous
    (and at ``cp = 1``) the rank-concatenated buffer is the global padded buffer, so token ``p`` of
    a sequence is row ``cu_padded + p``. Under zigzag, with ``h = P / (2 cp)``, token ``p`` is in
    chunk ``k = p // h``, held by rank ``k`` (``k < cp``) or ``2 cp - 1 - k``, at that rank's local
    row ``cu_padded / cp + p % h`` (plus ``h`` in the second chunk). Built over the tokens at once:
    100k sequences at cp = 64 in ~0.4 s, where every rank's segments (one per row there) took 4-8 s;
    used where the segments average fewer than 16 tokens (for long chunks the segments' one
    expansion is cheaper: 1 M tokens in 256 sequences at cp = 4, ~1.5 ms against ~25).
    """
    lens = np.asarray(plan.input_seqlens_py, dtype=np.int64)  # caller's order
    buffer_of = np.arange(plan.num_seqs) if plan.order is None else np.argsort(np.asarray(plan.order))
    cu_padded = np.asarray(plan.cu_seqlens_padded_py[:-1], dtype=np.int64)[buffer_of]
    p = _index.expand_np(np.zeros(plan.num_seqs, dtype=np.int64), lens)  # each token's position
    cp = plan.cp_size
    if plan.layout is not Layout.ZIGZAG or cp == 1:
        p += np.repeat(cu_padded, lens)
        return p.astype(np.int32)
    h = np.repeat(np.asarray(plan.padded_seqlens_py, dtype=np.int64)[buffer_of] // (2 * cp), lens)
    chunk = p // h
    second = chunk >= cp
    rank = np.where(second, 2 * cp - 1 - chunk, chunk)
    p -= chunk * h
    p += np.where(second, h, 0)
    p += rank * plan.local_len
    p += np.repeat(cu_padded // cp, lens)
    return p.astype(np.int32)


_ROWS_PER_RUN = 512  # token_runs: below this many rows per piece, one gather by an index is cheaper


def token_runs(plan: PlanBase) -> tuple[list[list[int]], list[int]] | None:
    """The restore as runs: ``(sizes, keep)`` such that, with ``pieces`` the concatenation of
    ``part[r].split(sizes[r])`` over the ranks' flat rows, ``cat([pieces[i] for i in keep])`` is
    :func:`unshard_index`'s gather; or None where that index is the cheaper way.

    ``sizes[r]`` cut rank ``r``'s rows into each held segment's token rows and pad rows, in local
    order; ``keep`` lists the token pieces in the caller's (sequence, position) order. Copying runs
    needs no row-level index (which at a million tokens costs more to build than the copy), but each
    piece costs about a microsecond: runs are used when the pieces average ``_ROWS_PER_RUN`` rows or
    more, as under the contiguous layout (about ``B + cp`` segments); zigzag's ``2 B cp`` short chunks
    take the index.
    """
    def make() -> tuple[list[list[int]], list[int]] | None:
        rank, _, length, tokens, order = _restore_order(plan)
        if not length.size or 2 * length.size * _ROWS_PER_RUN > plan.num_tokens:
            return None
        cuts = np.stack([tokens, length - tokens], 1)
        bounds = np.searchsorted(rank, np.arange(plan.cp_size + 1))
        sizes = [cuts[a:b].reshape(-1).tolist() for a, b in zip(bounds[:-1], bounds[1:])]
        return sizes, (2 * order).tolist()
    return plan._cache.get("token-runs", make)


def jagged_offsets(plan: PlanBase, device: torch.device) -> torch.Tensor:
    """The caller's ``cu_seqlens`` as int64 on ``device``: the offsets of the jagged tensors cpshard returns."""
    return plan._cache.get(("offsets", device),
                           lambda: _index.to_device(_index.int64_tensor(plan.input_cu_seqlens_py), device))


def shift_exchange(plan: PlanBase, cp_rank: int, shift: int, device: torch.device | None = None) -> Exchange:
    """What ``cp_rank`` sends, receives and copies locally to shift a sharded tensor by ``shift``.

    Pure index math, the same on every rank (Note [Sharded shift exchange] in ``_exchange.py``):
    call it for every rank in one process to see or test a whole exchange. CPU unless ``device``.
    """
    cp_rank = check_rank(cp_rank, plan.cp_size)
    shift = check_int("shift", shift, minimum=0)
    dev = torch.device("cpu") if device is None else torch.device(device)

    def make() -> Exchange:
        if dev.type != "cpu":
            return shift_exchange(plan, cp_rank, shift).to(dev)
        return build_exchange([plan._segments(r) for r in range(plan.cp_size)], plan._lens64(), cp_rank, shift)
    return plan._cache.get(("exchange", cp_rank, shift, dev), make)


def halo_exchange(plan: PlanBase, cp_rank: int, shifts: Sequence[int],
                  device: torch.device | None = None) -> _halo.MultiShift:
    """What ``cp_rank`` sends, receives and gathers to shift sharded tensors by every shift in ``shifts``.

    One exchange of each segment's halo serves every shift and tensor (Note [Halo exchange for
    several shifts] in ``_halo.py``; ``cpshard.distributed.shift_sharded_multi`` runs it). Pure index
    math, the same on every rank: callable for every rank in one process. CPU unless ``device``.
    """
    cp_rank = check_rank(cp_rank, plan.cp_size)
    ks = tuple(check_int("shifts", k, minimum=0) for k in shifts)
    dev = torch.device("cpu") if device is None else torch.device(device)

    def make() -> _halo.MultiShift:
        if dev.type != "cpu":
            return halo_exchange(plan, cp_rank, ks).to(dev)
        return _halo.build_multi_shift([plan._segments(r) for r in range(plan.cp_size)], plan._lens64(), cp_rank, ks)
    return plan._cache.get(("halo", cp_rank, ks, dev), make)
