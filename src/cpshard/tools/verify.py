"""``cpshard verify``: prove a context-parallel configuration end to end, on this machine.

A tiny decoder-only transformer in plain PyTorch (embedding; layers of RMSNorm, rotary attention
on the plan's position ids through :func:`cpshard.attention.attention`, and an MLP; multi-token
prediction depths in Megatron's shape, scored by :func:`cpshard.mtp.mtp_loss`) runs forward and
backward on a built-in batch of varied lengths (long, short, one token, shorter than any
alignment, empty), first at ``cp = 1`` and then across real ``torch.distributed`` ranks for every
requested ``cp``, ``tp`` alignment and layout (and, on request, minimal padding and the balanced
contiguous order), using cpshard end to end: ``shard`` (tokens, labels),
``shift_sharded_multi`` (each MTP depth's input ids), the reference attention, the MTP loss and
``gather`` of the per-token log-probs. Each configuration's loss, per-token log-probs, MTP losses and
every parameter gradient are compared with ``cp = 1``'s. The layout-naive attention under zigzag is
run too, and must be caught.

Note [How verify's ranks add up to cp = 1]
------------------------------------------
Every rank computes the loss of its own rows in Megatron's gradient convention (gradients averaged
over DP x CP): ``cp * sum_local(nll * mask) / n_global``, with ``n_global`` the CP group's token
count (one ``all_reduce``), and the MTP loss with ``normalization="mean"`` and global counts (Note
[MTP token counts] in ``mtp.py``). The reference attention sends every rank the gradient of all
ranks' queries with respect to its keys and values. So the mean over ranks of the losses, and of
the parameter gradients (one ``all_reduce``, divided by ``cp``), equal ``cp = 1``'s; the log-probs
are restored per sequence with ``gather``.

Two ways to run: ``verify()`` spawns one gloo process group per ``cp`` (``cpshard.spawn.run_ranks``)
and runs every configuration of that ``cp`` in it; :func:`verify_launched` runs inside a job that
``torchrun`` started (env:// initialisation, ``cp`` = the world size, any backend), with the
``cp = 1`` reference computed on rank 0.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence

import torch

from cpshard.base.errors import check_int, fail
from cpshard.distributed.sums import max_over
from cpshard.plan.values import Plan, ShardPlan
from cpshard.testing.attention import attention, attention_mask, naive_attention, naive_attention_mask
from cpshard.testing.spawn import joined_group, run_ranks, world_group
from cpshard.tools.model import DTYPES, TinyDecoder, token_batch
from cpshard.tools.results import (  # step and the estimate are verify's names too
    _ESTIMATE_RULE,
    MAX_TOKENS,
    QUANTITIES,
    RANK_OVERHEAD,
    TOLERANCE,
    Config,
    Kernel,
    Model,
    Outcome,
    Progress,
    Report,
    Result,
    _check_args,
    compare,
    configurations,
    duration_text,
    estimate_seconds,
    naive_skip_reason,
    step,
    timed_reference,
)

__all__ = ["DEFAULT_LENGTHS", "MAX_TOKENS", "RANK_OVERHEAD", "Config", "Kernel", "Model", "Report", "Result",
           "TinyDecoder", "estimate_seconds", "format_table", "scale_lengths", "verify", "verify_launched"]

#: long, short, one token, shorter than the alignment of cp = 4 (2 * cp * tp = 8 or 16), empty
DEFAULT_LENGTHS: tuple[int, ...] = (97, 23, 1, 5, 0, 40, 3)



def scale_lengths(lengths: Sequence[int], tokens: int) -> list[int]:
    """``lengths`` scaled down to sum to exactly ``tokens``, keeping the shape of their distribution.

    Every length is multiplied by one factor ``f = tokens / sum(lengths)`` (so every ratio between
    two lengths, every quantile relative to the mean, and the order are kept), then rounded so that
    the sum is exact: down, then up for the largest remainders (each result within one token of
    ``n * f``); an empty sequence stays empty and a non-empty one keeps at least one token (the
    tokens that costs come off the longest lengths). Lengths that already fit are returned unchanged.

    Example: ``scale_lengths([4000, 1000, 500, 0, 3], 1100) == [799, 200, 100, 0, 1]`` (``f = 0.1999``).
    """
    lens = ShardPlan.build(lengths, cp_size=1).seqlens_py
    tokens = check_int("tokens", tokens, minimum=1)
    total = sum(lens)
    if total <= tokens:
        return list(lens)
    nonempty = sum(1 for n in lens if n)
    if nonempty > tokens:
        fail("tokens", tokens, f"is fewer than the batch's {nonempty} non-empty sequences (each keeps at least one "
             "token)", f"scale to at least {nonempty} tokens, or verify a part of the batch")
    exact = [n * tokens / total for n in lens]
    out = [max(math.floor(x), 1 if n else 0) for x, n in zip(exact, lens)]
    left = tokens - sum(out)
    if left > 0:  # the largest remainders among the lengths not raised to one token
        free = sorted((i for i, (x, n) in enumerate(zip(exact, lens)) if n and out[i] == math.floor(x)),
                      key=lambda i: (math.floor(exact[i]) - exact[i], i))
        for i in free[:left]:
            out[i] += 1
    while left < 0:  # raising short ones to one token overshot: take it from the longest (of ties, the
        i = max(range(len(out)), key=lambda j: (out[j], -lens[j], -j))  # shortest, so that the order holds)
        out[i] -= 1
        left += 1
    return out


# -- one step -----------------------------------------------------------------------------------


_KERNELS: dict[str, Callable[..., torch.Tensor]] = {"reference": attention, "naive": naive_attention}


def config_plan(lengths: Sequence[int], config: Config) -> ShardPlan:
    """The plan ``verify`` runs ``config`` with on these lengths."""
    return ShardPlan.build(lengths, cp_size=config.cp, tp_size=config.tp, layout=config.layout,
                           padding=config.padding, reorder=config.reorder)


def reference(lengths: Sequence[int], dtype: torch.dtype, device: torch.device | None = None) -> Outcome:
    """The ``cp = 1``, ``tp = 1`` outcome every configuration is compared with (no communication)."""
    plan = config_plan(lengths, Config(1, 1, "zigzag"))
    return step(TinyDecoder(dtype).to(device or "cpu"), token_batch(lengths), plan, 0, None, device=device)


# -- spawned gloo groups ----------------------------------------------------------------------


def _rank_body(rank: int, world: int, lengths: tuple[int, ...], configs: list[Config], dtype_name: str,
               progress: Progress) -> list[Outcome] | None:
    """Every configuration of one ``cp`` on this rank, in one process group. Rank 0 returns the outcomes."""
    group = world_group()
    batch = token_batch(lengths)
    model = TinyDecoder(DTYPES[dtype_name])
    outcomes = []
    for config in configs:
        outcome = step(model, batch, config_plan(lengths, config), rank, group, attend_fn=_KERNELS[config.attention])
        slowest = torch.tensor([outcome.seconds])
        slowest = max_over(slowest, group)
        outcomes.append(dataclasses.replace(outcome, seconds=float(slowest)))
        if rank == 0:
            progress.step(f"{config.name} {float(slowest):.1f} s")
    return outcomes if rank == 0 else None


def naive_shown(plan: Plan) -> bool:
    """Whether the layout-naive attention can differ from the right one on ``plan``'s batch: whether
    some labelled token row (one with a next token, whose output the losses read) sees another set of
    keys under the naive mask. Pure (the masks of :mod:`cpshard.plan.causal`, one rank at a time)."""
    for r in range(plan.cp_size):
        labelled = plan.label_mask(r).reshape(-1)
        if labelled.any() and not torch.equal(attention_mask(plan, r)[labelled],
                                              naive_attention_mask(plan, r)[labelled]):
            return True
    return False


def verify(lengths: Sequence[int] = DEFAULT_LENGTHS, *, cps: Sequence[int] = (2, 4), tps: Sequence[int] = (1, 2),
           layouts: Sequence[str] = ("zigzag", "contiguous"), dtype: str = "float64",
           attention: Kernel | str = Kernel.REFERENCE, paddings: Sequence[str] = ("aligned",),
           reorders: Sequence[str | None] = (None,), progress: bool = True, timeout: float = 600.0,
           model: Model | str = Model.DECODER) -> Report:
    """Run every configuration against ``cp = 1`` on spawned gloo groups (one per ``cp``).

    ``attention="naive"`` runs every configuration with the layout-naive attention (its zigzag
    configurations must then fail). The naive attention under zigzag is run once more, at the
    smallest ``cp > 1`` and the smallest ``tp`` requested: ``Report.naive_kernel_caught``; where no
    ``cp > 1`` is requested, or on a batch where it cannot differ, it is skipped up front, saying why
    (``Report.naive_skipped``).
    ``model="hybrid"``: the hybrid decoder of ``cpshard.tools.hybrid`` instead (zigzag attention, a scan on
    the contiguous twin, the same MTP depths; ``layouts`` and ``attention`` do not apply and must stay
    at their defaults), whose naive scan must be caught.
    """
    if Model.parse(model) is Model.HYBRID:
        from cpshard.tools.hybrid import verify_hybrid
        if attention != "reference" or tuple(layouts) != ("zigzag", "contiguous"):
            fail("layouts" if attention == "reference" else "attention",
                 repr(list(layouts) if attention == "reference" else attention),
                 "does not apply to model='hybrid' (attention on zigzag and the linear blocks on the contiguous "
                 "twin in every configuration; its layout-naive check is the scan on zigzag rows)",
                 "leave layouts and attention at their defaults")
        return verify_hybrid(lengths, cps=cps, tps=tps, dtype=dtype, paddings=paddings, reorders=reorders,
                             progress=progress, timeout=timeout)
    attention = Kernel.parse(attention).value
    start = time.perf_counter()
    lens, cps, tps, layouts, paddings = _check_args(lengths, cps, tps, layouts, paddings, dtype, reorders)
    configs = [dataclasses.replace(c, attention=attention)
               for c in configurations(cps, tps, layouts, paddings, reorders)]
    naive_cp = min([c for c in cps if c > 1], default=None)  # None: a run at cp = 1 alone starts no ranks
    naive = Config(naive_cp or 2, tps[0], "zigzag", "naive")
    skipped = naive_skip_reason(naive_cp is not None and naive_shown(config_plan(lens, naive)),
                                "attention under zigzag", naive_cp)
    checks = [] if skipped else [naive]
    bar = Progress(total=len(configs) + 1 + len(checks), enabled=progress)
    if skipped:
        bar.note(skipped)
    torch_dtype = DTYPES[dtype]
    by_cp: dict[int, list[Config]] = {}
    for c in dict.fromkeys(configs + checks):  # with attention="naive" the check is one of the configurations
        by_cp.setdefault(c.cp, []).append(c)
    want = timed_reference(lambda lens_: reference(lens_, torch_dtype), lens,
                           {cp: [config_plan(lens, c) for c in cs] for cp, cs in by_cp.items()}, bar)
    outcomes: dict[Config, Outcome] = {}
    for cp, group_configs in by_cp.items():
        if cp == 1:
            for c in group_configs:
                outcomes[c] = step(TinyDecoder(torch_dtype), token_batch(lens), config_plan(lens, c), 0, None,
                                   attend_fn=_KERNELS[c.attention])
                bar.step(c.name)
            continue
        got = run_ranks(_rank_body, cp, lens, group_configs, dtype, bar, timeout=timeout)[0]
        bar.done += len(group_configs)
        outcomes.update(zip(group_configs, got))
    tol = TOLERANCE[torch_dtype]
    results = [compare(c, outcomes[c], want, config_plan(lens, c), tol) for c in configs]
    naive_result = None if skipped else compare(naive, outcomes[naive], want, config_plan(lens, naive), tol)
    return Report(results, naive_result, lens, dtype, tol, time.perf_counter() - start, naive_skipped=skipped)


# -- under torchrun ---------------------------------------------------------------------------


def launched() -> bool:
    """Whether this process was started by ``torchrun`` (or another env:// launcher)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def verify_launched(lengths: Sequence[int] = DEFAULT_LENGTHS, *, backend: str | None = None,
                    tps: Sequence[int] = (1, 2), layouts: Sequence[str] = ("zigzag", "contiguous"),
                    dtype: str = "float64", attention: str = "reference", paddings: Sequence[str] = ("aligned",),
                    reorders: Sequence[str | None] = (None,), progress: bool = True) -> Report | None:
    """Every configuration at ``cp`` = the world size, inside a ``torchrun`` job (env:// initialisation).

    ``backend``: ``"nccl"`` (each rank on ``cuda:LOCAL_RANK``) or ``"gloo"``; default nccl when CUDA
    is available. Rank 0 computes the ``cp = 1`` reference itself and returns the report; the other
    ranks return None. The process group is created and destroyed here.
    """
    world = int(os.environ["WORLD_SIZE"])
    lens, _, tps, layouts, paddings = _check_args(lengths, [world], tps, layouts, paddings, dtype, reorders)
    if world < 2:
        fail("WORLD_SIZE", world, "must be >= 2 (a context-parallel group of one rank proves nothing)",
             "run torchrun --nproc-per-node 2 (or more) -m cpshard verify")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        fail("backend", repr(backend), "must be 'nccl' or 'gloo'", "pass --backend nccl on GPUs, gloo on CPUs")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    with joined_group(backend) as (rank, group):
        start = time.perf_counter()
        torch_dtype = DTYPES[dtype]
        configs = [dataclasses.replace(c, attention=attention)
                   for c in configurations([world], tps, layouts, paddings, reorders)]
        naive = Config(world, tps[0], "zigzag", "naive")
        skipped = naive_skip_reason(naive_shown(config_plan(lens, naive)), "attention under zigzag", world)
        checks = [] if skipped else [naive]
        bar = Progress(total=len(configs) + 1 + len(checks), enabled=progress and rank == 0)
        if skipped:
            bar.note(skipped)
        ref_start = time.perf_counter()
        want = reference(lens, torch_dtype, device) if rank == 0 else None
        ref_seconds = time.perf_counter() - ref_start
        bar.step(f"cp=1 reference {ref_seconds:.1f} s")
        guess = estimate_seconds(ref_seconds, {world: [config_plan(lens, c) for c in configs + checks]}, world,
                                 startup=0.0)
        bar.note(f"about {duration_text(guess)} more ({_ESTIMATE_RULE}; on GPUs far less)")
        model = TinyDecoder(torch_dtype).to(device)
        batch = token_batch(lens)
        results: list[Result] = []
        for c in configs + checks:
            plan = config_plan(lens, c)
            got = step(model, batch, plan, rank, group, attend_fn=_KERNELS[c.attention], device=device)
            bar.step(f"{c.name} {got.seconds:.1f} s")
            if want is not None:
                results.append(compare(c, got, want, plan, TOLERANCE[torch_dtype]))
        if rank != 0:
            return None
        if skipped:
            return Report(results, None, lens, dtype, TOLERANCE[torch_dtype], time.perf_counter() - start,
                          naive_skipped=skipped)
        return Report(results[:-1], results[-1], lens, dtype, TOLERANCE[torch_dtype], time.perf_counter() - start)


