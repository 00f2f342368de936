"""Timing and memory helpers shared by the benchmark scripts (scripts, not tests: nothing asserts a time)."""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch


def median_ms(fn: Callable[[], Any], repeats: int, device: torch.device | None = None) -> float:
    """Median wall time of ``fn()`` in ms over ``repeats`` calls, after one warm-up call; on CUDA the
    device is synchronized around every call, so the time covers the kernels too."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def least_ms(fn: Callable[[], Any], repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The least time of ``fn()`` in ms over ``repeats`` calls (after one warm-up): wall time, or with
    ``clock=time.process_time`` the process's CPU time (steadier on a machine shared with other jobs)."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return 1e3 * best


def gc_off_ms(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """``(least, median)`` wall time of ``fn()`` in ms over ``repeats`` calls, Python's cyclic garbage
    collector off during each call (as ``timeit`` does: verl's Karmarkar-Karp allocates many small
    objects, and a collection in the middle of one call triples its time; off, a comparison with it
    favours verl)."""
    times = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        finally:
            gc.enable()
    return 1e3 * min(times), 1e3 * statistics.median(times)


def slowest_rank_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Median over ``repeats`` of one call's time on the slowest rank of the default group, in ms: per
    call every rank does ``barrier(); t0; fn(); t1``, then the times are reduced by their maximum."""
    import torch.distributed as dist
    times = []
    for _ in range(repeats):
        dist.barrier()
        t = time.perf_counter()
        fn()
        spent = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        times.append(float(spent))
    return 1e3 * statistics.median(times)


def interleaved_ms(fns: list[Callable[[], Any]], repeats: int, device: torch.device | None = None) -> list[float]:
    """Median ms of each of ``fns``, timed in turn within every repeat.

    Ratios between them are fair: each sees the same allocator and cache state (a fresh large CPU
    tensor costs page faults that depend on what ran before, which can swing one call 5x).
    """
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t)
    return [1e3 * statistics.median(t) for t in times]


def peak_mib(fn: Callable[[], Any], device: torch.device) -> str:
    """Peak extra device memory of one call (CUDA only; the CPU allocator keeps no such counter)."""
    if device.type != "cuda":
        return "n/a"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - before) / 2**20:.1f}"


def host_syncs(fn: Callable[[], Any], device: torch.device) -> str:
    """How many times one call of ``fn`` synchronises the host with the GPU (CUDA only), as
    ``torch.cuda.set_sync_debug_mode("warn")`` reports them: ``.item()``, copies to the host, copies
    from pageable host memory, explicit synchronisation."""
    if device.type != "cuda":
        return "n/a"
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return str(sum("synchroniz" in str(w.message).lower() for w in caught))


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """The benchmark batch every sharding script shares: ``--seqs`` lengths uniform in
    ``[--min-len, --max-len]`` (256 of 128..8192, about 1 M tokens), at ``--cp 4 --tp 2``."""
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)


def add_sweep_args(parser: argparse.ArgumentParser, *, warmup: int, min_len: int, max_len: int) -> None:
    """The batch sweep the gloo benchmarks share (``mtp.py``, ``shift.py``): ``--batches`` sizes of
    lengths uniform in ``[--min-len, --max-len]`` drawn with ``--seed``, ``--repeats`` (None: the
    script's default, fewer under ``--quick``) after ``--warmup`` calls."""
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--min-len", type=int, default=min_len)
    parser.add_argument("--max-len", type=int, default=max_len)
    parser.add_argument("--seed", type=int, default=0)


def batch_lengths(args: argparse.Namespace, generator: torch.Generator) -> list[int]:
    """The lengths :func:`add_batch_args` describes, drawn from ``generator``."""
    return torch.randint(args.min_len, args.max_len + 1, (args.seqs,), generator=generator).tolist()


#: the document length distributions of the packed-row benchmarks (torch_cp.py, hf_sp.py): exponential with
#: this mean, lognormal with this median and sigma 1.5
MEAN_EXP = 2048
MEDIAN_LOGNORMAL = 1024


def packed_row_lengths(rng: random.Random, dist: str, total: int, step: int = 1) -> list[int]:
    """One packed row's document lengths, summing to ``total``: drawn from ``dist`` (``"lognormal"``, else
    exponential), each rounded up to a multiple of ``step`` (at least ``step``), the last cut to fit."""
    out: list[int] = []
    left = total
    while left > 0:
        if dist == "lognormal":
            n = rng.lognormvariate(math.log(MEDIAN_LOGNORMAL), 1.5)
        else:
            n = rng.expovariate(1 / MEAN_EXP)
        n = max(step, -(-round(n) // step) * step)
        out.append(min(n, left))
        left -= out[-1]
    return out
