"""``cpshard plan --png`` and ``cpshard pack --png``: the plan's picture and the packing's step as figures
(matplotlib, the optional ``[plot]`` extra).

One column per plan (zigzag and contiguous side by side with ``--layout both``): on top, which rank
holds each row of the global padded buffer (one band per rank; token rows in the rank's colour, pad
rows faded); below, each rank's causal-attention work (the (query, key) pairs it scores,
:func:`cpshard.attention.attention_work`) against the mean, on one scale for every column.

``cpshard pack --png`` (:func:`draw_packing`): every DP rank's step as a timeline, one lane per DP
rank, one box per micro-batch as wide as its slowest CP rank's work, the mean CP rank's share dark
and the rest (CP ranks waiting for the slowest) light; beside it verl's partition on the same scale.

Readable from 2 to thousands of sequences: past ``_MAX_ROW_BINS`` rows a pixel column stands for a
bin of consecutive rows (its colour the mix of token and pad rows the rank holds there); sequence
boundaries are lines across the map while there are at most ``_MAX_BOUNDARY_LINES`` sequences, and
past that a strip above the map instead (alternate sequences in alternate shades), so that lines
never cover the map.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from cpshard.base.errors import fail
from cpshard.plan.causal import attention_work
from cpshard.plan.values import ShardPlan

__all__ = ["draw_packing", "draw_plans", "plan_title", "rank_map"]

_MAX_ROW_BINS = 1200      # pixel columns of the rank map at most (the figure is ~700 px wide per plan)
_MAX_BOUNDARY_LINES = 32  # sequences whose boundaries are drawn as lines; past it, the sequence strip
_PAD_SHADE = 0.3          # a pad row's colour: this much of the rank's colour, the rest white


def rank_map(plan: ShardPlan) -> torch.Tensor:
    """``(cp, T)`` int8: 2 where rank ``r`` holds global row ``g`` as a token, 1 as a pad row, else 0."""
    out = torch.zeros(plan.cp_size, plan.total_len, dtype=torch.int8)
    for r in range(plan.cp_size):
        out[r, plan.global_rows(r)] = plan.token_mask(r).to(torch.int8) + 1
    return out


def plan_title(plan: ShardPlan, notes: str = "") -> str:
    """Every option the plan was built with, as the figure's title: layout, sizes, padding mode and
    alignment, fp8, the balanced order, then ``notes`` (options a plan does not keep, such as
    ``min_local_rows``), the batch and its padding overhead."""
    options = [plan.layout.value, f"cp={plan.cp_size}", f"tp={plan.tp_size}",
               f"padding={plan.padding.value} (a={plan.alignment})"]
    if plan.fp8:
        options.append("fp8")
    options.append("reorder=balanced" if plan.order is not None else "no reorder")
    options += [notes] if notes else []
    return (", ".join(options) + f"\n{plan.num_seqs} sequences, {plan.num_tokens} tokens, {plan.total_len} rows, "
            f"padding {100 * plan.padding_overhead:.1f}%")


#: a sequence whose zigzag / contiguous chunk spans fewer columns than this is drawn as each rank's share of
#: the whole sequence (its chunks would be stripes narrower than a few pixels: a barcode)
_MIN_CHUNK_COLUMNS = 4


def _held_fractions(plan: ShardPlan, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cp, T)`` float32 each: per rank and global row, how much of it the rank holds as a token row and
    as a pad row. One row per column: exactly the rank map. Coarser, a sequence whose chunks are
    narrower than ``_MIN_CHUNK_COLUMNS`` columns counts, on each of its rows, each rank's share of the
    whole sequence: under zigzag every rank holds its share of every sequence (full bands), under the
    contiguous layout a sequence sits on one rank or two (a staircase), instead of stripes no one can
    read."""
    held = rank_map(plan).numpy()
    tokens, pads = (held == 2).astype(np.float32), (held == 1).astype(np.float32)
    width = plan.total_len / bins
    padded = np.asarray(plan.padded_seqlens_py, dtype=np.int64)
    pieces = 2 * plan.cp_size if plan.layout.value == "zigzag" else plan.cp_size
    narrow = (padded > 0) & (padded < _MIN_CHUNK_COLUMNS * width * pieces)
    if width <= 1 or not narrow.any():
        return tokens, pads
    starts = np.asarray(plan.cu_seqlens_padded_py[:-1], dtype=np.int64)
    seq_of_row = np.repeat(np.arange(padded.size), padded)
    rows = np.flatnonzero(narrow[seq_of_row])  # the rows of the narrow sequences
    nonempty = padded > 0
    for part in (tokens, pads):
        sums = np.zeros((plan.cp_size, padded.size), dtype=np.float32)
        sums[:, nonempty] = np.add.reduceat(part, starts[nonempty], axis=1)
        share = sums / np.maximum(padded, 1)[None, :]
        part[:, rows] = share[:, seq_of_row[rows]]
    return tokens, pads


