"""The text ``cpshard plan`` and ``cpshard pack`` print: :func:`describe_plan` (which rows each rank
holds, SPEC.md's picture, the padding and how evenly causal-attention work is spread over the
ranks), :func:`describe_bshd` and :func:`describe_packing`. Pure rendering of plans and packings;
``cpshard.describe_plan`` loads this module, not the command line (``tools/cli.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cpshard.plan.bshd import BshdPlan
from cpshard.plan.causal import attention_work
from cpshard.plan.values import ShardPlan

__all__ = ["PICTURE_MAX_ROWS", "describe_bshd", "describe_packing", "describe_plan"]

PICTURE_MAX_ROWS = 96  # past this many rows the picture gives way to a summary
_MAX_RANK_LINES = 16  # past this many ranks the summary and the balance show the first, the last and the busiest


def _ranks_shown(cp: int, busiest: int) -> list[int]:
    """Which ranks get a line: all up to ``_MAX_RANK_LINES``, else the first six, the busiest and the last two."""
    if cp <= _MAX_RANK_LINES:
        return list(range(cp))
    return sorted({*range(6), busiest, cp - 2, cp - 1})


def _with_gaps(lines: dict[int, str]) -> list[str]:
    """Rank lines in order, with a line saying how many ranks were left out wherever some were."""
    out, last = [], -1
    for r, line in lines.items():
        if r > last + 1:
            out.append(f"  ... ({r - last - 1} ranks, {last + 1} .. {r - 1}, left out)")
        out.append(line)
        last = r
    return out


def _row_label(seq: int, pos: int, n: int) -> str:
    return f"s{seq}p{pos}" if pos < n else "pad"


def _picture(plan: ShardPlan) -> list[str]:
    """SPEC.md's picture: the global padded buffer and each rank's rows, segments split by '|'."""
    lens = plan.seqlens_py
    cells: list[list[str]] = []
    names = ["global"] + [f"rank {r}" for r in range(plan.cp_size)]
    glob = []
    for i in range(plan.num_seqs):
        if i and plan.padded_seqlens_py[i]:
            glob.append("|")
        glob += [_row_label(i, p, lens[i]) for p in range(plan.padded_seqlens_py[i])]
    cells.append(glob)
    for r in range(plan.cp_size):
        seqs, poss = plan.sequence_ids(r).tolist(), plan.position_ids(r).tolist()
        # rows split where a segment begins: at zigzag's chunks (of any size), contiguous rows' sequences
        segs = plan.indices().segments(r)
        cuts = set(segs.start[segs.length > 0].tolist())
        line: list[str] = []
        for j, (s, p) in enumerate(zip(seqs, poss)):
            if j and j in cuts:
                line.append("|")
            line.append(_row_label(s, p, lens[s]))
        cells.append(line)
    width = max((len(c) for line in cells for c in line), default=1)
    head = max(len(n) for n in names)
    return [f"{name:<{head}} : " + " ".join(c.ljust(width) if c != "|" else c for c in line).rstrip()
            for name, line in zip(names, cells)]


def _summary(plan: ShardPlan, ranks: list[int]) -> list[str]:
    """The picture's content for long batches: each rank's runs of consecutive rows, ``s<seq>:<first>-<last>``
    (positions inside the padded sequence, inclusive), capped."""
    lines = {}
    for r in ranks:  # over the rank's segments, never its rows (a summary costs nothing per token)
        seg = plan.indices().segments(r)
        held = np.flatnonzero(seg.length)
        seq, pos, length = seg.seq[held], seg.pos[held], seg.length[held]
        new = np.ones(seq.size, dtype=bool)
        new[1:] = (seq[1:] != seq[:-1]) | (pos[1:] != pos[:-1] + length[:-1])
        first = np.flatnonzero(new)
        last = np.append(first[1:] - 1, seq.size - 1)
        ends = pos[last] + length[last] - 1
        runs = [f"s{s}:{a}-{b}" for s, a, b in zip(seq[first].tolist(), pos[first].tolist(), ends.tolist())]
        shown = runs if len(runs) <= 9 else runs[:6] + ["..."] + runs[-2:] + [f"({len(runs)} runs)"]
        lines[r] = f"rank {r} : {' '.join(shown)}"
    return ["rows per rank as runs s<sequence>:<first position>-<last position>:"] + _with_gaps(lines)


def _balance(plan: ShardPlan, work: list[int], ranks: list[int]) -> list[str]:
    """Per rank: rows, token rows, and causal-attention work (sum over token rows of keys seen)."""
    lines = {}
    for r in ranks:
        tokens = int(plan.indices().segments(r).tokens.sum())
        lines[r] = f"{r:>6} {plan.local_len:>8} {tokens:>8} {plan.local_len - tokens:>8} {work[r]:>14}"
    out = [f"{'rank':>6} {'rows':>8} {'tokens':>8} {'pad':>8} {'causal work':>14}"] + _with_gaps(lines)
    mean = sum(work) / len(work)
    ratio = max(work) / mean if mean else 1.0
    out.append(f"causal work max/mean = {ratio:.3f} (1.000 is perfectly balanced)")
    return out


def _cap(values: Sequence[object], head: int = 8, tail: int = 2) -> str:
    """A list as Python prints it, or its ends and a count when it is long (output stays small)."""
    items = list(values)
    if len(items) <= head + tail + 1:
        return str(items)
    shown = ", ".join(map(str, items[:head])) + ", ..., " + ", ".join(map(str, items[-tail:]))
    return f"[{shown}] ({len(items)} values)"


def describe_plan(plan: ShardPlan, *, picture: bool | None = None) -> str:
    """The text ``cpshard plan`` prints for ``plan``: its sizes and padding, which rows each rank holds,
    and each rank's causal-attention work (max / mean: 1.000 is balanced).

    ``picture=None`` draws SPEC.md's picture (every row, as below) up to 96 rows and else summarises
    each rank's runs of consecutive rows (``s<sequence>:<first>-<last>``); ``True`` / ``False`` force
    either. Long lists are cut to their ends and a count, and past 16 ranks only the first six, the
    busiest and the last two get a line, so the text stays a few kilobytes at any scale::

        >>> text = describe_plan(ShardPlan.build([5, 3], cp_size=2))
        >>> for line in text.splitlines()[5:8]:
        ...     print(line)
        global : s0p0 s0p1 s0p2 s0p3 s0p4 pad  pad  pad  | s1p0 s1p1 s1p2 pad
        rank 0 : s0p0 s0p1 | pad  pad  | s1p0 | pad
        rank 1 : s0p2 s0p3 | s0p4 pad  | s1p1 | s1p2
    """
    out = [
        repr(plan),
        f"alignment a = {plan.alignment}; padded_seqlens = {_cap(plan.padded_seqlens_py)}",
        f"cu_seqlens_padded = {_cap(plan.cu_seqlens_padded_py)}; max_seqlen = {plan.max_seqlen}",
        f"tokens = {plan.num_tokens}, padded rows T = {plan.total_len}, rows per rank L = {plan.local_len} "
        f"(L / tp = {plan.local_len // plan.tp_size}); padding overhead = {100 * plan.padding_overhead:.1f}%",
        "",
    ]
    work = attention_work(plan)
    ranks = _ranks_shown(plan.cp_size, max(range(plan.cp_size), key=work.__getitem__))
    if plan.order is not None:  # s<i> below is the buffer's i-th sequence
        out[-1:] = [f"order = {_cap(plan.order)} (buffer position -> your sequence; s<i> is buffer position i)", ""]
    if picture is None and plan.total_len > PICTURE_MAX_ROWS:
        out += [f"(picture omitted: {plan.total_len} rows > {PICTURE_MAX_ROWS}; pass --picture to force it)", ""]
        out += _summary(plan, ranks) + [""]
    elif picture is False:
        out += ["(picture omitted: --no-picture)", ""]
    else:
        out += _picture(plan) + [""]
    out += _balance(plan, work, ranks)
    return "\n".join(out)


def describe_bshd(plan: BshdPlan) -> str:
    """The text ``cpshard plan --bshd`` prints: each rank's columns of every row."""
    out = [repr(plan), f"alignment = {plan.alignment}; every row padded to M = {plan.max_seqlen}, "
           f"{plan.local_len} columns per rank; padding overhead = {100 * plan.padding_overhead:.1f}%", ""]
    head = max(len(f"rank {plan.cp_size - 1}"), len("row 0"))
    for r in range(plan.cp_size):
        out.append(f"{f'rank {r}':<{head}} : columns {_cap(plan.columns(r).tolist())}")
    if plan.num_seqs * plan.max_seqlen <= 4 * PICTURE_MAX_ROWS:
        out.append("")
        for b, n in enumerate(plan.seqlens_py):
            cells = [[f"t{c}" if c < n else "." for c in plan.columns(r).tolist()] for r in range(plan.cp_size)]
            width = max((len(c) for rank in cells for c in rank), default=1)
            shown = " | ".join(" ".join(c.ljust(width) for c in rank) for rank in cells)
            out.append(f"{f'row {b}':<{head}} : {shown}".rstrip())
    return "\n".join(out)


