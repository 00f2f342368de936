"""What a ``cpshard verify`` run compares and reports: the configurations (and the checks of their
arguments), one step and its outcome, its comparison with ``cp = 1``, the report, the progress bar
and the run-time estimate. Shared by the decoder (``verify.py``) and the hybrid model (``hybrid.py``,
whose linear blocks run inside the step through its ``mix``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch
import torch.nn.functional as F

from cpshard.base.choice import Choice
from cpshard.base.errors import check_int, fail
from cpshard.base.layout import Layout, Padding
from cpshard.distributed.collectives import gather, shift_sharded_multi
from cpshard.distributed.sums import sum_over_group
from cpshard.loss.mtp import mtp_loss
from cpshard.ops.sharding import shard, unshard
from cpshard.plan.causal import attention_work
from cpshard.plan.values import ShardPlan
from cpshard.testing.attention import attention
from cpshard.tools.model import DTYPES, MTP_DEPTHS, MTP_SCALE, Mix, TinyDecoder

__all__ = ["RANK_OVERHEAD", "Config", "Kernel", "Model", "Outcome", "Progress", "Report", "Result", "compare",
           "configurations", "estimate_seconds", "naive_skip_reason", "step", "timed_reference"]

#: max |difference| allowed, relative to max(1, max |cp = 1 value|) of each quantity
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 5e-2}
QUANTITIES = ("loss", "logprobs", "mtp_loss", "grads")
MAX_TOKENS = 8192  # the reference attention's work grows with the square of a sequence's length


class Model(Choice, argument="model", what="verify model", where="cpshard.verify.Model"):
    """The model ``cpshard verify`` trains: the tiny decoder, or the hybrid that changes layout inside."""

    DECODER = "decoder"
    HYBRID = "hybrid"


class Kernel(Choice, argument="attention", what="attention kernel", where="cpshard.verify.Kernel"):
    """The CP attention a configuration runs: the reference, or the layout-naive one (to be caught)."""

    REFERENCE = "reference"
    NAIVE = "naive"


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
    # why the naive check was not run: no cp > 1, or the batch cannot show it (naive_skip_reason)
    naive_skipped: str = ""

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


def naive_skip_reason(shown: bool, kernel: str, cp: int | None) -> str:
    """Why the naive check is not run (empty when it is): no ``cp > 1`` was asked for (``cp`` None: a
    layout-naive kernel is wrong only across ranks, and a run at ``cp = 1`` alone starts no ranks), or the
    batch is too small to show it."""
    if cp is None:
        return (f"the layout-naive {kernel} is not run: it can only be wrong across ranks, and no cp above 1 was "
                "asked for; add one, e.g. --cp 1,2, to see it caught")
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


# -- one step ----------------------------------------------------------------------------------


def step(model: TinyDecoder, batch: list[torch.Tensor], plan: ShardPlan, cp_rank: int, group: Any, *,
         attend_fn: Callable[..., torch.Tensor] = attention, device: torch.device | None = None,
         mix: Mix | None = None) -> Outcome:
    """Forward and backward of ``model`` on this rank's rows of ``batch`` (Note [How verify's ranks add
    up to cp = 1]); ``group`` is the CP group, ``None`` at ``cp = 1``; ``attend_fn`` the CP attention
    (:func:`cpshard.attention.attention`, or ``naive_attention`` to see it caught); ``mix`` what runs
    after each layer of the main stack (:meth:`TinyDecoder.hidden`). Returns the batch's values (the
    same on every rank); the model's ``.grad`` are left as this rank's own."""
    start = time.perf_counter()
    dev = device if device is not None else torch.device("cpu")
    dtype = next(model.parameters()).dtype
    ids = shard(batch, plan, cp_rank).to(dev)                       # (L,)
    labels = shard(batch, plan, cp_rank, shift=1).to(dev)           # (L,) next token; 0 past the end
    mask = plan.label_mask(cp_rank, shift=1).to(dev)                # (L,) True where a label exists
    positions = plan.position_ids(cp_rank).to(dev)                  # (L,) for the rotary embedding
    depths = tuple(range(1, MTP_DEPTHS + 1))
    if group is None:
        shifted = torch.stack([shard(batch, plan, cp_rank, shift=d) for d in depths]).to(dev)
    else:  # what a trainer does when the ids exist only sharded: one exchange for every depth
        shifted = shift_sharded_multi([ids], plan, group, shifts=depths)[0]
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend_fn(q, k, v, plan, group)

    model.zero_grad(set_to_none=True)
    chunks = model.hidden(ids, shifted, positions, attend, mix)
    mtp = mtp_loss(chunks, labels, mask.to(dtype), plan, group, output_layer=model.logits,
                   loss_fn=lambda y, z: F.cross_entropy(z, y, reduction="none"), scaling_factor=MTP_SCALE)
    logp = F.log_softmax(model.logits(mtp.hidden), -1)
    token_logp = torch.where(mask, logp.gather(-1, labels[:, None])[:, 0], torch.zeros((), dtype=dtype, device=dev))
    count = sum_over_group(mask.sum().to(dtype), plan, group)
    loss = -plan.cp_size * token_logp.sum() / count
    loss.backward()

    names = [n for n, _ in model.named_parameters()]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1), mtp.losses])
    flat = sum_over_group(flat, plan, group).double().cpu() / plan.cp_size  # one collective: grads, loss, MTP losses
    sizes = [g.numel() for g in grads]
    parts = flat.split(sizes + [1, MTP_DEPTHS])
    if group is None:
        restored = unshard([token_logp.detach()], plan).values()
    else:
        restored = gather(token_logp.detach(), plan, group).values()
    return Outcome(loss=parts[-2][0], logprobs=restored.double().cpu(), mtp_loss=parts[-1],
                   grads={n: g.view(p.shape) for n, g, p in zip(names, parts[:-2], model.parameters())},
                   seconds=time.perf_counter() - start)


# -- how long a run takes ----------------------------------------------------------------------

#: a step across spawned ranks takes about twice its share of the warm cp = 1 step, a spawned rank's first
#: step about twice this process's warm-up, and ranks that start together about twice this process's
#: start-up (the exchanges and gathers, ranks contending for the cores): measured with runs of
#: `cpshard verify` on a shared two-core machine
RANK_OVERHEAD = 2.0
_ESTIMATE_RULE = ("each configuration: the warm cp=1 step's time times its busiest rank's share of the causal "
                  "attention work, or 1/cores when ranks outnumber the cores, times 2 across ranks; plus each "
                  "group's start-up and its first step's warm-up (twice this process's), ranks sharing the cores")
_IMPORT_CPU = time.process_time()  # at import: the CPU time this process spent starting and importing torch


def _startup_seconds() -> float:
    """A spawned rank's start-up: the CPU time this process had used when it imported this module
    (starting Python and importing torch and cpshard, what a spawned rank repeats), between 1 and 15
    seconds, plus a second for the rendezvous.

    CPU time, not the process's age: a process that waited (an interactive session, a notebook, a
    script that did other work first) has an age of minutes but spent none of it importing; an age
    read from ``/proc`` counted that wait once per spawned rank (an estimate of minutes for a run of
    seconds)."""
    return min(max(_IMPORT_CPU, 1.0), 15.0) + 1.0


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def estimate_seconds(reference_seconds: float, plans_by_cp: dict[int, list[ShardPlan]], cpus: int, *,
                     startup: float | None = None, warmup: float = 0.0, overhead: float = RANK_OVERHEAD) -> float:
    """A rough run time for the configurations after the ``cp = 1`` step, which took ``reference_seconds``
    warm (after a first, tiny step that paid this process's first-call costs: ``warmup`` seconds).

    The step's time is mostly the reference attention's, which scales with the causal work (the
    (query, key) pairs scored). A configuration's ranks run at once, so it takes the cp=1 time times
    its busiest rank's share of the work (:func:`cpshard.attention.attention_work`), but no less than
    ``1 / min(cp, cpus)`` of it (ranks that outnumber the cores share them), times ``overhead`` at
    ``cp > 1`` (``RANK_OVERHEAD``). Each spawned group of ``cp`` ranks adds ``(startup + overhead *
    warmup) * cp / min(cp, cpus)`` seconds: every rank starts Python and imports torch (default
    ``startup``: ``overhead`` times this process's own start-up, :func:`_startup_seconds`, as ranks
    that start together contend) and pays the first-call costs again in its first step, those of
    the collectives too. ``plans_by_cp``: every configuration's plan by its ``cp``; configurations
    at ``cp = 1`` run in this process, warm, and start nothing. A guide, not a promise: a loaded
    machine runs slower.

    Example: two zigzag configurations at ``cp = 2`` on two cores, a 4 s warm step whose busiest
    rank holds half the work, 3 s start-up and 1 s warm-up: ``(3 + 2 * 1) * 2 / 2 + 2 * (4 * 0.5 *
    2) = 13`` seconds.
    """
    startup = overhead * _startup_seconds() if startup is None else startup
    total = 0.0
    for cp, plans in plans_by_cp.items():
        cores = max(1, min(cp, cpus))
        if cp > 1:
            total += (startup + overhead * warmup) * cp / cores
        for plan in plans:
            work = attention_work(plan)
            share = max(work) / sum(work) if sum(work) else 1.0 / cp
            total += reference_seconds * max(share, 1.0 / cores) * (overhead if cp > 1 else 1.0)
    return total


def timed_reference(run: Callable[[tuple[int, ...]], Outcome], lengths: tuple[int, ...],
                    plans_by_cp: dict[int, list[ShardPlan]], bar: Progress) -> Outcome:
    """The ``cp = 1`` outcome ``run(lengths)``, timed warm, then the estimate on ``bar``.

    A first step on one 2-token sequence pays this process's first-call costs (lazy imports inside
    torch, first kernels: seconds, whatever the batch), so that the batch's own step is timed warm;
    the first step's time is the warm-up each spawned rank pays again (:func:`estimate_seconds`)."""
    bar.note(f"{sum(lengths)} tokens, {sum(map(len, plans_by_cp.values()))} configurations; the cp=1 reference "
             "step first, then the estimate")
    start = time.perf_counter()
    run((2,))
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    want = run(lengths)
    seconds = time.perf_counter() - start
    bar.step(f"cp=1 reference {seconds:.1f} s")
    cpus = _cpus()
    guess = estimate_seconds(seconds, plans_by_cp, cpus, warmup=warmup)
    bar.note(f"about {duration_text(guess)} more on {cpus} CPU core{'s' if cpus > 1 else ''} ({_ESTIMATE_RULE})")
    return want


def duration_text(seconds: float) -> str:
    """A time as the progress bar says it: ``42 s``, ``7 min 42 s``."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