def _binned(plan: ShardPlan, colors: Any, bins: int) -> np.ndarray:
    """``(cp, bins, 3)`` RGB of the rank map, ``bins`` columns of consecutive rows.

    A rank's cell is its colour at the strength of its share of the column's rows relative to an
    even share (``cp`` times the fraction it holds, at most 1), faded as far as those rows are pad
    rows. With one row per column that is the rank's colour on its token rows, the faded colour on
    its pad rows, and white elsewhere; coarser, short sequences count as each rank's share of them
    (:func:`_held_fractions`), so that under zigzag, where every rank holds its share of every
    sequence, every rank's band stays in full colour at any number of sequences.
    """
    held_tokens, held_pads = _held_fractions(plan, bins)
    edges = np.linspace(0, plan.total_len, bins + 1).round().astype(np.int64)
    width = np.diff(edges)[None, :]
    tokens = np.add.reduceat(held_tokens.astype(np.float64), edges[:-1], axis=1) / width  # (cp, bins) fractions
    pads = np.add.reduceat(held_pads.astype(np.float64), edges[:-1], axis=1) / width
    share = tokens + pads
    strength = np.minimum(1.0, share * plan.cp_size)
    weight = strength * (tokens + _PAD_SHADE * pads) / np.where(share > 0, share, 1.0)
    rgb = np.array([colors(r % 10)[:3] for r in range(plan.cp_size)])[:, None, :]  # (cp, 1, 3)
    return 1.0 - weight[:, :, None] * (1.0 - rgb)  # white where the rank holds nothing


def _sequence_strip(plan: ShardPlan, bins: int) -> np.ndarray:
    """``(1, bins, 3)``: alternate sequences light and dark grey, mixed where a bin holds several."""
    parity = np.repeat(np.arange(plan.num_seqs) % 2, plan.padded_seqlens_py).astype(np.float64)
    edges = np.linspace(0, plan.total_len, bins + 1).round().astype(np.int64)
    dark = np.add.reduceat(parity, edges[:-1]) / np.diff(edges)
    shade = 0.85 - 0.45 * dark
    return np.repeat(shade[None, :, None], 3, axis=2)


def _import_matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        fail("--png", "given", f"needs matplotlib, which cannot be imported ({exc})",
             "pip install 'cpshard[plot]' (or pip install matplotlib)", kind=ImportError)
    return Figure


def _rows(count: float) -> str:
    return f"{count:,.0f}" if count >= 10 else f"{count:.2g}"


def _count_formatter() -> Any:
    """Tick labels for counts of rows or (q, k) pairs: ``0``, ``250k``, ``1.5M``, ``2G`` (never an offset
    such as ``1e8`` in the corner)."""
    from matplotlib.ticker import FuncFormatter

    def label(value: float, _pos: Any = None) -> str:
        for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:.4g}{suffix}"
        return f"{value:.4g}"
    return FuncFormatter(label)