_MAX_MB_LINES = 16  # past this many micro-batches on a DP rank: the first eight, the slowest and the last two
_MAX_DP_RANKS = 8  # past this many DP ranks: the first four, the slowest and the last two


def _picked(count: int, head: int, tail: int, also: int) -> list[int]:
    if count <= head + tail + 1:
        return list(range(count))
    return sorted({*range(head), also, *range(count - tail, count)})


def _count(k: int) -> str:
    return f"{k} micro-batch" + ("" if k == 1 else "es")


def _mb_line(m: int, ids: Sequence[int], plan: ShardPlan, work: Sequence[int], max_tokens: int) -> str:
    mean = sum(work) / len(work)
    balance = max(work) / mean if mean else 1.0
    return (f"  {m:>4} {len(ids):>5} {plan.total_len:>8} {plan.total_len / max_tokens:>6.3f} {max(work):>14} "
            f"{balance:>8.3f}  {_cap(list(ids), 6, 2)}  {_cap(list(work), 8, 2)}")


def describe_packing(packing: Any, verl: dict[str, Any] | None = None) -> str:
    """The text ``cpshard pack`` prints for a :class:`cpshard.Packing`: per DP rank its micro-batches (the
    sequence indices in buffer order, padded rows against ``max_tokens``, the slowest CP rank's work,
    max / mean over the CP ranks and every CP rank's work), each DP rank's time, then the step ratio
    against ``verl`` (``cpshard.tools.cli.verl_comparison``'s dict, when given) and against the bound. Long lists
    are cut to their ends and a count, and past 16 micro-batches (8 DP ranks) only the first, the
    slowest and the last get a line, so the text stays small at any scale."""
    plan0 = packing.plans[0][0]
    times = [sum(max(w) for w in rank) for rank in packing.work]
    ideal = packing.total_work / (len(packing.work) * plan0.cp_size)
    seqs = sum(len(mb) for rank in packing.micro_batches for mb in rank)
    options = [f"cp={plan0.cp_size}", f"tp={plan0.tp_size}", f"dp={len(packing.work)}", f"layout={plan0.layout.value}",
               f"padding={plan0.padding.value}", "reorder=balanced" if plan0.order is not None else "no reorder"]
    out = [f"{seqs} sequences, max_tokens={packing.max_tokens} (padded rows of one micro-batch, all CP ranks "
           f"together); {', '.join(options)}",
           f"micro-batches per DP rank: {_cap(list(packing.num_micro_batches))}; time = the slowest CP rank's "
           "causal work (q, k pairs), summed over a DP rank's micro-batches", ""]
    dp_shown = (list(range(len(times))) if len(times) <= _MAX_DP_RANKS
                else _picked(len(times), 4, 2, max(range(len(times)), key=times.__getitem__)))
    last = -1
    for d in dp_shown:
        if d > last + 1:
            out += [f"... ({d - last - 1} DP ranks, {last + 1} .. {d - 1}, left out)", ""]
        last = d
        rank = packing.work[d]
        out.append(f"DP rank {d}: {_count(len(rank))}, time {times[d]} ({times[d] / ideal if ideal else 1:.3f} "
                   "x the ideal)")
        out.append(f"  {'mb':>4} {'#seqs':>5} {'rows':>8} {'/max':>6} {'slowest rank':>14} {'max/mean':>8}  "
                   "sequence indices  work per CP rank")
        slow = max(range(len(rank)), key=lambda m: max(rank[m]))
        prev = -1
        for m in _picked(len(rank), 8, 2, slow) if len(rank) > _MAX_MB_LINES else range(len(rank)):
            if m > prev + 1:
                out.append(f"  ... ({m - prev - 1} micro-batches, {prev + 1} .. {m - 1}, left out)")
            prev = m
            out.append(_mb_line(m, packing.micro_batches[d][m], packing.plans[d][m], rank[m], packing.max_tokens))
        out.append("")
    rows = max(p.total_len for rank in packing.plans for p in rank)
    out += ["step ratio = the slowest DP rank's time / (total work / (dp cp)); 1.000 is ideal:",
            f"  cpshard.pack      {packing.step_ratio:.3f}  ({_cap(list(packing.num_micro_batches))} micro-batches, "
            f"largest {rows} rows = {rows / packing.max_tokens:.3f} x max_tokens)"]
    if verl is not None:
        bal = verl["step_ratio_balanced"]
        over = "; OVER the budget" if verl["max_rows"] > packing.max_tokens else ""
        out.append(f"  verl's partition  {verl['step_ratio']:.3f}"
                   + (f" (plain order), {bal:.3f} (reorder=balanced)" if bal is not None else "")
                   + f"  ({_cap(verl['num_micro_batches'])} micro-batches, largest {verl['max_rows']} rows = "
                   f"{verl['max_rows'] / packing.max_tokens:.3f} x max_tokens{over}; {verl['source']})")
    out.append(f"  lower bound       {packing.lower_bound:.3f}  (no packing of these lengths under this budget goes "
               "below it)")
    cmp = []
    if verl is not None:
        balanced = verl["step_ratio_balanced"] is not None
        ref = verl["step_ratio_balanced"] if balanced else verl["step_ratio"]
        which = "verl's partition with reorder=balanced" if balanced else "verl's partition"
        cmp.append(f"{packing.step_ratio / ref - 1:+.1%} against {which}")
    cmp.append(f"{packing.step_ratio / packing.lower_bound - 1:+.1%} above the bound")
    out.append("cpshard.pack: " + "; ".join(cmp))
    return "\n".join(out)
