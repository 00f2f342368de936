"""Benchmark: ``cpshard.distributed.gather`` against a per-sequence restore (zigzag THD, gloo ranks).

The baseline is how framework post-processing restores per-sequence outputs today: all-gather
every rank's local rows into a list, then loop over sequences and, for each, over ranks, cutting
the rank's two zigzag chunks out and concatenating them (written here from SPEC.md's layout, in
the shape of verl's ``postprocess_thd_engine``). cpshard does one ``all_gather_single`` and
one ``index_select``. Both results are checked equal on every rank. Run::

    .venv/bin/python benchmarks/gather.py                   # 4 ranks, 8 / 64 / 256 sequences
    .venv/bin/python benchmarks/gather.py --width 64        # (L, 64) rows instead of log-probs (L,)
    .venv/bin/python benchmarks/gather.py --quick           # 2 ranks, a smoke run

Times are the median over repeats of the slowest rank's time per call. On 2 CPU cores with 4
ranks the collective's share is mostly scheduling noise; the per-sequence loop is what grows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from cpshard import ShardPlan, shard
from cpshard.distributed import gather
from cpshard.spawn import run_ranks


def per_sequence_restore(local: torch.Tensor, plan: ShardPlan) -> list[torch.Tensor]:
    """The baseline: all_gather to a list, then a Python loop over sequences and ranks."""
    cp = plan.cp_size
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local)
    out = []
    for i, (n, p) in enumerate(zip(plan.seqlens_py, plan.padded_seqlens_py)):
        start, c = plan.cu_seqlens_padded_py[i] // cp, p // (2 * cp)
        heads = [parts[r][start:start + c] for r in range(cp)]
        tails = [parts[r][start + c:start + 2 * c] for r in reversed(range(cp))]
        out.append(torch.cat(heads + tails)[:n])
    return out


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _rank(rank: int, world: int, batches: list[int], width: int, repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    results = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        lens = torch.randint(64, 1025, (b,), generator=g).tolist()
        plan = ShardPlan.build(lens, cp_size=world)
        x = torch.randn(sum(lens), *((width,) if width else ()), generator=g)
        local = shard(x, plan, rank)
        got = gather(local, plan, dist.group.WORLD)
        want = per_sequence_restore(local, plan)
        assert torch.equal(got.values(), torch.cat(want)) and torch.equal(got.values(), x)
        for _ in range(2):
            gather(local, plan, dist.group.WORLD)
            per_sequence_restore(local, plan)
        results.append({
            "B": b, "tokens": plan.num_tokens,
            "cpshard": _timed(lambda: gather(local, plan, dist.group.WORLD), repeats),
            "baseline": _timed(lambda: per_sequence_restore(local, plan), repeats),
        })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--width", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="2 ranks, 8 and 64 sequences, 5 repeats: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.world, args.batches, args.repeats = 2, [8, 64], 5
    every = run_ranks(_rank, args.world, args.batches, args.width, args.repeats, timeout=600)
    print(f"gather vs per-sequence restore, {args.world} gloo ranks, zigzag, lengths U[64, 1024], "
          f"row shape {(args.width,) if args.width else ()}, median of per-call max over ranks")
    print(f"{'B':>5} {'tokens':>8} {'cpshard ms':>11} {'baseline ms':>12} {'baseline/cpshard':>17}")
    for i, b in enumerate(args.batches):
        cp = statistics.median(max(ts) for ts in zip(*(r[i]["cpshard"] for r in every))) * 1e3
        base = statistics.median(max(ts) for ts in zip(*(r[i]["baseline"] for r in every))) * 1e3
        print(f"{b:>5} {every[0][i]['tokens']:>8} {cp:>11.3f} {base:>12.3f} {base / cp:>16.1f}x")


if __name__ == "__main__":
    main()
