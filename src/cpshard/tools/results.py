"""What a ``cpshard verify`` run compares and reports: the configurations (and the checks of their
arguments), one step's outcome, its comparison with ``cp = 1``, the report, and the progress bar.
Shared by the decoder (``verify.py``) and the hybrid model (``hybrid.py``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from cpshard.base.errors import check_int, fail
from cpshard.base.layout import Layout, Padding
from cpshard.plan.causal import attention_work
from cpshard.plan.values import ShardPlan
from cpshard.tools.model import DTYPES

__all__ = ["Config", "Outcome", "Progress", "Report", "Result", "compare", "configurations", "naive_skip_reason"]

#: max |difference| allowed, relative to max(1, max |cp = 1 value|) of each quantity
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}
QUANTITIES = ("loss", "logprobs", "mtp_loss", "grads")
MAX_TOKENS = 8192  # the reference attention's work grows with the square of a sequence's length


# -- configurations and results ---------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One configuration: CP size, TP alignment, layout, which attention (``"reference"`` or
    ``"naive"``, the layout-naive kernel), the plan's padding (``"aligned"`` or ``"minimal"``) and
    sequence order (``None``, or ``"balanced"`` under the contiguous layout)."""

    cp: int
    tp: int
    layout: str
    attention: str = "reference"
    padding: str = "aligned"
    reorder: str | None = None

    @property
    def name(self) -> str:
        naive = ", naive attention" if self.attention == "naive" else ""
        padding = "" if self.padding == "aligned" else f" {self.padding} padding"
        order = f" {self.reorder} order" if self.reorder else ""
        return f"cp={self.cp} tp={self.tp} {self.layout}{padding}{order}{naive}"


@dataclass(frozen=True)
class Outcome:
    """What one step produces (float64 on the CPU): the batch's loss, per-token log-probs (tokens in
    order, 0 where a token has no label), the MTP losses per depth, and every parameter gradient."""

    loss: torch.Tensor
    logprobs: torch.Tensor
    mtp_loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    seconds: float


@dataclass(frozen=True)
class Result:
    """One configuration compared with ``cp = 1``."""

    config: Config
    ok: bool
    max_abs_diff: dict[str, float]
    padding_overhead: float
    attention_work: list[int]
    seconds: float

    @property
    def attention_imbalance(self) -> float:
        """Per-rank attention work, max / mean (1.0 is balanced)."""
        mean = sum(self.attention_work) / len(self.attention_work)
        return max(self.attention_work) / mean if mean else 1.0

    def as_json(self) -> dict[str, Any]:
        c = self.config
        return {"cp": c.cp, "tp": c.tp, "layout": c.layout, "attention": c.attention, "padding": c.padding,
                "reorder": c.reorder, "ok": self.ok, "max_abs_diff": dict(self.max_abs_diff),
                "padding_overhead": self.padding_overhead, "attention_imbalance": self.attention_imbalance,
                "attention_work": list(self.attention_work), "seconds": self.seconds}


@dataclass(frozen=True)
class Report:
    """The whole run: every configuration's result, and the naive-attention check."""

    results: list[Result]
    naive: Result | None
    lengths: tuple[int, ...]
    dtype: str
    tolerance: float
    seconds: float
    model: str = "decoder"  # or "hybrid" (cpshard.tools.hybrid: attention on zigzag, a scan on its contiguous twin)
    naive_skipped: str = ""  # why the naive check was not run: the batch cannot show it (naive_skip_reason)

    @property
    def naive_kernel_caught(self) -> bool:
        """The layout-naive attention under zigzag was reported as a mismatch."""
        return self.naive is not None and not self.naive.ok

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results) and (self.naive_kernel_caught or bool(self.naive_skipped))

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "naive_kernel_caught": self.naive_kernel_caught, "naive_skipped": self.naive_skipped,
                "results": [r.as_json() for r in self.results],
                "naive": self.naive.as_json() if self.naive is not None else None,
                "lengths": list(self.lengths), "dtype": self.dtype, "tolerance": self.tolerance,
                "seconds": self.seconds, "model": self.model}


def naive_skip_reason(shown: bool, kernel: str, cp: int) -> str:
    """Why the naive check is not run (empty when it is): the batch is too small to show it."""
    if shown:
        return ""
    return (f"the layout-naive {kernel} is not run: on this batch at cp={cp} it computes every labelled token "
            "exactly as the right one does (the batch is too small to show it wrong); pass a longer sequence, "
            "e.g. --lengths 9,1,4, to see it caught")


