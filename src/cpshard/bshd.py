"""The BSHD plan: context-parallel columns of a padded ``(B, S, ...)`` batch.

Every sequence is padded to one length ``M``; each rank holds, in every row of the batch, the
columns that the THD rules give a single sequence of length ``M`` (SPEC.md, "BSHD").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cpshard import _index
from cpshard._errors import check_int, check_rank, fail
from cpshard.layout import Layout, alignment
from cpshard.plan import PlanCache, parse_plan_args

__all__ = ["BshdPlan"]


@dataclass(frozen=True, eq=False, repr=False)
class BshdPlan(PlanCache):
    """Which columns of a padded batch each context-parallel rank holds.

    ``BshdPlan.build([5, 3], cp_size=2)`` pads both rows to ``M = 8`` (zigzag, ``a = 4``); rank 0
    holds columns ``[0, 1, 6, 7]`` of every row, rank 1 columns ``[2, 3, 4, 5]``::

        row 0   : t0 t1 t2 t3 t4 .  .  .        rank 0: t0 t1 .  .      rank 1: t2 t3 t4 .
        row 1   : t0 t1 t2 .  .  .  .  .        rank 0: t0 t1 .  .      rank 1: t2 .  .  .

    ``attention_mask(rank)`` is True on token columns; ``position_ids(rank)`` is the global column.
    """

    seqlens_py: tuple[int, ...]
    seq_len: int
    cp_size: int
    tp_size: int = 1
    layout: Layout = Layout.ZIGZAG
    alignment: int = 1
    _cache: dict[Any, Any] = field(init=False, repr=False, compare=False)

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
        unit = alignment(cp_size, tp_size, layout)
        if fp8:
            total = 128 * tp_size * cp_size
            unit = math.lcm(unit, total // math.gcd(len(lens), total))
        seq_len = -(-longest // unit) * unit
        plan = cls(lens, seq_len, cp_size, tp_size, layout, unit)
        plan._remember_offsets(seqlens)
        return plan

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "layout", Layout.parse(self.layout))
        object.__setattr__(self, "seqlens_py", tuple(self.seqlens_py))
        cp = check_int("cp_size", self.cp_size, minimum=1)
        tp = check_int("tp_size", self.tp_size, minimum=1)
        if not self.seqlens_py or min(self.seqlens_py) < 0 or self.seq_len < max(self.seqlens_py):
            fail("seq_len", self.seq_len, "must be >= every length, for a non-empty batch",
                 "build plans with BshdPlan.build")
        step = 2 * cp if (self.layout is Layout.ZIGZAG and cp > 1) else cp
        if self.seq_len % step or (self.seq_len // cp) % tp:
            fail("seq_len", self.seq_len, f"must divide by {step} and leave a multiple of tp_size={tp} per rank",
                 "build plans with BshdPlan.build")

    @property
    def batch_size(self) -> int:
        return len(self.seqlens_py)

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens_py)

    @property
    def num_tokens(self) -> int:
        return sum(self.seqlens_py)

    @property
    def local_seq_len(self) -> int:
        """Columns each rank holds, ``M / cp_size``."""
        return self.seq_len // self.cp_size

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Leading shape of a rank's local tensor: ``(batch_size, local_seq_len)``."""
        return (self.batch_size, self.local_seq_len)

    @property
    def seqlens(self) -> torch.Tensor:
        return torch.tensor(self.seqlens_py, dtype=torch.int32)

    def columns(self, rank: int) -> torch.Tensor:
        """``(M / cp,)`` int64: the global column each local column holds."""
        rank = check_rank(rank, self.cp_size)
        return self._memo(("cols", rank), lambda: self._segments(rank).positions()).clone()

    def attention_mask(self, rank: int) -> torch.Tensor:
        """``(B, M / cp)`` bool: True on token columns."""
        return self.columns(rank).unsqueeze(0) < self._lens().unsqueeze(1)

    def position_ids(self, rank: int) -> torch.Tensor:
        """``(B, M / cp)`` int64: the global column of each local column."""
        return self.columns(rank).unsqueeze(0).expand(self.batch_size, -1).contiguous()

    # -- internals -----------------------------------------------------------------------------

    def _lens(self) -> torch.Tensor:
        return self._memo("lens", lambda: torch.tensor(self.seqlens_py, dtype=torch.int64))

    def _cu(self) -> torch.Tensor:
        return self._memo("cu", lambda: torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.int64),
                                                                  self._lens()]), 0))

    def _segments(self, rank: int) -> _index.Segments:
        """``rank``'s columns of one row, as segments of a single sequence of length ``M``."""
        return self._memo(("segs", rank), lambda: _index.rank_segments(
            torch.tensor([self.seq_len], dtype=torch.int64), self.cp_size, self.layout, rank))

    def _shard_index(self, rank: int, shift: int, row_stride: int | None,
                     device: torch.device) -> _index.ShardIndex:
        """Gather and fill rows over the flattened ``(B * M / cp)`` output.

        ``row_stride`` is ``S`` for a ``(B, S, ...)`` padded input (row ``b`` starts at ``b * S``),
        or None for packed tokens (row ``b`` starts at ``cu_seqlens[b]``).
        """
        def make() -> _index.ShardIndex:
            b = self.batch_size
            if row_stride is None:
                starts, rows = self._cu()[:-1], self.num_tokens
            else:
                starts, rows = torch.arange(b, dtype=torch.int64) * row_stride, b * row_stride
            segs = _index.repeat_segments(self._segments(rank), b)
            return _index.shard_index(segs, self._lens(), starts, shift, rows).to(device)
        return self._memo(("shard", rank, shift, row_stride, device), make)

    def _unshard_index(self, device: torch.device) -> torch.Tensor:
        """``(N,)``: row of the ``(B * M)`` buffer (each row's columns in rank order) holding each token."""
        def make() -> torch.Tensor:
            b, m, mc = self.batch_size, self.seq_len, self.local_seq_len
            parts = []
            for r in range(self.cp_size):
                single = self._segments(r)
                segs = _index.repeat_segments(single, b)
                start = segs.seq * m + r * mc + single.local_start.repeat(b)
                parts.append((segs, start))
            return _index.token_gather_index(
                torch.cat([s.seq for s, _ in parts]), torch.cat([s.pos for s, _ in parts]),
                torch.cat([s.length for s, _ in parts]), torch.cat([t for _, t in parts]),
                self._lens(), self.num_tokens).to(device)
        return self._memo(("unshard", device), make)

    def _offsets(self, device: torch.device) -> torch.Tensor:
        return self._memo(("offsets", device), lambda: self._cu().to(device))

    def _key(self) -> tuple[Any, ...]:
        return (self.seqlens_py, self.seq_len, self.cp_size, self.tp_size, self.layout.value)

    def __repr__(self) -> str:
        return (f"BshdPlan(batch_size={self.batch_size}, seq_len={self.seq_len}, cp_size={self.cp_size}, "
                f"tp_size={self.tp_size}, layout={self.layout.value!r}, local_seq_len={self.local_seq_len})")
