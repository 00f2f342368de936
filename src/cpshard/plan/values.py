"""The shard plan: one immutable description of a micro-batch's context-parallel layout.

Everything cpshard does to a batch (shard, shift, unshard, gather, exchange boundary rows) is
derived from a plan, so tokens, labels, loss masks, router indices and model outputs of one step
can never disagree about which rank holds which row. :class:`Plan` is what every plan kind shares;
:class:`ShardPlan` plans a packed (THD) batch, :class:`~cpshard.BshdPlan` (``bshd.py``) a padded
one. A plan is a value; the index tensors derived from it live in its index service
(:meth:`Plan.indices`, ``plan/indices.py``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, overload

import numpy as np
import torch

from cpshard.base.errors import check_int, check_rank, fail
from cpshard.base.layout import (
    Layout,
    Padding,
    Reorder,
    TwinOrder,
    alignment,
    fp8_total_alignment,
    padded_lengths,
    sequence_unit,
    shared_alignment,
)
from cpshard.index import segments as _index
from cpshard.index.balance import balanced_permutation, rank_work, zigzag_works
from cpshard.plan.args import check_shift, int_tuple, jagged_lengths, parse_plan_args
from cpshard.index.closed import thd_restore, thd_restore_by_rank
from cpshard.plan.indices import DeviceTensors, PlanIndices
from cpshard.plan.thd_twin import thd_twin_values

__all__ = ["DeviceTensors", "Plan", "PlanBase", "ShardPlan"]


class _HostOffsets:
    """A plan's offsets ``<name>_py`` as the int32 CPU tensor ``<name>``, built once by its index service
    (:meth:`PlanIndices.host`): a read-only property, one line a name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, plan: None, owner: type | None = None) -> _HostOffsets: ...
    @overload
    def __get__(self, plan: Plan, owner: type | None = None) -> torch.Tensor: ...
    def __get__(self, plan: Plan | None, owner: type | None = None) -> torch.Tensor | _HostOffsets:
        return self if plan is None else plan._indices.host(self.name)


