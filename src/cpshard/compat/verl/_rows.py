"""Which input row (or a zero) verl puts on every local row, and which position id: its contract.

A drop-in returns what the framework returns on every row, pad rows included (README, "Differences
from verl", names the rows where verl loses a token and cpshard does not). verl's
``preprocess_thd_engine`` writes the padded sequence ``x_pad`` (its tokens, then zeros) into each
rank's rows; what it writes elsewhere follows from its loop and is restated here as per-row rules
over the plan's own per-rank views (``sequence_ids``, ``position_ids``), vectorized:

- **tokens**: ``x_pad[p]`` at padded position ``p``; **position ids**: ``p`` on token rows, 0 on pad
  rows, except zigzag at ``cp > 1``, where every row of the first half of a sequence (``p < P / 2``,
  the first chunk of each rank) holds ``p`` even on a pad row.
- **need_roll, contiguous** (any ``cp``): token ``p`` receives token ``(p + 1) % n`` and that position
  id (each sequence wraps to its first token); pad rows 0.
- **need_roll, zigzag, cp = 1**: the whole buffer above rolled by one row (a sequence's last row takes
  the next sequence's first row; the buffer's last row takes its first).
- **need_roll, zigzag, cp > 1**: the rank's rows rolled by one, then two rows of each sequence fixed:
  the first chunk's last row takes ``x_pad[(r + 1) h]`` (its own position id), and the second chunk's
  last copied row takes either the next padded row (own position id) or, where that chunk reaches
  the end of verl's copy of the sequence, the sequence's first token (position id 0). verl 0.9.1
  copies the sequence padded to its padded length ``P``, so the end is always ``P`` (row ``P - 1``
  wraps); verl 0.9.0 and main pad the copy only to the alignment ``a``, so the end is ``max(n, a)``:
  the last token wraps when ``n >= a``, and a pad row at a chunk's end past it takes the next
  sequence's first local row (:class:`Rules`).
- **sequences of no rows** (zigzag, ``cp > 1``, need_roll) write 0 into the row before their start
  (with that row's own position id): where that row is a token whose label exists, verl loses the
  label, and cpshard keeps the value verl would have had without the empty sequence.

Sources read (not copied): verl 0.9.1's and verl main's (1dda039, 2026-08-22)
``verl/models/mcore/util.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cpshard.base.dtypes import movable
from cpshard.base.layout import Layout, alignment, fp8_alignment
from cpshard.index.segments import expand_np
from cpshard.ops.sharding import shard
from cpshard.plan.bshd import BshdPlan
from cpshard.plan.values import Plan, ShardPlan

__all__ = ["Rules", "bshd_rows", "rules_for", "thd_rows"]


@dataclass(frozen=True)
class Rules:
    """How one verl version's util.py differs from another's, where cpshard must follow it.

    ``roll_copy_to_padded``: under zigzag ``need_roll`` verl copies each sequence padded to its
    padded length (0.9.1) rather than only to the alignment (0.9.0, main). ``vlm_thd_aligned``:
    ``build_vlm_attn_mask_thd`` pads to the longest row rounded up to the BSHD alignment (0.9.1)
    rather than to the longest row (0.9.0, main).
    """

    version: str
    roll_copy_to_padded: bool
    vlm_thd_aligned: bool


_V091 = Rules("0.9.1", roll_copy_to_padded=True, vlm_thd_aligned=True)
_V090 = Rules("0.9.0", roll_copy_to_padded=False, vlm_thd_aligned=False)


def rules_for(version: str) -> Rules:
    """The rules of a verl version string: 0.9.0 and the development line (``0.10.0.dev``, verl main
    as read at 1dda039) have the older copy; 0.9.1 and any other release the newer."""
    v = version.strip()
    if v.startswith("0.9.0") or ".dev" in v or v.startswith(("0.8.", "0.7.", "0.6.")):
        return Rules(v, _V090.roll_copy_to_padded, _V090.vlm_thd_aligned)
    return Rules(v, _V091.roll_copy_to_padded, _V091.vlm_thd_aligned)


def _verl_align(plan: ShardPlan) -> int:
    a = alignment(plan.cp_size, plan.tp_size, plan.layout)
    return fp8_alignment(a) if plan.fp8 else a


def _put(rows: torch.Tensor, at: np.ndarray, values: torch.Tensor, src: np.ndarray) -> torch.Tensor:
    """``rows`` with rows ``at`` set to ``values[src]`` (0 where ``src`` is -1); out of place, so a
    gradient reaches the rows taken. fp8 and unsigned rows move as same-width integers."""
    if at.size == 0:
        return rows
    carried = movable(rows, 0, 0)
    if carried is not None:
        return _put(carried[0], at, movable(values, 0, 0)[0], src).view(rows.dtype)  # type: ignore[index]
    take = torch.from_numpy(np.maximum(src, 0)).to(values.device)
    new = values.index_select(0, take) if values.shape[0] else rows.new_zeros((at.size, *rows.shape[1:]))
    zero = torch.from_numpy(src < 0).to(values.device)
    if bool(zero.any()):
        new = new.masked_fill(zero.view(-1, *[1] * (new.dim() - 1)), 0)
    return rows.index_put((torch.from_numpy(at).to(rows.device),), new)


def _first_rows(plan: Plan) -> np.ndarray:
    """Buffer sequence -> the flat input row of its first token (rows in the caller's order): what every
    plan kind answers (its input offsets and its order)."""
    first = np.asarray(plan.input_cu_seqlens_py[:-1], dtype=np.int64)
    return first if plan.order is None else first[np.asarray(plan.order)]


def bshd_rows(rows: torch.Tensor, values: torch.Tensor, plan: BshdPlan, cp_rank: int) -> torch.Tensor:
    """verl's ``preprocess_bshd_engine`` under need_roll from ``shard(..., shift=1, fill=0)``'s rows
    ``(B, M / cp, ...)``: verl rolls each padded row, so the last column (global ``M - 1``, held by
    rank 0 under zigzag) takes the row's first token (0 for an empty row). Per segment."""
    segs = plan.indices().segments(cp_rank)
    ends = segs.pos + segs.length == plan.max_seqlen  # the segment that holds the last column
    lens = np.asarray(plan.seqlens_py, dtype=np.int64)[segs.seq[ends]]
    src = np.where(lens > 0, _first_rows(plan)[segs.seq[ends]], -1)
    flat = rows.reshape(-1, *rows.shape[2:])
    return _put(flat, (segs.start + segs.length - 1)[ends], values, src).view(rows.shape)


def thd_rows(values: torch.Tensor, plan: ShardPlan, cp_rank: int, need_roll: bool,
             rules: Rules) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, position_ids)`` of rank ``cp_rank``, ``(L, ...)`` and ``(L,)`` int64, as verl's
    ``preprocess_thd_engine`` computes them from the flat token rows ``values`` (module docstring).

    One ``shard`` of the rows, one roll where verl rolls, and a few rows per sequence written after:
    the index math is per segment and per sequence (NumPy), never per row."""
    cp, zigzag = plan.cp_size, plan.layout is Layout.ZIGZAG
    segs = plan.indices().segments(cp_rank)
    lens = np.asarray(plan.seqlens_py, dtype=np.int64)
    padded = np.asarray(plan.padded_seqlens_py, dtype=np.int64)
    offsets = _first_rows(plan)
    # position ids before any roll: each row's padded position, 0 on pad rows, except that verl's
    # zigzag (cp > 1) keeps the padded position on pad rows of a sequence's first half
    zeroed = segs.tokens < segs.length
    if zigzag and cp > 1:
        zeroed &= segs.pos >= padded[segs.seq] // 2
    pad_rows = torch.from_numpy(expand_np((segs.start + segs.tokens)[zeroed], (segs.length - segs.tokens)[zeroed]))
    if need_roll and not zigzag:  # each sequence wraps to its own first token (position id 0)
        rows = shard(values, plan, cp_rank, shift=1, pad_value=0, fill=0)
        ends = (segs.tokens > 0) & (segs.pos + segs.tokens == lens[segs.seq])  # holds its sequence's last token
        at = (segs.start + segs.tokens - 1)[ends]
        pos = plan.position_ids(cp_rank).add_(1)
        pos[pad_rows] = 0
        pos[torch.from_numpy(at)] = 0
        return _put(rows, at, values, offsets[segs.seq[ends]]), pos
    pos = plan.position_ids(cp_rank)
    pos[pad_rows] = 0
    rows = shard(values, plan, cp_rank, pad_value=0)
    if not need_roll or rows.shape[0] == 0:
        return rows, pos
    pos0 = pos
    rows, pos = torch.roll(rows, -1, 0), torch.roll(pos0, -1, 0)
    if cp == 1:
        return rows, pos
    return _zigzag_fixes(plan, cp_rank, rules, values, rows, pos, pos0, offsets, lens, padded)


def _zigzag_fixes(plan: ShardPlan, r: int, rules: Rules, values: torch.Tensor, rows: torch.Tensor,
                  pos: torch.Tensor, pos0: torch.Tensor, offsets: np.ndarray, lens: np.ndarray,
                  padded: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's writes after its roll (zigzag, cp > 1): two rows per sequence, then the empty sequences'."""
    cp, local = plan.cp_size, rows.shape[0]
    start = np.asarray(plan.cu_seqlens_padded_py[:-1], dtype=np.int64) // cp  # local start of each sequence
    h = padded // cp // 2
    full = padded > 0  # a sequence of no rows (a tokenless one extended by fp8 or a bucket has rows)
    # the first chunk's last row: x_pad[(r + 1) h], its own position id
    nxt = (r + 1) * h
    key1 = (start + h - 1)[full]
    val1 = np.where(nxt < lens, offsets + nxt, -1)[full]
    # the second chunk's last copied row: the next padded row, or the first token where the chunk
    # reaches the end of verl's copy of the sequence (position id 0)
    copied = padded if rules.roll_copy_to_padded else np.maximum(lens, _verl_align(plan))
    r_start, r_end = padded - h * (r + 1), np.minimum(padded - h * r, copied)
    has2 = full & (r_end > r_start)
    wraps = (r_end == copied)[has2]
    key2 = (start + h + (r_end - r_start) - 1)[has2]
    val2 = np.where(r_end == copied, np.where(lens > 0, offsets, -1), np.where(r_end < lens, offsets + r_end, -1))[has2]
    keys = np.concatenate([key1, key2])
    pos_values = pos0[torch.from_numpy(keys)]
    pos_values[key1.size:][torch.from_numpy(wraps)] = 0
    src = np.concatenate([val1, val2])
    empties = np.flatnonzero(~full)
    if empties.size:  # verl's writes for sequences of no rows come after (one dict, insertion order)
        keys, src, pos_values = _clobbers(empties, start, h, lens, padded, r, local, keys, src, pos_values, pos0)
    pos = pos.index_put((torch.from_numpy(keys),), pos_values)
    return _put(rows, keys, values, src), pos