# -- the table ------------------------------------------------------------------------------


_LISTED = 16  # up to this many lengths the table's first line lists them; past it, a summary


def _lengths_text(lengths: Sequence[int]) -> str:
    """The batch in the table's first line: ``lengths [97, 23, 1]``, or past 16 of them
    ``2000 lengths (min 1, median 3, max 210; 8192 tokens)`` (a scaled batch of thousands would fill
    kilobytes on one line)."""
    if len(lengths) <= _LISTED:
        return f"lengths {list(lengths)}"
    ranked = sorted(lengths)
    return (f"{len(ranked)} lengths (min {ranked[0]}, median {ranked[len(ranked) // 2]}, max {ranked[-1]}; "
            f"{sum(ranked)} tokens)")


def format_table(report: Report) -> str:
    """The table ``cpshard verify`` prints: one row per configuration, then the naive check."""
    head = ["configuration", "loss", "logprobs", "mtp_loss", "grads", "padding", "attn max/mean", "seconds", ""]
    rows = []
    for r in report.results + ([report.naive] if report.naive is not None else []):
        verdict = "ok" if r.ok else "MISMATCH"
        if r is report.naive:
            verdict = "MISMATCH (caught, as it must be)" if not r.ok else "NOT CAUGHT"
        rows.append([r.config.name] + [f"{r.max_abs_diff[q]:.1e}" for q in QUANTITIES]
                    + [f"{100 * r.padding_overhead:.1f}%", f"{r.attention_imbalance:.3f}", f"{r.seconds:.2f}", verdict])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) if i < len(head) - 1 else str(x)
                       for i, (x, w) in enumerate(zip(line, widths))).rstrip() for line in [head] + rows]
    lines.insert(1, "-" * len(lines[0]))
    summary = (f"{_lengths_text(report.lengths)}, {report.dtype}, max |difference| from cp=1 "
               f"(tolerance {report.tolerance:.0e} x max(1, |cp=1 value|)); {report.seconds:.1f} s")
    naive = "scan on zigzag rows" if report.model == "hybrid" else "attention under zigzag"
    caught = (f"the layout-naive {naive} was caught" if not report.naive_skipped else
              f"the layout-naive {naive} was not run (see above)")
    verdict = (f"OK: every configuration equals cp=1, and {caught}"
               if report.ok else "FAILED: " + "; ".join(
                   [f"{r.config.name} differs from cp=1" for r in report.results if not r.ok]
                   + ([] if report.naive_kernel_caught or report.naive_skipped
                      else [f"the layout-naive {naive} was not caught"])))
    return "\n".join([summary, ""] + lines + ["", *([report.naive_skipped] if report.naive_skipped else []), verdict])