def _rank_ticks(cp: int) -> list[int]:
    step = max(1, -(-cp // 16))
    return list(range(0, cp, step))


def draw_plans(plans: Sequence[ShardPlan], path: str, *, notes: str = "") -> Any:
    """Write a PNG to ``path``: each plan's token-to-rank map and per-rank causal work, side by side
    (the work panels on one scale). ``notes``: options to name in every title that a plan does not
    keep (``cpshard plan`` passes ``--min-local-rows`` and ``--length-bucket``). Returns the
    matplotlib ``Figure``; its axes are ``fig.axes``, the rank maps ``[a for a in fig.axes if
    a.get_label() == "rank map"]``. Needs matplotlib (``pip install 'cpshard[plot]'``)."""
    if not plans:
        fail("plans", [], "must hold at least one plan", "pass the plans to draw")
    figure_cls = _import_matplotlib()
    from matplotlib import colormaps

    colors = colormaps["tab10"]
    strip = any(plan.num_seqs > _MAX_BOUNDARY_LINES for plan in plans)
    fig = figure_cls(figsize=(6.5 * len(plans), 4.8 + 0.3 * strip), dpi=110, layout="constrained")
    heights = ([0.12] if strip else []) + [1.4, 1]
    grid = fig.subplots(len(heights), len(plans), squeeze=False, height_ratios=heights)
    lanes, tops, bottoms = grid if strip else (None, *grid)
    most = max(max(attention_work(plan)) for plan in plans)
    for col, plan in enumerate(plans):
        bins = min(plan.total_len, _MAX_ROW_BINS)
        top = tops[col]
        top.set_label("rank map")
        top.imshow(_binned(plan, colors, bins), aspect="auto", interpolation="nearest",
                   extent=(0, plan.total_len, plan.cp_size - 0.5, -0.5))
        ticks = _rank_ticks(plan.cp_size)
        top.set_yticks(ticks, [f"rank {r}" for r in ticks])
        if plan.num_seqs <= _MAX_BOUNDARY_LINES:
            for boundary in plan.cu_seqlens_padded_py[1:-1]:
                top.axvline(boundary, color="black", linewidth=0.6)
            top.set_xlabel("global padded row (| sequence boundary; faded = pad row)")
        else:
            top.set_xlabel(f"global padded row, in {bins} columns of {_rows(plan.total_len / bins)} rows; a rank's "
                           "colour as strong\nas its share of them (of a short sequence: its share of the sequence); "
                           "faded = pad" if bins < plan.total_len else "global padded row (faded = pad row)",
                           fontsize=8)
        top.xaxis.set_major_formatter(_count_formatter())
        if lanes is not None:
            lane = lanes[col]
            if plan.num_seqs > _MAX_BOUNDARY_LINES:
                lane.imshow(_sequence_strip(plan, bins), aspect="auto", interpolation="nearest",
                            extent=(0, plan.total_len, 0, 1))
                lane.set_title(plan_title(plan, notes), fontsize=9)
                lane.set_ylabel("seqs", fontsize=7, rotation=0, ha="right", va="center")
            else:
                lane.set_axis_off()
                lane.set_title(plan_title(plan, notes), fontsize=9)
            lane.set_xticks([])
            lane.set_yticks([])
        else:
            top.set_title(plan_title(plan, notes), fontsize=9)
        work = attention_work(plan)
        mean = sum(work) / len(work)
        bottom = bottoms[col]
        bottom.bar(range(plan.cp_size), work, color=[colors(r % 10) for r in range(plan.cp_size)])
        bottom.axhline(mean, color="black", linestyle="--", linewidth=0.8)
        bottom.set_xticks(ticks, [f"{r}" for r in ticks])
        bottom.set_xlabel("rank")
        bottom.set_ylim(0, 1.05 * most if most else 1)  # one scale for every column
        bottom.set_ylabel("causal work (q, k pairs)")
        bottom.yaxis.set_major_formatter(_count_formatter())
        ratio = max(work) / mean if mean else 1.0
        bottom.set_title(f"max/mean = {ratio:.3f} (1.000 is balanced)", fontsize=9)
    fig.savefig(path, format="png")
    return fig


def micro_batch_label(m: int, seqs: int | None, px: float) -> str:
    """A micro-batch's label in a box ``px`` pixels wide: ``mb 3: 12 seqs`` where it fits, ``3`` where
    only the index does, nothing in a sliver."""
    full = f"mb {m}" + ("" if seqs is None else f": {seqs} seq" + ("" if seqs == 1 else "s"))
    for text in (full, f"mb {m}", f"{m}"):
        if len(text) * 5.5 + 6 <= px:  # fontsize 7: about 5.5 px a character at this figure's dpi
            return text
    return ""


def draw_packing(packing: Any, path: str, *,
                 others: Sequence[tuple[str, Sequence[Sequence[Sequence[int]]]]] = ()) -> Any:
    """Write a PNG to ``path``: the step of a :class:`cpshard.Packing` as a timeline per DP rank, and of
    each ``(label, work)`` in ``others`` (``work[d][m]``: micro-batch ``m`` of DP rank ``d``, its per-CP-rank
    works; ``cpshard pack`` passes verl's partition), one panel each on one time scale.

    A micro-batch is a box as wide as its slowest CP rank's work (the time it takes), labelled with
    its index on its DP rank (and, for the packing, its number of sequences) where the box is wide
    enough, dark for the mean CP rank's share and light for the rest (idle CP ranks waiting for the
    slowest); the time axis counts (q, k) pairs as ``250k``, ``1.5M``, ``2G``; the dashed
    line is the ideal step (total work over ``dp * cp``), the dotted one the packing's lower bound.
    Returns the matplotlib ``Figure``; the timelines are ``[a for a in fig.axes if a.get_label() ==
    "timeline"]``. Needs matplotlib (``pip install 'cpshard[plot]'``)."""
    figure_cls = _import_matplotlib()
    from matplotlib import colormaps

    colors = colormaps["tab10"]
    panels = [("cpshard.pack", packing.work), *others]
    sizes = [[len(mb) for mb in rank] for rank in packing.micro_batches]
    cp = len(packing.work[0][0])
    ideal = packing.total_work / (len(packing.work) * cp)
    longest = max(sum(max(w) for w in rank) for _, work in panels for rank in work)
    lanes = max(len(work) for _, work in panels)
    fig = figure_cls(figsize=(7.5, 1.2 + (0.35 * min(lanes, 16) + 1.0) * len(panels)), dpi=110, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    xmax = 1.02 * longest if longest else 1.0
    for ax, (label, work) in zip(axes, panels):
        ax.set_label("timeline")
        lane_px = ax.get_position().width * fig.get_figwidth() * fig.dpi  # the panel's width in pixels, about
        for d, rank in enumerate(work):
            start = 0.0
            for m, w in enumerate(rank):
                slow, mean = max(w), sum(w) / len(w)
                colour = colors(m % 10)
                ax.broken_barh([(start, slow)], (d - 0.4, 0.8), facecolors=[(*colour[:3], 0.3)], edgecolor="white",
                               linewidth=0.4)
                ax.broken_barh([(start, mean)], (d - 0.4, 0.8), facecolors=[colour], linewidth=0)
                text = micro_batch_label(m, sizes[d][m] if work is packing.work else None, slow / xmax * lane_px)
                if text:
                    ax.text(start + slow / 2, d, text, ha="center", va="center", fontsize=7, clip_on=True,
                            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.75, "linewidth": 0})
                start += slow
        ax.axvline(ideal, color="black", linestyle="--", linewidth=0.9)
        ax.axvline(ideal * packing.lower_bound, color="black", linestyle=":", linewidth=0.9)
        ticks = list(range(0, len(work), max(1, -(-len(work) // 16))))
        ax.set_yticks(ticks, [f"DP {d}" for d in ticks])
        ax.set_ylim(len(work) - 0.5, -0.5)
        ax.set_xlim(0, xmax)  # one scale for every panel
        ax.xaxis.set_major_formatter(_count_formatter())
        step = max(sum(max(w) for w in rank) for rank in work)
        counts = sorted({len(rank) for rank in work})
        ax.set_title(f"{label}: step ratio {step / ideal if ideal else 1.0:.3f}, "
                     f"{'/'.join(map(str, counts))} micro-batches per DP rank", fontsize=9)
    axes[-1].set_xlabel("time: the slowest CP rank's causal work (q, k pairs; k = thousand, M = million, G = "
                        "billion)\nbox = micro-batch (mb <index>: <sequences>); dark = the mean CP rank's share; "
                        "dashed: the ideal step\n(total work / (dp cp)); dotted: the packing's lower bound",
                        fontsize=9)
    fig.savefig(path, format="png")
    return fig
