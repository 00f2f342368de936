"""Benchmark: per-rank causal attention balance under the contiguous layout.

Run (CPU, one process, one torch thread)::

    .venv/bin/python benchmarks/balance.py            # 200 micro-batches per row
    .venv/bin/python benchmarks/balance.py --quick    # 40 micro-batches, fewer timing repeats
    .venv/bin/python benchmarks/balance.py --max-doc 8192   # documents cut at 8192 tokens

Batches: document lengths drawn from an exponential distribution with mean 2048 (at least 1), packed
into a 32768-token micro-batch (the document that overflows is cut to fill it exactly), one fixed
seed per batch (``--max-doc N`` cuts longer documents to ``N`` tokens first, as a trainer with a
maximum sequence length does: at ``cp=4`` and ``N = 8192`` no document outgrows a rank's share, and
the bound falls from about 1.06 to 1.02). Padded lengths: each length rounded up to ``cp * tp``
with ``tp = 1`` (the default contiguous alignment), and the same batches unpadded (alignment 1).

For every ``cp`` in 2, 4, 8 and both alignments, three orders are scored by ``max / mean`` of the
per-rank work (``cpshard.index.balance.rank_work``; the mean does not depend on the order):

* ``plain``: the given order (what contiguous CP does today);
* ``swap``: a crude random-swap search kept here as a baseline, ``--swaps`` random transpositions
  from the given order, each kept when the largest rank does not grow;
* ``balanced``: ``cpshard.index.balance.balanced_order``.

Columns: mean and worst ``max / mean``; ``/bound``, the mean of ``max / work_lower_bound`` (1.00 means
every batch at a bound no order can beat); ``at bound``, the share of batches within 0.5% of it;
``bound/mean`` the mean of the bound itself, and ``(1)+(2)`` the same for its first two parts only
(mean and heaviest piece, without the filler windows: see Note [Why no order beats the bound]). The
last table times ``balanced_order`` (median of repeats) on batches of exactly 16 and 1024 sequences
drawn from the same distribution.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
from _timing import median_ms

from cpshard.index.balance import balanced_order, rank_work, simple_work_bound, work_lower_bound

MICRO_BATCH = 32768
MEAN_LEN = 2048


def _lengths(rng: random.Random, total: int = MICRO_BATCH, max_doc: int | None = None) -> list[int]:
    lens: list[int] = []
    while sum(lens) < total:
        n = max(1, round(rng.expovariate(1 / MEAN_LEN)))
        n = n if max_doc is None else min(n, max_doc)
        lens.append(min(n, total - sum(lens)))
    return lens


def _padded(lens: list[int], align: int) -> list[int]:
    return [-(-n // align) * align for n in lens]


def _swap_search(lens: list[int], padded: list[int], cp: int, swaps: int, seed: int) -> list[int]:
    """The crude baseline: random transpositions, each kept when the largest rank does not grow."""
    rng = random.Random(seed)
    order = list(range(len(lens)))
    cur = max(rank_work(lens, padded, order, cp))
    for _ in range(swaps):
        i, j = rng.randrange(len(order)), rng.randrange(len(order))
        order[i], order[j] = order[j], order[i]
        new = max(rank_work(lens, padded, order, cp))
        if new <= cur:
            cur = new
        else:
            order[i], order[j] = order[j], order[i]
    return order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 batches per row, fewer timing repeats")
    parser.add_argument("--batches", type=int, default=None, help="micro-batches per row (default 200)")
    parser.add_argument("--swaps", type=int, default=200, help="transpositions tried by the swap baseline")
    parser.add_argument("--max-doc", type=int, default=None, help="cut documents to this many tokens")
    args = parser.parse_args()
    batches = args.batches or (40 if args.quick else 200)
    repeats = 7 if args.quick else 21
    torch.set_num_threads(1)

    cut = "" if args.max_doc is None else f", cut at {args.max_doc}"
    print(f"{batches} micro-batches of {MICRO_BATCH} tokens, lengths ~ Exp(mean {MEAN_LEN}){cut}; "
          "max/mean of rank work")
    header = (f"{'cp':>3} {'align':>6} {'order':>9} {'mean':>7} {'worst':>7} {'/bound':>7} {'at bound':>9}"
              f" {'bound/mean':>11} {'(1)+(2)':>8}")
    print(header)
    print("-" * len(header))
    for cp in (2, 4, 8):
        for align_name, align in (("cp*tp", cp), ("1", 1)):
            rows: dict[str, list[tuple[float, float]]] = {"plain": [], "swap": [], "balanced": []}
            bounds, simple = [], []
            for seed in range(batches):
                lens = _lengths(random.Random(seed), max_doc=args.max_doc)
                padded = _padded(lens, align)
                mean = sum(n * (n + 1) // 2 for n in lens) / cp
                bound = work_lower_bound(lens, padded, cp)
                bounds.append(bound / mean)
                simple.append(simple_work_bound(lens, padded, cp) / mean)
                orders = {"plain": list(range(len(lens))),
                          "swap": _swap_search(lens, padded, cp, args.swaps, seed),
                          "balanced": list(balanced_order(lens, padded, cp))}
                for name, order in orders.items():
                    top = max(rank_work(lens, padded, order, cp))
                    rows[name].append((top / mean, top / bound))
            for name, vals in rows.items():
                ratio = [v[0] for v in vals]
                gap = [v[1] for v in vals]
                at = sum(g <= 1.005 for g in gap) / len(gap)
                print(f"{cp:>3} {align_name:>6} {name:>9} {statistics.mean(ratio):>7.3f} {max(ratio):>7.3f}"
                      f" {statistics.mean(gap):>7.3f} {at:>8.0%} {statistics.mean(bounds):>11.3f}"
                      f" {statistics.mean(simple):>8.3f}")
        print()

    print(f"balanced_order build time, median of {repeats} (ms), alignment cp*tp")
    print(f"{'cp':>3} {'B':>5} {'ms':>8} {'max/mean':>9}")
    for cp in (2, 4, 8):
        for b in (16, 1024):
            rng = random.Random(1000 + b)
            lens = [max(1, round(rng.expovariate(1 / MEAN_LEN))) for _ in range(b)]
            padded = _padded(lens, cp)
            ms = median_ms(lambda: balanced_order(lens, padded, cp), repeats)
            order = balanced_order(lens, padded, cp)
            mean = sum(n * (n + 1) // 2 for n in lens) / cp
            print(f"{cp:>3} {b:>5} {ms:>8.2f} {max(rank_work(lens, padded, order, cp)) / mean:>9.4f}")


if __name__ == "__main__":
    main()
