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

import torch

from cpshard.layout import Layout, alignment, fp8_alignment
from cpshard.plan import ShardPlan

__all__ = ["Rules", "thd_rows"]


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


def thd_rows(plan: ShardPlan, cp_rank: int, need_roll: bool, rules: Rules) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, pos)`` for rank ``cp_rank``, both ``(L,)`` int64 on the CPU: the flat input row (in the
    caller's order of ``plan``'s sequences) each local row receives, -1 for a zero, and its position
    id, as verl's ``preprocess_thd_engine`` computes them (module docstring)."""
    seq = plan.sequence_ids(cp_rank)
    p = plan.position_ids(cp_rank)
    lens = torch.tensor(plan.seqlens_py, dtype=torch.int64)
    padded = torch.tensor(plan.padded_seqlens_py, dtype=torch.int64)
    in_cu = plan.input_cu_seqlens_py
    order = plan.order if plan.order is not None else range(plan.num_seqs)
    offsets = torch.tensor([in_cu[i] for i in order], dtype=torch.int64)  # buffer sequence -> its first input row
    n, big_p, off = lens[seq], padded[seq], offsets[seq]
    valid = p < n
    zero = torch.full_like(p, -1)
    cp, zigzag = plan.cp_size, plan.layout is Layout.ZIGZAG
    if need_roll and not zigzag:
        q = (p + 1) % n.clamp(min=1)
        return torch.where(valid, off + q, zero), torch.where(valid, q, 0)
    src0 = torch.where(valid, off + p, zero)
    pos0 = torch.where(valid, p, 0)
    if zigzag and cp > 1:
        pos0 = torch.where(p < big_p // 2, p, pos0)
    if not need_roll or p.numel() == 0:
        return src0, pos0
    local = p.numel()
    after = torch.arange(1, local + 1) % local
    src, pos = src0[after], pos0[after]
    if cp == 1:
        return src, pos
    return _zigzag_fixes(plan, cp_rank, rules, src0, pos0, src, pos, offsets, lens, padded)


def _zigzag_fixes(plan: ShardPlan, r: int, rules: Rules, src0: torch.Tensor, pos0: torch.Tensor,
                  src: torch.Tensor, pos: torch.Tensor, offsets: torch.Tensor, lens: torch.Tensor,
                  padded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cp, local = plan.cp_size, src0.numel()
    start = torch.tensor(plan.cu_seqlens_padded_py[:-1], dtype=torch.int64) // cp  # local start of each sequence
    h = padded // cp // 2
    a = _verl_align(plan)
    full = padded > 0  # a sequence of no rows (a tokenless one extended by fp8 or a bucket has rows)
    # the first chunk's last row: the row after the chunk, x_pad[(r + 1) h]; its own position id
    nxt = (r + 1) * h
    key1 = start + h - 1
    val1 = torch.where(nxt < lens, offsets + nxt, -1)
    # the second chunk's last copied row
    copied = padded if rules.roll_copy_to_padded else torch.maximum(lens, torch.full_like(lens, a))
    r_start, r_end = padded - h * (r + 1), torch.minimum(padded - h * r, copied)
    has2 = full & (r_end > r_start)
    key2 = start + h + (r_end - r_start) - 1
    wraps = r_end == copied
    val2 = torch.where(wraps, torch.where(lens > 0, offsets, -1), torch.where(r_end < lens, offsets + r_end, -1))
    k1, k2 = key1[full], key2[has2]
    clean_src, clean_pos = src.clone(), pos.clone()
    clean_src[k1], clean_pos[k1] = val1[full], pos0[k1]
    clean_src[k2] = val2[has2]
    clean_pos[k2] = torch.where(wraps[has2], 0, pos0[k2])
    empties = (~full).nonzero().flatten().tolist()
    if not empties:
        return clean_src, clean_pos
    # A sequence of no rows writes 0 (and the row's position id as the loop has it then) at the row before
    # its start, after the fixes above in verl's insertion order, except that a first empty sequence's
    # key -1 is applied before the last sequence's own fix of the same row.
    out_src, out_pos = clean_src.clone(), clean_pos.clone()
    fixed_last = bool((k2 == local - 1).any() or (k1 == local - 1).any())
    for i in empties:
        row = int(start[i]) - 1
        if row < 0:
            if fixed_last:
                continue
            out_src[local - 1], out_pos[local - 1] = -1, 0  # the last row is not written yet then
        else:
            out_src[row], out_pos[row] = -1, pos0[row]
    # Where that write loses a token's label (a row whose next token exists), keep the clean value.
    lost = plan.label_mask(r) & ((out_src != clean_src) | (out_pos != clean_pos))
    out_src[lost], out_pos[lost] = clean_src[lost], clean_pos[lost]
    return out_src, out_pos

