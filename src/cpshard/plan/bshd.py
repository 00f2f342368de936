"""The BSHD plan: context-parallel columns of a padded ``(B, S, ...)`` batch.

Every sequence is padded to one length ``M``; each rank holds, in every row of the batch, the
columns that the THD rules give a single sequence of length ``M`` (SPEC.md, "BSHD").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cpshard.base.errors import check_int, fail
from cpshard.base.layout import Layout, TwinOrder, alignment
from cpshard.index import segments as _index
from cpshard.index.closed import by_position_pays, zigzag_by_rank, zigzag_rows
from cpshard.plan.args import parse_plan_args
from cpshard.plan.indices import PlanIndices
from cpshard.plan.values import Plan, check_value_fields

__all__ = ["BshdPlan"]


def bshd_alignment(num_seqs: int, cp_size: int, tp_size: int, layout: Layout, fp8: bool) -> int:
    """The multiple ``M`` is rounded up to (SPEC.md, "BSHD"): the layout's, and under fp8 also
    ``128 * tp * cp / gcd(B, 128 * tp * cp)``, so that ``B * M`` divides by ``128 * tp * cp``."""
    unit = alignment(cp_size, tp_size, layout)
    if fp8:
        total = 128 * tp_size * cp_size
        unit = math.lcm(unit, total // math.gcd(num_seqs, total))
    return unit


@dataclass(frozen=True, eq=False, repr=False)
class BshdPlan(Plan):
    """Which columns of a padded batch each context-parallel rank holds.

    ``BshdPlan.build([5, 3], cp_size=2)`` pads both rows to ``M = 8`` (zigzag, ``a = 4``); rank 0
    holds columns ``[0, 1, 6, 7]`` of every row, rank 1 columns ``[2, 3, 4, 5]``::

        row 0   : t0 t1 t2 t3 t4 .  .  .        rank 0: t0 t1 .  .      rank 1: t2 t3 t4 .
        row 1   : t0 t1 t2 .  .  .  .  .        rank 0: t0 t1 .  .      rank 1: t2 .  .  .

    The names are :class:`~cpshard.ShardPlan`'s: ``max_seqlen`` (``M``), ``total_len`` (``M``,
    the padded sequence dimension), ``local_len`` (``M / cp``), ``local_shape`` (``(B, M / cp)``),
    ``token_mask(cp_rank)`` (True on token columns), ``position_ids(cp_rank)`` (the global column).
    """

    seqlens_py: tuple[int, ...]
    max_seqlen: int
    cp_size: int
    tp_size: int = 1
    layout: Layout = Layout.ZIGZAG
    fp8: bool = False
    alignment: int = None  # type: ignore[assignment]  # None: derived in __post_init__
    _indices: PlanIndices = field(init=False, repr=False, compare=False)

    # ShardPlan.build's keyword arguments, then BSHD's own: one way to build either plan kind, each
    # signature spelled out for its readers and type checkers (`duplicates` pairs the two; they stay)
    @classmethod
    def build(
        cls,
        seqlens: Sequence[int] | torch.Tensor,
        *,
        cp_size: int,
        tp_size: int = 1,
        layout: Layout | str = Layout.ZIGZAG,
        fp8: bool = False,
        max_seqlen: int | None = None,
    ) -> BshdPlan:
        """Plan a padded batch whose rows hold ``seqlens`` tokens.

        ``M`` is ``max(seqlens)`` (or the forced ``max_seqlen``, which must not be shorter) rounded
        up to the layout's alignment; with ``fp8`` also to ``128 * tp * cp / gcd(B, 128 * tp * cp)``
        so that ``B * M`` divides by ``128 * tp * cp``.
        """
        lens, cp_size, tp_size, layout, fp8 = parse_plan_args(seqlens, cp_size, tp_size, layout, fp8)
        longest = max(lens)
        if max_seqlen is not None:
            max_seqlen = check_int("max_seqlen", max_seqlen, minimum=0)
            if max_seqlen < longest:
                fail("max_seqlen", max_seqlen, f"must be >= the longest sequence ({longest})",
                     f"pass max_seqlen >= {longest} or leave it None")
            longest = max_seqlen
        unit = bshd_alignment(len(lens), cp_size, tp_size, layout, fp8)
        return cls(lens, -(-longest // unit) * unit, cp_size, tp_size, layout, fp8)

    def __post_init__(self) -> None:
        check_value_fields(self, lambda cp, tp, layout, fp8: bshd_alignment(
            len(self.seqlens_py), cp, tp, layout, fp8))
        m = check_int("max_seqlen", self.max_seqlen, minimum=0)
        object.__setattr__(self, "max_seqlen", m)
        cp, tp = self.cp_size, self.tp_size
        if m < max(self.seqlens_py):
            fail("max_seqlen", m, f"must be >= every length (longest {max(self.seqlens_py)})",
                 "build plans with BshdPlan.build")
        if m * self.num_seqs >= 2**31:
            fail("seqlens", f"a batch of {self.num_seqs} rows padded to {m}", "must hold fewer than 2**31 "
                 "padded positions (cu_seqlens are int32)", "split the micro-batch")
        step = 2 * cp if (self.layout is Layout.ZIGZAG and cp > 1) else cp
        if m % step or (m // cp) % tp or m % self.alignment:
            fail("max_seqlen", m, f"must divide by {step} and by alignment={self.alignment}, and leave a multiple "
                 f"of tp_size={tp} per rank", "build plans with BshdPlan.build")

    @property
    def total_len(self) -> int:
        """The padded sequence dimension, ``M`` (``cp_size * local_len``)."""
        return self.max_seqlen

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Leading shape of a rank's local tensor: ``(num_seqs, local_len)``."""
        return (self.num_seqs, self.local_len)

    @property
    def input_padded_seqlens_py(self) -> tuple[int, ...]:
        """Every row's padded length, ``M`` (the name is :class:`~cpshard.ShardPlan`'s)."""
        return (self.max_seqlen,) * self.num_seqs

    def columns(self, cp_rank: int) -> torch.Tensor:
        """``(M / cp,)`` int64: the global column each local column holds (the same in every row)."""
        return self.position_ids(cp_rank)[0].clone()

    def _rank_segments(self, cp_rank: int, lengths: np.ndarray) -> _index.Segments:
        m = np.array([self.max_seqlen], dtype=np.int64)
        return _index.repeat_segments(_index.rank_segments(m, m, self.cp_size, self.layout, cp_rank), lengths)

    def _split(self) -> tuple[np.ndarray, bool]:
        # every batch row is one sequence of M rows, split over the ranks alone (PlanIndices.split)
        return np.full(self.num_seqs, self.max_seqlen, dtype=np.int64), True

    def padded_rows(self, x: torch.Tensor, name: str = "x", *, allowed: bool = True) -> tuple[torch.Tensor, int]:
        # a plain tensor is the right-padded (B, S, ...) batch (ops.sharding.shard), which as_flat does not take
        if not allowed:
            fail(name, f"tensor of shape {tuple(x.shape)}", "with a BshdPlan a plain tensor is the padded (B, S, ...) "
                 "batch, which this function does not take", "pass the packed rows as a list or a jagged nested tensor")
        b, longest = self.num_seqs, max(self.seqlens_py)
        if x.dim() < 2 or x.shape[0] != b or x.shape[1] < longest:
            fail(name, f"tensor of shape {tuple(x.shape)}",
                 f"a BSHD tensor must be (B={b}, S >= {longest}, ...), right-padded",
                 "pass the padded batch, or packed token rows as a list or jagged nested tensor")
        return x.reshape(b * x.shape[1], *x.shape[2:]), x.shape[1]

    def _closed_form_restore(self) -> np.ndarray:
        return _bshd_restore(self)

    def _closed_form_restore_by_rank(self) -> tuple[list[np.ndarray], list[int], np.ndarray] | None:
        # zigzag: every row one sequence of M columns, its local columns from b L on a rank of B L rows
        cp, local = self.cp_size, self.local_len
        if cp == 1 or self.layout is not Layout.ZIGZAG or not by_position_pays(self.max_seqlen, self.num_tokens):
            return None
        return zigzag_by_rank(_index.int64_array(self.seqlens_py), np.arange(self.num_seqs, dtype=np.int64) * local,
                              max(self.max_seqlen // (2 * cp), 1), cp)

    def _twin(self, target: Layout, order: TwinOrder) -> BshdPlan:
        if order is not TwinOrder.SAME:
            fail("order", repr(order.value), "applies to packed (THD) plans only: a BSHD batch has no buffer order",
                 "drop order")
        cp, m = self.cp_size, self.max_seqlen
        if target is Layout.ZIGZAG and cp > 1 and m % (2 * cp):
            fail("plan", f"a {self.layout.value} BSHD plan padded to {m} columns", f"a zigzag twin needs the padded "
                 f"length to divide by 2 * cp_size = {2 * cp}", "build the plan with layout='zigzag' (its padding "
                 "serves both layouts) and take its contiguous twin")
        unit = bshd_alignment(self.num_seqs, cp, self.tp_size, target, self.fp8)
        return dataclasses.replace(self, layout=target, alignment=unit if m % unit == 0 else math.gcd(unit, m))

    def _key(self) -> tuple[Any, ...]:
        return (self.seqlens_py, self.max_seqlen, self.cp_size, self.tp_size, self.layout.value, self.fp8,
                self.alignment)

    def __repr__(self) -> str:
        fp8 = ", fp8=True" if self.fp8 else ""
        return (f"BshdPlan(num_seqs={self.num_seqs}, max_seqlen={self.max_seqlen}, cp_size={self.cp_size}, "
                f"tp_size={self.tp_size}, layout={self.layout.value!r}{fp8}, local_len={self.local_len})")


def _bshd_restore(plan: BshdPlan) -> np.ndarray:
    """:meth:`PlanIndices.unshard` of a BSHD plan in closed form, per token (no segments of every rank).

    Every row of ``M`` columns is split alone: column ``p`` of row ``b`` sits on rank ``r`` at local
    column ``q``, that rank's flat row ``b L + q`` (``L = M / cp``), so at ``r B L + b L + q`` of the
    rank-concatenated buffer. Contiguous: ``r = p // L``, ``q = p % L``; zigzag: the chunks of
    ``M / (2 cp)`` columns of ``index.closed.zigzag_rows``, each batch row a sequence whose local rows
    start at ``b L`` on ranks of ``B L`` rows. In int32 (a BSHD plan has fewer than 2**31 positions).
    """
    i32 = np.dtype(np.int32)
    lens = _index.int64_array(plan.seqlens_py)  # a BSHD batch has no buffer order
    cp, local = plan.cp_size, plan.local_len
    rows = plan.num_seqs * local
    pos = _index.expand_np(np.zeros(plan.num_seqs, dtype=np.int64), lens, i32)  # each token's column
    base = np.repeat((np.arange(plan.num_seqs, dtype=np.int64) * local).astype(i32), lens)
    if cp > 1 and plan.layout is Layout.ZIGZAG:
        return zigzag_rows(pos, max(plan.max_seqlen // (2 * cp), 1), base, cp, rows)  # M = 0 holds no token
    if cp > 1:
        rank = pos // max(local, 1)
        pos -= rank * local
        rank *= rows
        pos += rank
    pos += base
    return pos
