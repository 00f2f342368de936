"""``cpshard plan --png``: the plan's picture as a figure (matplotlib, the optional ``[plot]`` extra).

One column per plan (zigzag and contiguous side by side with ``--layout both``): on top, which rank
holds each row of the global padded buffer (one band per rank; token rows dark, pad rows light;
sequence boundaries as lines); below, each rank's causal-attention work (the (query, key) pairs it
scores, :func:`cpshard.attention.attention_work`) against the mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cpshard._errors import fail
from cpshard.attention import attention_work
from cpshard.plan import ShardPlan

__all__ = ["draw_plans", "rank_map"]


def rank_map(plan: ShardPlan) -> torch.Tensor:
    """``(cp, T)`` int8: 2 where rank ``r`` holds global row ``g`` as a token, 1 as a pad row, else 0."""
    out = torch.zeros(plan.cp_size, plan.total_len, dtype=torch.int8)
    for r in range(plan.cp_size):
        out[r, plan.global_rows(r)] = plan.token_mask(r).to(torch.int8) + 1
    return out


def _import_matplotlib() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        fail("--png", "given", f"needs matplotlib, which cannot be imported ({exc})",
             "pip install 'cpshard[plot]' (or pip install matplotlib)", kind=ImportError)
    return Figure


def draw_plans(plans: Sequence[ShardPlan], path: str) -> None:
    """Write a PNG to ``path``: each plan's token-to-rank map and per-rank causal work, side by side."""
    if not plans:
        fail("plans", [], "must hold at least one plan", "pass the plans to draw")
    figure_cls = _import_matplotlib()
    from matplotlib import colormaps

    colors = colormaps["tab10"]
    fig = figure_cls(figsize=(6.5 * len(plans), 4.2), dpi=110, layout="constrained")
    axes = fig.subplots(2, len(plans), squeeze=False, height_ratios=[1.4, 1])
    for col, plan in enumerate(plans):
        held = rank_map(plan)
        image = torch.ones(plan.cp_size, plan.total_len, 4)  # RGBA, white where a rank holds nothing
        for r in range(plan.cp_size):
            rgba = torch.tensor(colors(r % 10), dtype=image.dtype)
            image[r][held[r] == 2] = rgba
            image[r][held[r] == 1] = 0.3 * rgba + 0.7  # pad rows: the rank's colour, faded
        top = axes[0][col]
        top.imshow(image.numpy(), aspect="auto", interpolation="nearest",
                   extent=(0, plan.total_len, plan.cp_size - 0.5, -0.5))
        for boundary in plan.cu_seqlens_padded_py[1:-1]:
            top.axvline(boundary, color="black", linewidth=0.6)
        top.set_yticks(range(plan.cp_size), [f"rank {r}" for r in range(plan.cp_size)])
        top.set_xlabel("global padded row (| sequence boundary; faded = pad row)")
        top.set_title(f"{plan.layout.value}: cp={plan.cp_size} tp={plan.tp_size}, {plan.num_seqs} sequences, "
                      f"padding {100 * plan.padding_overhead:.1f}%", fontsize=10)
        work = attention_work(plan)
        mean = sum(work) / len(work)
        bottom = axes[1][col]
        bottom.bar(range(plan.cp_size), work, color=[colors(r % 10) for r in range(plan.cp_size)])
        bottom.axhline(mean, color="black", linestyle="--", linewidth=0.8)
        bottom.set_xticks(range(plan.cp_size), [f"rank {r}" for r in range(plan.cp_size)])
        bottom.set_ylabel("causal work (q, k pairs)")
        ratio = max(work) / mean if mean else 1.0
        bottom.set_title(f"max/mean = {ratio:.3f} (1.000 is balanced)", fontsize=10)
    fig.savefig(path, format="png")
