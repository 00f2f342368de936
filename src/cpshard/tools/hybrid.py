"""``cpshard verify --model hybrid``: a tiny hybrid decoder that changes layout inside the model.

Its layers alternate the reference attention on a zigzag plan (``cpshard.attention``) and a linear
block on the plan's contiguous twin (``cpshard.twin_plan``): a causal short convolution and the
reference scan (``cpshard.scan.linear_scan``), with ``cpshard.distributed.relayout`` into the twin
before the block and back after it; the decoder's MTP depths follow (attention on zigzag). Loss,
per-token log-probs, MTP losses and every parameter gradient are compared with ``cp = 1`` as in
``cpshard.verify`` (Note [How verify's ranks add up to cp = 1]), for
every ``cp``, ``tp``, padding and twin order; the **layout-naive** variant, the linear block run on
the zigzag rows as if they were the contiguous twin's (no relayout), must be caught.

The convolution's look-back (the ``CONV - 1`` rows before each segment's first row, which live on
the ranks before it under the contiguous layout) is ``shift_sharded(x, shift=-j)`` for ``j = 1 ..
CONV - 1``: SPEC's look-back shift, one all-to-all each of only the rows that cross a rank boundary,
differentiable; the layout-naive variant runs the same shifts believing the zigzag rows contiguous.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cpshard.base.layout import Layout
from cpshard.distributed.collectives import relayout, shift_sharded
from cpshard.distributed.sums import max_over
from cpshard.plan.twins import twin
from cpshard.plan.values import ShardPlan
from cpshard.testing.scan import linear_scan, naive_linear_scan
from cpshard.testing.spawn import run_ranks, world_group
from cpshard.tools.model import DTYPES, HIDDEN, LAYERS, TinyDecoder, _rms_norm, token_batch
from cpshard.tools.results import (
    TOLERANCE,
    Config,
    Outcome,
    Progress,
    Report,
    _check_args,
    compare,
    naive_skip_reason,
    step,
    timed_reference,
)

__all__ = ["CONV", "HybridConfig", "HybridDecoder", "hybrid_step", "verify_hybrid"]

CONV = 4  # the causal convolution's width: each row sees itself and the CONV - 1 rows before it
PAIRS = LAYERS  # (attention, linear) layer pairs: a linear block after each attention layer


@dataclass(frozen=True)
class HybridConfig(Config):
    """A verify configuration of the hybrid model: attention on the zigzag plan, the linear blocks on
    its contiguous twin in ``reorder``'s order (``None``: the same order; ``"balanced"``);
    ``attention="naive"``: the linear blocks on the zigzag rows, believed contiguous."""

    @property
    def name(self) -> str:
        twin_order = "balanced twin" if self.reorder else "contiguous twin"
        padding = "" if self.padding == "aligned" else f" {self.padding} padding"
        naive = ", naive scan (zigzag rows)" if self.attention == "naive" else ""
        return f"cp={self.cp} tp={self.tp} zigzag+{twin_order}{padding}{naive}"


def causal_conv(x: torch.Tensor, weight: torch.Tensor, plan: ShardPlan, rank: int, group: Any) -> torch.Tensor:
    """Per document, ``y_t = sum_j weight[j] * x_{t - j}`` for ``j < CONV`` (rows before the document's
    start count as 0), on ``x`` ``(L, C)`` laid out by ``plan``; 0 on pad rows. Each look-back is
    ``shift_sharded(x, shift=-j)`` (``fill`` 0 before the start, 0 on pad rows)."""
    tok = plan.token_mask(rank).to(x.device)
    out = weight[0] * x * tok.to(x.dtype)[:, None]
    for j in range(1, CONV):
        out = out + weight[j] * shift_sharded(x, plan, group, shift=-j, fill=0, pad_value=0)
    return out


class LinearBlock(nn.Module):
    """Pre-norm block: a gate ``a = sigmoid(.)``, a causal short convolution of the input, the
    reference scan ``h_t = a_t h_{t-1} + conv_t``, an output projection."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden))
        self.inp = nn.Linear(hidden, 2 * hidden, bias=False)
        self.conv = nn.Parameter(torch.randn(CONV, hidden) / CONV)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, plan: ShardPlan, rank: int, group: Any, naive: bool) -> torch.Tensor:
        u, g = self.inp(_rms_norm(x, self.norm)).chunk(2, -1)
        belief = twin(plan, Layout.CONTIGUOUS) if naive else plan
        assert isinstance(belief, ShardPlan)
        conv = causal_conv(u, self.conv, belief, rank, group)
        scan = naive_linear_scan if naive else linear_scan
        return x + self.out(scan(torch.sigmoid(g), conv, plan, group if plan.cp_size > 1 else None))