def compare(config: Config, got: Outcome, want: Outcome, plan: ShardPlan, tolerance: float) -> Result:
    """``got`` against the ``cp = 1`` outcome ``want``: max |difference| of each quantity, and whether
    each is within ``tolerance * max(1, max |want|)``."""
    pairs = {"loss": [(got.loss, want.loss)], "logprobs": [(got.logprobs, want.logprobs)],
             "mtp_loss": [(got.mtp_loss, want.mtp_loss)],
             "grads": [(got.grads[n], want.grads[n]) for n in want.grads]}
    diffs, ok = {}, True
    for name, items in pairs.items():
        diff = max(float((a - b).abs().max()) if b.numel() else 0.0 for a, b in items)
        scale = max([1.0] + [float(b.abs().max()) for _, b in items if b.numel()])
        diffs[name] = diff
        ok = ok and math.isfinite(diff) and diff <= tolerance * scale
    return Result(config, ok, diffs, plan.padding_overhead, attention_work(plan), got.seconds)


# -- progress -------------------------------------------------------------------------------


@dataclass
class Progress:
    """A one-line progress bar on a stream (stderr): one step per configuration.

    Picklable, so that rank 0 of a spawned group draws the steps its configurations take; on a
    terminal the line is redrawn in place, elsewhere each step is a line of its own.
    """

    total: int
    done: int = 0
    enabled: bool = True
    width: int = 24

    def note(self, text: str, stream: TextIO | None = None) -> None:
        """A line of its own (the run-time estimate), when the bar is enabled."""
        if self.enabled:
            out = stream if stream is not None else sys.stderr
            out.write(f"cpshard verify: {text}\n")
            out.flush()

    def step(self, label: str, stream: TextIO | None = None) -> None:
        self.done += 1
        if not self.enabled:
            return
        out = stream if stream is not None else sys.stderr
        filled = round(self.width * self.done / max(self.total, 1))
        line = f"cpshard verify [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {label}"
        tty = out.isatty()
        out.write(("\r\x1b[2K" + line if tty else line + "\n") + ("\n" if tty and self.done >= self.total else ""))
        out.flush()


def configurations(cps: Sequence[int], tps: Sequence[int], layouts: Sequence[str],
                   paddings: Sequence[str] = ("aligned",), reorders: Sequence[str | None] = (None,)) -> list[Config]:
    """Every ``(cp, tp, layout, padding, reorder)``; at ``cp = 1`` the layouts are one (both are the
    identity). ``reorders`` are ``ShardPlan.build``'s ``reorder`` values: ``"balanced"`` applies to
    the contiguous layout at ``cp > 1`` and is skipped elsewhere."""
    out = []
    for cp in cps:
        for tp in tps:
            for layout in (layouts if cp > 1 else layouts[:1]):
                for padding in paddings:
                    for reorder in reorders:
                        if reorder is None or (cp > 1 and layout == Layout.CONTIGUOUS.value):
                            out.append(Config(cp, tp, layout, padding=padding, reorder=reorder))
    return out


def _check_args(lengths: Sequence[int], cps: Sequence[int], tps: Sequence[int], layouts: Sequence[str],
                paddings: Sequence[str], dtype: str, reorders: Sequence[str | None] = (None,)
                ) -> tuple[tuple[int, ...], list[int], list[int], list[str], list[str]]:
    lens = ShardPlan.build(lengths, cp_size=1).seqlens_py
    if isinstance(reorders, (str, bool)) or any(r not in (None, "balanced") for r in reorders) or not reorders:
        fail("reorders", repr(reorders), "must be a non-empty sequence of ShardPlan.build's reorder values "
             "(None, 'balanced')", "pass reorders=(None, 'balanced') to run both orders")
    if all(n < 2 for n in lens):
        fail("lengths", list(lens), "must hold a sequence of at least 2 tokens (else no token has a label and the "
             "loss is 0 / 0)", "add a longer sequence, e.g. --lengths 9,1,4")
    if sum(lens) > MAX_TOKENS:
        fail("lengths", f"{sum(lens)} tokens", f"must sum to at most {MAX_TOKENS} (the reference attention holds "
             "an (L, cp * L) score matrix per head)", "verify a smaller batch with the same shape of lengths")
    cps = sorted({check_int("cp", c, minimum=1) for c in cps})
    tps = sorted({check_int("tp", t, minimum=1) for t in tps})
    layouts = [Layout.parse(x).value for x in layouts]
    paddings = list(dict.fromkeys(Padding.parse(x).value for x in paddings))
    if not cps or not tps or not layouts or not paddings:
        fail("cp", (cps, tps, layouts), "every list must hold at least one value", "pass e.g. --cp 2,4")
    if dtype not in DTYPES:
        fail("dtype", repr(dtype), f"must be one of {', '.join(DTYPES)}", "pass --dtype float64")
    return lens, cps, tps, list(dict.fromkeys(layouts)), paddings