class Plan:
    """What :class:`ShardPlan` and :class:`~cpshard.BshdPlan` share: one name for one thing. Every
    function that takes a plan takes either kind.

    A plan is a pure value: equality, hashing and pickling use its fields alone (``_key``), and the
    index tensors derived from it live in its index service (:meth:`indices`), which every copy
    builds afresh. Both plan kinds describe a rank's local rows, flattened in local order
    (``prod(local_shape)`` of them), as segments of consecutive positions of one sequence (Note
    [Which rows a rank holds] in ``index/segments.py``); every per-rank view and every index is one
    expansion of those segments, so THD and BSHD share one index path.
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
    _indices: PlanIndices

    # -- what a plan kind defines -------------------------------------------------------------

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Leading shape of a rank's local tensor."""
        raise NotImplementedError

    @property
    def total_len(self) -> int:
        """Length of the global padded sequence dimension (``cp_size * local_len``)."""
        raise NotImplementedError

    def _rank_segments(self, cp_rank: int, lengths: np.ndarray) -> _index.Segments:
        """``cp_rank``'s segments, for the index service (``lengths``: the token counts, buffer order)."""
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
    def equal_chunks(self) -> bool:
        """Whether zigzag's chunks are equal, as Megatron's ``PackedSeqParams`` and TransformerEngine need: False
        for a zigzag plan at ``cp > 1`` with ``padding="none"``, whatever its lengths (SPEC.md)."""
        return not (self.layout is Layout.ZIGZAG and self.cp_size > 1 and self.padding is Padding.NONE)

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
        return self._in_caller_order(self.seqlens_py)

    def _in_caller_order(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """Per-sequence ``values`` given in buffer order, in the caller's order (``order`` undone)."""
        if self.order is None:
            return values
        out = [0] * len(values)
        for j, i in enumerate(self.order):
            out[i] = values[j]
        return tuple(out)

    @cached_property
    def input_cu_seqlens_py(self) -> tuple[int, ...]:
        return self.cu_seqlens_py if self.order is None else _cumsum(self.input_seqlens_py)

    seqlens = _HostOffsets()
    """``(B,)`` int32 on the CPU, built once per plan (shared: do not edit it in place)."""
    cu_seqlens = _HostOffsets()
    """``(B + 1,)`` int32 on the CPU, starting at 0; built once per plan (do not edit it in place)."""

    def indices(self) -> PlanIndices:
        """The plan's index service: every index tensor derived from it, built on first use and kept
        (``plan/indices.py``). Internal to cpshard's modules; its methods take checked arguments."""
        return self._indices

    def _cu_padded_py(self) -> tuple[int, ...]:
        return tuple(i * self.max_seqlen for i in range(self.num_seqs + 1))

    def device_tensors(self, device: torch.device | str) -> DeviceTensors:
        """The int32 offsets on ``device``, copied once per plan and device (pinned, non-blocking).

        What a training step hands its attention kernel, as xformers' attention biases keep device
        copies: ``plan.device_tensors("cuda").cu_seqlens_padded``. Shared: do not edit in place.
        """
        return self._indices.device_tensors(torch.device(device))

    # -- per-rank views (CPU; each a new tensor, so editing one cannot change the plan) ------------

    def _view(self, what: str, cp_rank: Any, shift: int = 0) -> torch.Tensor:
        flat = self._indices.view(what, check_rank(cp_rank, self.cp_size), shift)
        return torch.from_numpy(flat.copy()).view(self.local_shape)

    def sequence_ids(self, cp_rank: int) -> torch.Tensor:
        """``local_shape`` int64: the sequence each local row belongs to (pad rows included)."""
        return self._view("seq", cp_rank)

    def position_ids(self, cp_rank: int) -> torch.Tensor:
        """``local_shape`` int64: each local row's position inside its padded sequence."""
        return self._view("pos", cp_rank)

    def token_mask(self, cp_rank: int) -> torch.Tensor:
        """``local_shape`` bool: True on rows that hold a token, False on pad rows."""
        return self.label_mask(cp_rank, shift=0)

    def label_mask(self, cp_rank: int, shift: int = 1) -> torch.Tensor:
        """``local_shape`` bool: True on token rows whose ``shift``-th successor exists.

        The loss mask of labels sharded with ``shift``: False on pad rows and on the last ``shift``
        tokens of every sequence (the rows that hold ``fill``). ``shift=0`` is :meth:`token_mask`.
        """
        return self._view("label", cp_rank, check_shift(shift))

    def twin(self, layout: Layout | str | None = None, order: TwinOrder | str = TwinOrder.SAME) -> Plan:
        """The plan's twin: the same sequences and padded lengths under ``layout`` (and, for THD,
        ``order``: a :class:`~cpshard.TwinOrder` or its value ``"same"``, ``"caller"``, ``"balanced"``),
        for ``cpshard.distributed.relayout`` (SPEC.md, "Changing layout inside a model"; ``cpshard.twin_plan``).

        The twin keeps the plan's ``cp_size``, ``tp_size``, ``fp8`` and padding mode; its ``alignment``
        is the one its layout derives when every padded length divides by it (so a twin's twin is the
        plan again), else, for a zigzag twin of a contiguous plan whose lengths all divide by ``2 * cp``,
        minimal padding's ``2 * cp``. Where no twin exists (a zigzag twin needs every padded length to
        divide by ``2 * cp``, but under ``padding="none"``) the error names the padding to build with. Each plan kind builds its own
        (``_twin``); Note [Twin plans and their route] in ``twins.py``.
        """
        target = self.layout if layout is None else Layout.parse(layout)
        return self._twin(target, TwinOrder.parse(order))

    def _twin(self, target: Layout, order: TwinOrder) -> Plan:
        """:meth:`twin` of a checked ``target`` layout and ``order``."""
        raise NotImplementedError

    def padded_rows(self, x: torch.Tensor, name: str = "x", *, allowed: bool = True) -> tuple[torch.Tensor, int] | None:
        """How this plan kind reads a plain tensor ``x``: as a right-padded ``(B, S, ...)`` batch, returned as
        its ``(B * S, ...)`` rows and ``S`` (a :class:`~cpshard.BshdPlan`), or None: ``x`` holds packed token
        rows (a :class:`ShardPlan`). Where the caller takes no padded batch (``allowed=False``), a kind that
        reads one raises a ``ValueError`` naming ``name``; so does a padded batch of the wrong shape."""
        return None

    def _closed_form_work(self) -> list[int] | None:
        """Per rank, the causal work (:meth:`PlanIndices.work`) in a closed form of this plan kind, or
        None: the index service counts it per segment."""
        return None

    def _closed_form_restore(self) -> np.ndarray | None:
        """:meth:`PlanIndices.unshard`'s index in a closed form of this plan kind, per token, or None
        where the kind has none (the index service uses it where segments would average fewer than 16
        tokens)."""
        return None

    def _closed_form_restore_by_rank(self) -> tuple[list[np.ndarray], list[int], np.ndarray] | None:
        """:meth:`PlanIndices.unshard_by_rank` in a closed form of this plan kind, or None: the index
        service sorts :meth:`PlanIndices.unshard`'s index by rank."""
        return None

    def unpadded(self) -> ShardPlan:
        """The plan of this plan's tokens alone: its sequences unpadded, in the caller's order, on one rank
        (``cp_size=1``, ``alignment=1``; :func:`cpshard.shift` shifts unsharded sequences by its index).
        Built once per plan."""
        lens = self.input_seqlens_py
        return self._indices.kept_for("unpadded", None, lambda: ShardPlan(lens, lens, 1, alignment=1))

    # -- value semantics ----------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        # hashed once (a plan of 100k lengths takes a millisecond): plans key the caches of their twins
        return self._indices.hash_of(self._key)

    def __getstate__(self) -> dict[str, Any]:
        # Pickle the value, not its indices (device tensors, a lock): a copy rebuilds what it needs.
        state = dict(self.__dict__)
        del state["_indices"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        object.__setattr__(self, "_indices", PlanIndices(self))


PlanBase = Plan  # the name before 0.2 (CHANGELOG)


def check_value_fields(plan: Plan, derive: Callable[[int, int, Layout, bool], int]) -> None:
    """Normalise and check the fields every plan kind shares (runs for hand-built plans too)."""
    object.__setattr__(plan, "_indices", PlanIndices(plan))
    object.__setattr__(plan, "layout", Layout.parse(plan.layout))
    object.__setattr__(plan, "cp_size", check_int("cp_size", plan.cp_size, minimum=1))
    object.__setattr__(plan, "tp_size", check_int("tp_size", plan.tp_size, minimum=1))
    if not isinstance(plan.fp8, bool):
        fail("fp8", repr(plan.fp8), "must be a bool", "pass fp8=True or fp8=False", kind=TypeError)
    lens = int_tuple("seqlens_py", plan.seqlens_py)
    if not lens:
        fail("seqlens_py", lens, "must hold at least one sequence (B >= 1)", "pass the lengths of a non-empty batch")
    object.__setattr__(plan, "seqlens_py", lens)
    if plan.alignment is None:
        object.__setattr__(plan, "alignment", derive(plan.cp_size, plan.tp_size, plan.layout, plan.fp8))
    else:
        object.__setattr__(plan, "alignment", check_int("alignment", plan.alignment, minimum=1))


@dataclass(frozen=True, eq=False, repr=False)
class ShardPlan(Plan):
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
    _indices: PlanIndices = field(init=False, repr=False, compare=False)

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
        reorder: Reorder | str | None = None,
        total_len: int | None = None,
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
        ``tp``). ``padding="none"``: none, zigzag's chunks one row apart (SPEC.md, "Zigzag without
        padding"; :attr:`equal_chunks`). ``reorder="balanced"`` (contiguous layout) permutes the
        sequences so that causal attention work is spread evenly over the ranks: ``order`` records the permutation,
        ``seqlens``/``cu_seqlens*`` and the per-rank views follow the new order, and ``shard``
        takes, ``unshard``/``gather`` return, the caller's order.

        ``total_len`` asks for exactly that many rows in all, reached on the last sequence (another
        framework's target, e.g. verl's ``min_local_rows`` and length buckets without cpshard's
        rounding): at least the padded total, and keeping every split (``layout.total_problem``),
        else ``ValueError``; it replaces ``min_local_rows`` and ``length_bucket``. The plan's
        ``alignment`` is then the one its lengths share (``layout.shared_alignment``).
        """
        lens, cp_size, tp_size, layout, fp8 = parse_plan_args(seqlens, cp_size, tp_size, layout, fp8)
        padding = Padding.parse(padding)
        if min_local_rows is not None:
            min_local_rows = check_int("min_local_rows", min_local_rows, minimum=0)
        if length_bucket is not None:
            length_bucket = check_int("length_bucket", length_bucket, minimum=1)
        if total_len is not None:
            total_len = check_int("total_len", total_len, minimum=1)
            if min_local_rows is not None or length_bucket is not None:
                fail("total_len", total_len, "replaces min_local_rows and length_bucket (an exact total)",
                     "pass either total_len or the extensions")
        if reorder is not None:
            reorder = Reorder.parse(reorder)
            if layout is not Layout.CONTIGUOUS:
                fail("reorder", repr(reorder.value), "balances the contiguous layout (zigzag is balanced by its "
                     f"chunks; layout={layout.value!r})", "pass layout='contiguous', or drop reorder")
        padded = padded_lengths(lens, cp_size, tp_size, layout, fp8, min_local_rows, length_bucket, padding, total_len)
        order = None
        if reorder is not None and cp_size > 1:
            # each sequence keeps its padded length (extensions included: the balance sees the final rows)
            order = balanced_permutation(lens, padded, cp_size)  # None: the given order, nothing to permute
            if order is not None:
                lens, padded = tuple(map(lens.__getitem__, order)), tuple(map(padded.__getitem__, order))
        unit = sequence_unit(cp_size, tp_size, layout, fp8, padding)
        if total_len is not None:
            unit = shared_alignment(padded, unit)
        return cls._built(lens, padded, cp_size, tp_size, layout, fp8, padding, order, unit)

    @classmethod
    def from_padded(cls, seqlens: Sequence[int] | torch.Tensor, padded_seqlens: Sequence[int], *, cp_size: int,
                    tp_size: int = 1, layout: Layout | str = Layout.ZIGZAG, fp8: bool = False,
                    name: str = "padded_seqlens", fix: str = "pass the lengths and sizes the batch was padded for"
                    ) -> ShardPlan:
        """The plan whose sequences hold ``seqlens`` tokens padded to exactly ``padded_seqlens`` rows:
        for offsets another framework padded (``cu_seqlens_q_padded`` of a ``PackedSeqParams``).

        Where every padded length is a multiple of SPEC's alignment this is the plan :meth:`build`
        gives for them (equal to it, extensions included); otherwise (a last sequence extended to a
        framework's own target, say) the plan keeps the same rows with the alignment the lengths
        share (``layout.shared_alignment``). The invariants are checked as for any plan; the errors
        name the padded lengths as ``name`` (an adapter's argument, e.g. ``psp.cu_seqlens_q_padded``)
        and end with ``fix``.
        """
        lens, cp_size, tp_size, layout, fp8 = parse_plan_args(seqlens, cp_size, tp_size, layout, fp8)
        padded = int_tuple(name, padded_seqlens)
        unit = shared_alignment(padded, sequence_unit(cp_size, tp_size, layout, fp8, Padding.ALIGNED)) if padded else 1
        plan = object.__new__(cls)
        for field_name, value in (("seqlens_py", lens), ("padded_seqlens_py", padded), ("cp_size", cp_size),
                                  ("tp_size", tp_size), ("layout", layout), ("fp8", fp8), ("alignment", unit),
                                  ("padding", Padding.ALIGNED), ("order", None)):
            object.__setattr__(plan, field_name, value)
        plan._check(name, fix)  # the plan's own checks, in the caller's words
        return plan

    @classmethod
    def _built(cls, seqlens: tuple[int, ...], padded: tuple[int, ...], cp_size: int, tp_size: int, layout: Layout,
               fp8: bool, padding: Padding, order: tuple[int, ...] | None, unit: int) -> ShardPlan:
        """The plan of :meth:`build`'s own values, which are valid by construction: ``__post_init__``'s
        checks (for hand-built plans) would repeat every pass over the lengths that ``build`` made.
        ``tests/test_plan_props.py`` checks that both ways give equal plans. What construction does not
        guarantee, the int32 range of the offsets, is checked here."""
        _check_total(sum(padded))
        plan = object.__new__(cls)
        if order is not None and all(map(int.__eq__, order, itertools.count())):  # the identity: none
            order = None
        for name, value in (("seqlens_py", seqlens), ("padded_seqlens_py", padded), ("cp_size", cp_size),
                            ("tp_size", tp_size), ("layout", layout), ("fp8", fp8),
                            ("alignment", unit), ("padding", padding), ("order", order)):
            object.__setattr__(plan, name, value)
        object.__setattr__(plan, "_indices", PlanIndices(plan))
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
        self._check()

    def _check(self, name: str = "padded_seqlens_py", fix: str | None = None) -> None:
        """Normalise and check the fields; the errors name the padded lengths ``name`` and end with
        ``fix`` (an adapter's words, :meth:`from_padded`), else with how to build a valid plan."""
        build = fix or "build plans with ShardPlan.build"
        object.__setattr__(self, "padding", Padding.parse(self.padding))
        check_value_fields(self, lambda cp, tp, layout, fp8: sequence_unit(cp, tp, layout, fp8, self.padding))
        base = alignment(self.cp_size, self.tp_size, self.layout)
        cp, tp, lens = self.cp_size, self.tp_size, self.seqlens_py
        padded = int_tuple(name, self.padded_seqlens_py)
        object.__setattr__(self, "padded_seqlens_py", padded)
        if len(lens) != len(padded):
            fail(name, padded, f"must hold one length per sequence ({len(lens)})", build)
        if self.order is not None:
            order = int_tuple("order", self.order)
            if sorted(order) != list(range(len(lens))):
                fail("order", order, f"must be a permutation of range({len(lens)}) (buffer position -> the "
                     "caller's sequence)", fix or "build plans with ShardPlan.build(..., reorder='balanced')")
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
            fail(f"{name}[{i}]", padded[i], f"must be >= the sequence length {lens[i]} and a multiple "
                 f"of alignment={a}", build)
        _check_total(total, fix)
        if total % cp or (total // cp) % tp:
            fail(name, padded, f"total {total} must split into cp_size={cp} equal parts "
                 f"each divisible by tp_size={tp}", build)
        if self.layout is Layout.ZIGZAG and cp > 1 and a % (2 * cp) and self.equal_chunks and any(
                p % (2 * cp) for p in padded):
            fail(name, padded, f"every zigzag length must divide by 2 * cp_size = {2 * cp}", build)
        if self.fp8 and total % fp8_total_alignment(base):
            fail(name, padded, f"with fp8 the total {total} must divide by "
                 f"{fp8_total_alignment(base)}", fix or "build plans with ShardPlan.build(..., fp8=True)")

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
    def input_padded_seqlens_py(self) -> tuple[int, ...]:
        """The padded lengths in the caller's order (``padded_seqlens_py`` follows the buffer's)."""
        return self._in_caller_order(self.padded_seqlens_py)

    @cached_property
    def cu_seqlens_padded_py(self) -> tuple[int, ...]:
        return _cumsum(self.padded_seqlens_py)

    def _cu_padded_py(self) -> tuple[int, ...]:
        return self.cu_seqlens_padded_py

    padded_seqlens = _HostOffsets()
    """``(B,)`` int32 on the CPU, built once per plan (do not edit it in place)."""
    cu_seqlens_padded = _HostOffsets()
    """``(B + 1,)`` int32 on the CPU, starting at 0; built once per plan (do not edit it in place)."""

    def global_rows(self, cp_rank: int) -> torch.Tensor:
        """``(L,)`` int64: the global padded row each of ``cp_rank``'s local rows holds."""
        return self._view("rows", cp_rank)

    def _rank_segments(self, cp_rank: int, lengths: np.ndarray) -> _index.Segments:
        return _index.rank_segments(_index.int64_array(self.padded_seqlens_py), lengths, self.cp_size, self.layout,
                                    cp_rank)

    def _split(self) -> tuple[np.ndarray, bool]:  # the whole buffer split over the ranks (PlanIndices.split)
        return _index.int64_array(self.padded_seqlens_py), False

    def _closed_form_work(self) -> list[int]:
        # the balancer's closed forms over the sequences, no segments (Note [Causal work under the
        # contiguous layout] in index/balance.py)
        if self.layout is Layout.ZIGZAG:
            padded = _index.int64_array(self.padded_seqlens_py)
            return zigzag_works(self._indices.lengths(), padded, self.cp_size).sum(0).tolist()
        return rank_work(self.seqlens_py, self.padded_seqlens_py, range(self.num_seqs), self.cp_size)

    def _closed_form_restore(self) -> np.ndarray:
        return thd_restore(self)

    def _closed_form_restore_by_rank(self) -> tuple[list[np.ndarray], list[int], np.ndarray] | None:
        return thd_restore_by_rank(self)

    def _twin(self, target: Layout, order: TwinOrder) -> ShardPlan:
        # the twin's values, checked (plan/thd_twin.py), in the caller's order and then the twin's buffer order
        lens, padded, unit, padding, new_order = thd_twin_values(
            self.input_seqlens_py, self.input_padded_seqlens_py, self.cp_size, self.tp_size, self.fp8, self.padding,
            self.layout, self.order, target, order)
        return ShardPlan(lens, padded, self.cp_size, self.tp_size, target, self.fp8, unit, padding, new_order)

    # -- value semantics ---------------------------------------------------------------------

    def _key(self) -> tuple[Any, ...]:
        return (self.seqlens_py, self.padded_seqlens_py, self.cp_size, self.tp_size, self.layout.value,
                self.fp8, self.alignment, self.padding.value, self.order)

    def __repr__(self) -> str:
        lens: list[object] = list(self.seqlens_py)
        shown = lens if len(lens) <= 8 else lens[:6] + ["..."] + lens[-1:]
        padding = "" if self.padding is Padding.ALIGNED else f", padding={self.padding.value!r}"
        extra = (", fp8=True" if self.fp8 else "") + padding + (", reordered" if self.order else "")
        return (f"ShardPlan(seqlens={shown}, cp_size={self.cp_size}, tp_size={self.tp_size}, "
                f"layout={self.layout.value!r}{extra}, alignment={self.alignment}, total_len={self.total_len}, "
                f"local_len={self.local_len})")


def _check_total(total: int, fix: str | None = None) -> None:
    if total >= 2**31:
        fail("seqlens", f"a batch of {total} padded rows", "must stay below 2**31 (cu_seqlens are int32, as "
             "Megatron and TransformerEngine take them)", fix or "split the micro-batch")


def _cumsum(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(itertools.accumulate(values, initial=0))


def check_plan_type(plan: Any, fix: str = "build one with ShardPlan.build or BshdPlan.build", name: str = "plan"
                    ) -> None:
    """A clear ``TypeError`` unless ``plan`` (the argument ``name``) is a plan (either kind)."""
    if not isinstance(plan, Plan):
        fail(name, type(plan).__name__, "must be a ShardPlan or BshdPlan", fix, kind=TypeError)
