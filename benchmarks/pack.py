"""Benchmark: micro-batch packing against verl's partition.

Run (CPU, one process, one torch thread unless ``--threads``)::

    .venv/bin/python benchmarks/pack.py            # 20 global batches per configuration
    .venv/bin/python benchmarks/pack.py --quick    # 3 global batches, fewer timing repeats
    .venv/bin/python benchmarks/pack.py --sweep    # only the time sweep, 512 .. 32768 sequences

Global batches: document lengths ~ exponential(mean 2048), at least 1, capped at 32768, drawn until
they fill ``dp * 16`` micro-batches of 32768 tokens (the last one cut to fill it exactly; the longest cut in
two while the count does not divide by ``dp``, as verl's DP split needs), one fixed
seed per batch; ``dp = 2``; ``max_tokens = 32768``. Configurations: cp 4 and 8 contiguous, cp 4
zigzag (tp 1). Also RL-like batches: 512 responses of 64..4096 tokens (uniform), tp 8, cp 8, zigzag
and contiguous, ``max_tokens = 32768``.

Columns, per configuration, the mean over the batches:

* ``verl``: verl's partition with the plain order. The DP split is verl's ``_balance_batch``
  (Karmarkar-Karp into ``dp`` equal-sized parts on ``24576 s + s**2``), then on every DP rank verl's
  ``rearrange_micro_batches`` rule: ``ceil(tokens / max_tokens)`` micro-batches (the max over DP ranks),
  Karmarkar-Karp on the same workload, raised by one until every part's **unpadded** tokens fit.
  With verl installed its own ``get_seqlen_balanced_partitions`` runs; without it, a re-statement
  (longest-processing-time greedy; ``cpshard.compat.verl_partition``, which the
  CLI's ``cpshard pack`` shares) and the header says so.
* ``verl+bal``: the same partition, every contiguous micro-batch built with ``reorder="balanced"``.
* ``pack``: ``cpshard.pack`` (its own buffer order); ``pack+bal``: the same with ``reorder="balanced"``.
* ``bound``: ``Packing.lower_bound``, a ratio no packing reaches below.
* ``vs bal``: ``pack / verl+bal - 1`` (negative: better); ``vs bnd``: ``pack / bound - 1``;
  ``mb``: micro-batches per DP rank (verl, pack);
  ``rows/max``: the largest padded micro-batch over ``max_tokens`` (verl, pack); ``ms``: the median
  time of one ``cpshard.pack`` call (no reorder); ``/verl``: that time over the time of verl's
  partition (the DP split and every DP rank's micro-batches, which is what ``pack`` replaces) on the
  same batch, in the same process.

The **sweep** (``--sweep``, or after the table unless ``--no-large``): ``n`` = 512 .. 32768 exponential
lengths (mean 2048, capped at 32768), ``dp = 2`` below 4096 sequences and 8 from there, ``max_tokens =
32768``; per size the least time of ``cpshard.pack`` (zigzag cp=4, contiguous cp=8) and of verl's
partition (one call each past 8192 sequences, where verl's count search takes minutes), their ratio,
``us/seq`` and ``x1024``, the time per sequence over that at 1024. Then the drop-in path as verl calls
it: one DP rank's share (``n / dp`` samples, a TensorDict of ``input_ids`` and a bool
``attention_mask``), ``cpshard.compat.verl.rearrange_micro_batches`` against verl's own
``rearrange_micro_batches`` (both select the micro-batches' rows).

The step ratio is ``max_d sum_m max_r work / (total work / (dp cp))`` (Note [Micro-batch packing]).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

import torch
from _timing import gc_off_ms

from cpshard import ShardPlan
from cpshard.compat import verl_partition, verl_partitioner
from cpshard.pack import pack, plan_work, step_ratio

MAX_TOKENS = 32768
MEAN_LEN = 2048

VERL = verl_partitioner() is not None


def _plans(lens: list[int], partition: list[list[list[int]]], **kw: object) -> list[list[ShardPlan]]:
    return [[ShardPlan.build([lens[i] for i in mb], **kw) for mb in rank] for rank in partition]  # type: ignore[arg-type]


def _ratio(plans: list[list[ShardPlan]], cp: int) -> float:
    return step_ratio([[plan_work(p) for p in rank] for rank in plans], cp)


def _global_batch(rng: random.Random, dp: int) -> list[int]:
    total = dp * 16 * MAX_TOKENS
    lens: list[int] = []
    while sum(lens) < total:
        n = min(MAX_TOKENS, max(1, round(rng.expovariate(1 / MEAN_LEN))))
        lens.append(min(n, total - sum(lens)))
    while len(lens) % dp:  # verl's DP split takes equal counts: cut the longest document in two
        i = max(range(len(lens)), key=lambda i: lens[i])
        lens[i:i + 1] = [lens[i] // 2, lens[i] - lens[i] // 2]
    return lens


def _rl_batch(rng: random.Random) -> list[int]:
    return [rng.randint(64, 4096) for _ in range(512)]


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    return _times_ms(fn, repeats)[0]


def _times_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """``(median, least)`` ms of ``fn``, the garbage collector off (``_timing.gc_off_ms``)."""
    least, median = gc_off_ms(fn, repeats)
    return median, least


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 global batches, fewer timing repeats")
    parser.add_argument("--batches", type=int, default=None, help="global batches per configuration (default 20)")
    parser.add_argument("--no-large", action="store_true", help="skip the 1024-sequence timing")
    parser.add_argument("--sweep", action="store_true", help="only the time sweep, 512 .. 32768 sequences")
    parser.add_argument("--sizes", type=str, default="512,1024,2048,4096,8192,16384,32768",
                        help="the sweep's sizes, comma-separated")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads first (default 1; 0 keeps torch's default)")
    args = parser.parse_args()
    batches = args.batches or (3 if args.quick else 20)
    repeats = 1 if args.quick else 3
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.sweep:
        _sweep([int(x) for x in args.sizes.split(",")], repeats)
        return
    dp = 2
    source = "verl's get_seqlen_balanced_partitions" if VERL else "a re-statement (verl not installed)"
    print(f"{batches} global batches a configuration, dp={dp}, max_tokens={MAX_TOKENS}; verl's partition: {source}; "
          f"{torch.get_num_threads()} torch threads")
    header = (f"{'batch':>8} {'cp':>3} {'tp':>3} {'layout':>10} {'verl':>6} {'verl+bal':>9} {'pack':>6} "
              f"{'pack+bal':>9} {'bound':>6} {'vs bal':>7} {'vs bnd':>7} {'mb verl/pack':>13} "
              f"{'rows/max verl/pack':>19} {'ms':>7} {'/verl':>6}")
    print(header)
    print("-" * len(header))
    configs = [("exp2048", 4, 1, "contiguous"), ("exp2048", 8, 1, "contiguous"), ("exp2048", 4, 1, "zigzag"),
               ("rl512", 8, 8, "zigzag"), ("rl512", 8, 8, "contiguous")]
    for kind, cp, tp, layout in configs:
        cols: dict[str, list[float]] = {k: [] for k in ("verl", "vbal", "pack", "pbal", "bound", "ms", "vms")}
        mb_v, mb_p, over_v, over_p = [], [], [], []
        for seed in range(batches):
            rng = random.Random(seed)
            lens = _global_batch(rng, dp) if kind == "exp2048" else _rl_batch(rng)
            kw = {"cp_size": cp, "tp_size": tp, "layout": layout}
            part = verl_partition(lens, dp, MAX_TOKENS)
            plain = _plans(lens, part, **kw)
            cols["verl"].append(_ratio(plain, cp))
            if layout == "contiguous":
                cols["vbal"].append(_ratio(_plans(lens, part, reorder="balanced", **kw), cp))
            else:
                cols["vbal"].append(cols["verl"][-1])
            packed = pack(lens, max_tokens=MAX_TOKENS, dp_size=dp, **kw)  # type: ignore[arg-type]
            cols["pack"].append(packed.step_ratio)
            cols["bound"].append(packed.lower_bound)
            if layout == "contiguous":
                cols["pbal"].append(pack(lens, max_tokens=MAX_TOKENS, dp_size=dp, reorder="balanced",
                                         **kw).step_ratio)  # type: ignore[arg-type]
            else:
                cols["pbal"].append(packed.step_ratio)
            if seed < max(1, repeats):
                cols["ms"].append(_median_ms(lambda: pack(lens, max_tokens=MAX_TOKENS, dp_size=dp, **kw),  # type: ignore[arg-type]
                                             repeats))
                cols["vms"].append(_median_ms(lambda: verl_partition(lens, dp, MAX_TOKENS), repeats))
            mb_v.append(len(part[0]))
            mb_p.append(packed.num_micro_batches[0])
            over_v.append(max(p.total_len for rank in plain for p in rank) / MAX_TOKENS)
            over_p.append(max(p.total_len for rank in packed.plans for p in rank) / MAX_TOKENS)
        m = {k: statistics.mean(v) for k, v in cols.items()}
        print(f"{kind:>8} {cp:>3} {tp:>3} {layout:>10} {m['verl']:>6.3f} {m['vbal']:>9.3f} {m['pack']:>6.3f} "
              f"{m['pbal']:>9.3f} {m['bound']:>6.3f} {m['pack'] / m['vbal'] - 1:>+7.1%} "
              f"{m['pack'] / m['bound'] - 1:>+7.1%} "
              f"{statistics.mean(mb_v):>6.1f}/{statistics.mean(mb_p):<6.1f} "
              f"{max(over_v):>9.3f}/{max(over_p):<9.3f} {m['ms']:>7.1f} {m['ms'] / m['vms']:>6.2f}")
    # groups of two (a reward model's chosen and rejected responses, verl's force_group_size): the same
    # batches, an even count, consecutive documents paired
    for cp in (4, 8):
        single, paired, ms = [], [], []
        for seed in range(batches):
            lens = _global_batch(random.Random(seed), dp)
            lens = lens[:len(lens) // (2 * dp) * (2 * dp)]
            kw = {"max_tokens": MAX_TOKENS, "cp_size": cp, "layout": "contiguous", "dp_size": dp}
            single.append(pack(lens, **kw).step_ratio)  # type: ignore[arg-type]
            paired.append(pack(lens, group_size=2, **kw).step_ratio)  # type: ignore[arg-type]
            if seed < max(1, repeats):
                ms.append(_median_ms(lambda: pack(lens, group_size=2, **kw), repeats))  # type: ignore[arg-type]
        mp, ms1 = statistics.mean(paired), statistics.mean(single)
        print(f"pairs (group_size=2), contiguous cp={cp}: step ratio {mp:.3f} against {ms1:.3f} ungrouped "
              f"({mp / ms1 - 1:+.1%}), {statistics.mean(ms):.1f} ms")
    if args.no_large:
        return
    rng = random.Random(1024)
    lens = [min(MAX_TOKENS, max(1, round(rng.expovariate(1 / MEAN_LEN)))) for _ in range(1024)]
    for layout, cp in (("zigzag", 4), ("contiguous", 8)):
        ms, low = _times_ms(lambda: pack(lens, max_tokens=MAX_TOKENS, cp_size=cp, layout=layout, dp_size=dp),
                            repeats + 4)
        base, base_low = _times_ms(lambda: verl_partition(lens, dp, MAX_TOKENS), repeats + 4)
        print(f"pack time, 1024 sequences, {layout} cp={cp}: median {ms:.1f} ms, least {low:.1f} ms (of "
              f"{repeats + 4}); verl's partition {base:.1f} / {base_low:.1f} ms; pack / verl {ms / base:.2f}")
    _sweep([int(x) for x in args.sizes.split(",")], repeats)


def _drop_in_batch(lens: list[int]) -> object:
    import tensordict

    mask = torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]
    ids = torch.zeros(len(lens), 1, dtype=torch.long)
    return tensordict.TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(lens)])


def _sweep(sizes: list[int], repeats: int) -> None:
    """pack and verl's partition, least times, per size (module docstring, **sweep**)."""
    from cpshard.compat.verl import rearrange_micro_batches

    print(f"\nsweep: exponential lengths (mean {MEAN_LEN}), max_tokens={MAX_TOKENS}; least ms of pack and of verl's "
          "partition; us/seq; x1024: us/seq over that at 1024")
    print(f"{'seqs':>6} {'dp':>3} {'layout':>10} {'cp':>3} {'pack ms':>9} {'verl ms':>9} {'/verl':>6} {'us/seq':>7} "
          f"{'x1024':>6} {'step':>6} {'bound':>6}")
    per_seq: dict[str, float] = {}
    verl_ms: dict[int, float] = {}
    for n in sizes:
        rng = random.Random(n)
        lens = [min(MAX_TOKENS, max(1, round(rng.expovariate(1 / MEAN_LEN)))) for _ in range(n)]
        dp = 2 if n < 4096 else 8
        reps = 1 if n > 8192 else repeats + 2
        verl_ms[n] = _times_ms(lambda: verl_partition(lens, dp, MAX_TOKENS), reps)[1]
        for layout, cp in (("zigzag", 4), ("contiguous", 8)):
            packed = pack(lens, max_tokens=MAX_TOKENS, cp_size=cp, layout=layout, dp_size=dp)
            ms = _times_ms(lambda: pack(lens, max_tokens=MAX_TOKENS, cp_size=cp, layout=layout, dp_size=dp), reps)[1]
            us = ms * 1e3 / n
            if n == 1024:
                per_seq[layout] = us
            x = f"{us / per_seq[layout]:>6.2f}" if layout in per_seq else f"{'':>6}"
            print(f"{n:>6} {dp:>3} {layout:>10} {cp:>3} {ms:>9.1f} {verl_ms[n]:>9.1f} {ms / verl_ms[n]:>6.2f} "
                  f"{us:>7.1f} {x} {packed.step_ratio:>6.3f} {packed.lower_bound:>6.3f}")
    if not VERL:
        return
    from verl.utils.seqlen_balancing import rearrange_micro_batches as verl_rearrange

    print("\ndrop-in rearrange_micro_batches, one DP rank's share (least ms)")
    print(f"{'samples':>8} {'layout':>10} {'cp':>3} {'cpshard ms':>11} {'verl ms':>9} {'/verl':>6}")
    for n in sizes:
        dp = 2 if n < 4096 else 8
        rng = random.Random(n)
        lens = [min(MAX_TOKENS, max(1, round(rng.expovariate(1 / MEAN_LEN)))) for _ in range(n)][:n // dp]
        batch = _drop_in_batch(lens)
        reps = 1 if n > 8192 else repeats + 2
        base = _times_ms(lambda: verl_rearrange(batch, MAX_TOKENS), reps)[1]
        for layout, cp in (("zigzag", 4), ("contiguous", 8)):
            ms = _times_ms(lambda: rearrange_micro_batches(batch, MAX_TOKENS, cp_size=cp, tp_size=1, layout=layout),
                           reps)[1]
            print(f"{len(lens):>8} {layout:>10} {cp:>3} {ms:>11.1f} {base:>9.1f} {ms / base:>6.2f}")


if __name__ == "__main__":
    main()