def _clobbers(empties: np.ndarray, start: np.ndarray, h: np.ndarray, lens: np.ndarray, padded: np.ndarray,
              r: int, local: int, keys: np.ndarray, src: np.ndarray, pos_values: torch.Tensor,
              pos0: torch.Tensor) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """A sequence of no rows writes 0 at the row before its start, with that row's position id as
    verl's loop has it then; a first one (key -1, the last row, not written yet: position 0) is
    applied before the last sequence's own write of that row. Where the write would lose a label
    (the row is a token whose next token exists), the drop-in leaves the row as it was."""
    full = np.flatnonzero(padded > 0)
    extra_keys, extra_pos = [], []
    for i in empties.tolist():
        row = int(start[i]) - 1
        if row < 0:
            if (keys == local - 1).any():
                continue  # the last sequence's own write of the last row comes later and stays
            row, position = local - 1, 0
        else:
            position = int(pos0[row])
        owner = int(full[full < i][-1] if start[i] > 0 else full[-1])  # whose second chunk ends at the row
        p = int(padded[owner] - h[owner] * r - 1)
        if p + 1 < lens[owner]:
            continue  # verl loses this label; cpshard keeps it
        extra_keys.append(row)
        extra_pos.append(position)
    if not extra_keys:
        return keys, src, pos_values
    extra = np.asarray(extra_keys, dtype=np.int64)
    keep = ~np.isin(keys, extra)  # one write per row: the clobber replaces an earlier write of it
    return (np.concatenate([keys[keep], extra]), np.concatenate([src[keep], np.full(extra.size, -1)]),
            torch.cat([pos_values[torch.from_numpy(keep)], torch.tensor(extra_pos, dtype=pos_values.dtype)]))