class HybridDecoder(TinyDecoder):
    """:class:`~cpshard.verify.TinyDecoder` (embedding, attention layers, the MTP depths, the output
    layer) with a :class:`LinearBlock` after each attention layer of the main stack. Deterministic
    initialisation (the decoder's seed 0, the linear blocks' seed 1)."""

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        super().__init__(dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            self.linear = nn.ModuleList(LinearBlock(HIDDEN) for _ in range(PAIRS))
        self.to(dtype)


def hybrid_step(model: HybridDecoder, batch: list[torch.Tensor], plan: ShardPlan, contiguous: ShardPlan,
                rank: int, group: Any, naive: bool = False) -> Outcome:
    """:func:`cpshard.verify.step` (loss, log-probs, MTP losses, gradients) with attention on ``plan``
    (zigzag) and each linear block on its twin ``contiguous`` (through ``relayout``), or on ``plan``'s
    rows themselves when ``naive``."""
    def mix(i: int, h: torch.Tensor) -> torch.Tensor:
        lin = model.linear[i]
        if naive:
            return lin(h, plan, rank, group, naive=True)
        if group is None:  # cp = 1: both layouts are the identity
            return lin(h, contiguous, rank, None, naive=False)
        return relayout(lin(relayout(h, plan, contiguous, group), contiguous, rank, group, naive=False),
                        contiguous, plan, group)

    return step(model, batch, plan, rank, group, mix=mix)


def _plans(lengths: Sequence[int], c: Config) -> tuple[ShardPlan, ShardPlan]:
    plan = ShardPlan.build(lengths, cp_size=c.cp, tp_size=c.tp, padding=c.padding)
    contiguous = twin(plan, Layout.CONTIGUOUS, "balanced" if c.reorder else "same")
    assert isinstance(contiguous, ShardPlan)
    return plan, contiguous


def _run(lengths: tuple[int, ...], c: Config, dtype: torch.dtype, rank: int, group: Any) -> Outcome:
    plan, contiguous = _plans(lengths, c)
    return hybrid_step(HybridDecoder(dtype), token_batch(lengths), plan, contiguous, rank, group,
                       naive=c.attention == "naive")


def _rank_body(rank: int, world: int, lengths: tuple[int, ...], configs: list[Config], dtype_name: str,
               progress: Progress) -> list[Outcome] | None:
    outcomes = []
    for c in configs:
        got = _run(lengths, c, DTYPES[dtype_name], rank, world_group())
        slowest = torch.tensor([got.seconds])
        slowest = max_over(slowest, world_group())
        outcomes.append(dataclasses.replace(got, seconds=float(slowest)))
        if rank == 0:
            progress.step(f"{c.name} {float(slowest):.1f} s")
    return outcomes if rank == 0 else None


def verify_hybrid(lengths: Sequence[int], *, cps: Sequence[int] = (2, 4), tps: Sequence[int] = (1, 2),
                  dtype: str = "float64", paddings: Sequence[str] = ("aligned", "minimal"),
                  reorders: Sequence[str | None] = (None, "balanced"), progress: bool = True,
                  timeout: float = 600.0) -> Report:
    """Every (cp, tp, padding, twin order) of the hybrid model against ``cp = 1``, on spawned gloo
    groups, and the layout-naive scan at the smallest ``cp > 1`` and ``tp`` requested, which must be
    caught. After the ``cp = 1`` step, a run-time estimate (:func:`cpshard.verify.estimate_seconds`)."""
    start = time.perf_counter()
    lens, cps, tps, _, paddings = _check_args(lengths, cps, tps, ["zigzag"], paddings, dtype, reorders)
    configs = [HybridConfig(cp, tp, "zigzag", padding=p, reorder=r)
               for cp in cps if cp > 1 for tp in tps for p in paddings for r in dict.fromkeys(reorders)]
    naive_cp = min([c for c in cps if c > 1], default=None)  # None: no ranks to be wrong across
    naive = HybridConfig(naive_cp or 2, tps[0], "zigzag", "naive")
    skipped = naive_skip_reason(naive_cp is not None and naive_scan_shown(_plans(lens, naive)[0]),
                                "scan on zigzag rows", naive_cp)
    checks = [] if skipped else [naive]
    torch_dtype = DTYPES[dtype]
    by_cp: dict[int, list[Config]] = {}
    for c in dict.fromkeys(configs + checks):
        by_cp.setdefault(c.cp, []).append(c)
    bar = Progress(total=len(configs) + 1 + len(checks), enabled=progress)
    if skipped:
        bar.note(skipped)
    want = timed_reference(lambda lens_: _run(lens_, HybridConfig(1, 1, "zigzag"), torch_dtype, 0, None), lens,
                           {cp: [_plans(lens, c)[0] for c in cs] for cp, cs in by_cp.items()}, bar)
    outcomes: dict[Config, Outcome] = {}
    for cp, group_configs in sorted(by_cp.items()):
        outcomes.update(zip(group_configs, run_ranks(_rank_body, cp, lens, group_configs, dtype, bar,
                                                     timeout=timeout)[0]))
        bar.done += len(group_configs)
    tol = TOLERANCE[torch_dtype]
    results = [compare(c, outcomes[c], want, _plans(lens, c)[0], tol) for c in configs]
    naive_result = None if skipped else compare(naive, outcomes[naive], want, _plans(lens, naive)[0], tol)
    return Report(results, naive_result, lens, dtype, tol, time.perf_counter() - start, model="hybrid",
                  naive_skipped=skipped)


def naive_scan_shown(plan: ShardPlan) -> bool:
    """Whether the layout-naive scan can differ from the right one on ``plan``'s batch: whether some
    labelled token row (one with a next token) is believed at another (sequence, position) when
    ``plan``'s zigzag rows are read as its contiguous twin's, or its predecessor in the sequence is.
    Pure."""
    belief = twin(plan, Layout.CONTIGUOUS)
    for r in range(plan.cp_size):
        seq, pos = plan.sequence_ids(r), plan.position_ids(r)
        believed = (belief.sequence_ids(r), belief.position_ids(r))
        moved = (seq != believed[0]) | (pos != believed[1])
        before = torch.cat([torch.zeros(1, dtype=torch.bool), moved[:-1]])  # the row a scan reads first
        if (plan.label_mask(r) & (moved | before)).any():
            return True
    return False

