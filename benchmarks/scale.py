"""Benchmark: host-side cost against the batch's size, and against torch's thread settings.

Run (CPU, one process; nothing asserts a time)::

    .venv/bin/python benchmarks/scale.py                 # 1k and 4k sequences: a couple of minutes on 2 cores
    .venv/bin/python benchmarks/scale.py --large         # adds 16k and 64k sequences (long: pack at 64k)
    .venv/bin/python benchmarks/scale.py --huge          # adds 100k sequences too
    .venv/bin/python benchmarks/scale.py --json out.json --png docs/performance.png

Every time is the least and the median of ``--repeats`` calls, garbage collector off (as ``timeit``),
in one process; this machine's noise is in the spread between the two. Four tables:

* **index**: ``n`` sequences of 1..64 tokens (uniform; the many-short-sequences case of a large
  rollout), at cp 2, 8 and 64, both layouts: ``ShardPlan.build``; ``shard`` of rank 0 on a fresh plan
  (cold: builds its index) and again (warm); ``unshard`` of every rank's output on a fresh plan
  (cold) and again (warm); on a fresh plan, rank 0's exchange for ``shift_sharded`` by one (``shift
  cold``) and its halo for the shifts 1, 2, 3 (``halo cold``: multi-token prediction's). Rows are
  ``float32``, one value a token.
* **pack**: ``n`` document lengths ~ exponential(mean 2048), at least 1, capped at 32768,
  ``max_tokens = 32768``, dp 2 at 1k sequences and 8 above; ``cpshard.pack`` under both layouts at
  cp 2, 8 and 64, beside verl's partition of the same batch (the DP split and every DP rank's
  micro-batches, ``cpshard.compat.verl_partition``: verl 0.9.1's own
  ``get_seqlen_balanced_partitions`` when verl imports). ``/verl`` is pack's least time over verl's,
  ``us/seq`` pack's least time per sequence; ``ratio`` and ``bound`` are pack's step ratio and its
  lower bound.
* **drop-in**: ``cpshard.compat.verl.rearrange_micro_batches`` on one DP rank's share (RL-like responses of
  64..4096 tokens, padded to the longest, ``max_token_len = 32768``, cp 8) beside verl's own
  ``rearrange_micro_batches`` on the same batch.
* **threads**: ``pack`` (1024 sequences, contiguous cp 8 and zigzag cp 4) and a balanced plan
  (``reorder="balanced"``, 40 sequences, cp 8) under ``torch.set_num_threads(1 / 2 / 8)`` in this
  process, then under ``OMP_NUM_THREADS=1 / 2 / 8`` in fresh processes (torch reads it once).

The figure (``--png``): time against sequences, log-log, one line per path (cp 8).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from _timing import gc_off_ms

from cpshard import ShardPlan, halo_exchange, pack, shard, shift_exchange, unshard
from cpshard.compat import verl_partition, verl_partitioner

MAX_TOKENS = 32768
MEAN_LEN = 2048


times_ms = gc_off_ms  # (least, median) ms, the garbage collector off


def short_lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 64) for _ in range(n)]


def document_lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(MAX_TOKENS, max(1, round(rng.expovariate(1 / MEAN_LEN)))) for _ in range(n)]


def _fmt(t: tuple[float, float]) -> str:
    return f"{t[0]:.1f}/{t[1]:.1f}"


def index_rows(sizes: list[int], cps: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    print(f"\nindex: n sequences of 1..64 tokens; ms least/median of {repeats}")
    head = f"{'n':>7} {'cp':>3} {'layout':>10} {'build':>13} {'shard cold':>13} {'shard warm':>13} " \
           f"{'unshard cold':>13} {'unshard warm':>13} {'shift cold':>13} {'halo cold':>13}"
    print(head + "\n" + "-" * len(head))
    for n in sizes:
        lens = short_lengths(n)
        x = torch.arange(sum(lens), dtype=torch.float32)
        for cp in cps:
            for layout in ("zigzag", "contiguous"):
                def build() -> ShardPlan:
                    return ShardPlan.build(lens, cp_size=cp, layout=layout)
                plan = build()
                parts = [torch.zeros(plan.local_len) for _ in range(cp)]
                fresh: list[ShardPlan] = []

                def cold(fn: Callable[[ShardPlan], object]) -> tuple[float, float]:
                    def prepare_and_call() -> None:
                        fn(fresh.pop())
                    times = []
                    for _ in range(repeats):  # a fresh plan each call: its index service is empty
                        fresh.append(build())
                        times.append(times_ms(prepare_and_call, 1)[0])
                    return min(times), statistics.median(times)
                shard(x, plan, 0)
                unshard(parts, plan)  # the warm rows below: the plan's indices built
                row = {"n": n, "cp": cp, "layout": layout, "build": times_ms(build, repeats),
                       "shard_cold": cold(lambda p: shard(x, p, 0)),
                       "shard_warm": times_ms(lambda: shard(x, plan, 0), repeats),
                       "unshard_cold": cold(lambda p: unshard(parts, p)),
                       "unshard_warm": times_ms(lambda: unshard(parts, plan), repeats),
                       "shift_cold": cold(lambda p: shift_exchange(p, 0, 1)),
                       "halo_cold": cold(lambda p: halo_exchange(p, 0, (1, 2, 3)))}
                rows.append(row)
                print(f"{n:>7} {cp:>3} {layout:>10} {_fmt(row['build']):>13} {_fmt(row['shard_cold']):>13} "
                      f"{_fmt(row['shard_warm']):>13} {_fmt(row['unshard_cold']):>13} {_fmt(row['unshard_warm']):>13} "
                      f"{_fmt(row['shift_cold']):>13} {_fmt(row['halo_cold']):>13}",
                      flush=True)
    return rows


def pack_rows(sizes: list[int], cps: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    source = "verl 0.9.1's get_seqlen_balanced_partitions" if verl_partitioner() is not None else \
        "a re-statement (verl not installed)"
    print(f"\npack: exponential(2048) lengths, max_tokens={MAX_TOKENS}; verl's partition: {source}; "
          f"ms least/median of {repeats}")
    head = f"{'n':>7} {'dp':>3} {'cp':>3} {'layout':>10} {'pack':>15} {'verl':>15} {'/verl':>6} {'us/seq':>7} " \
           f"{'ratio':>6} {'bound':>6}"
    print(head + "\n" + "-" * len(head))
    for n in sizes:
        lens = document_lengths(n)
        dp = 2 if n <= 1024 else 8
        n_dp = len(lens) - len(lens) % dp
        lens = lens[:n_dp]
        verl = times_ms(lambda: verl_partition(lens, dp, MAX_TOKENS), repeats)
        for cp in cps:
            for layout in ("zigzag", "contiguous"):
                kw: dict[str, Any] = {"max_tokens": MAX_TOKENS, "cp_size": cp, "layout": layout, "dp_size": dp}
                result = pack(lens, **kw)
                t = times_ms(lambda: pack(lens, **kw), repeats)
                row = {"n": len(lens), "dp": dp, "cp": cp, "layout": layout, "pack": t, "verl": verl,
                       "per_verl": t[0] / verl[0], "us_per_seq": 1e3 * t[0] / len(lens),
                       "ratio": result.step_ratio, "bound": result.lower_bound}
                rows.append(row)
                print(f"{len(lens):>7} {dp:>3} {cp:>3} {layout:>10} {_fmt(t):>15} {_fmt(verl):>15} "
                      f"{row['per_verl']:>6.2f} {row['us_per_seq']:>7.1f} {result.step_ratio:>6.3f} "
                      f"{result.lower_bound:>6.3f}", flush=True)
    return rows


def dropin_rows(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    here, saved = os.path.dirname(os.path.abspath(__file__)), sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # benchmarks/verl.py is not verl
    try:
        import tensordict
        from verl.utils import seqlen_balancing as sb

        from cpshard.compat import verl as cv
    except Exception as exc:  # noqa: BLE001  (verl's import chain pulls many packages)
        print(f"\ndrop-in: skipped (verl does not import: {exc})")
        return []
    finally:
        sys.path[:] = saved
    rows = []
    print(f"\ndrop-in rearrange_micro_batches, one DP rank's share (RL 64..4096 tokens), cp 8; ms least/median "
          f"of {repeats}")
    head = f"{'n':>7} {'layout':>10} {'cpshard':>15} {'verl':>15} {'/verl':>6}"
    print(head + "\n" + "-" * len(head))
    for n in sizes:
        rng = random.Random(n)
        lens = [rng.randint(64, 4096) for _ in range(n)]
        width = max(lens)
        mask = (torch.arange(width)[None, :] < torch.tensor(lens)[:, None]).long()
        batch = tensordict.TensorDict({"input_ids": torch.zeros(n, width, dtype=torch.long), "attention_mask": mask},
                                      batch_size=[n])
        theirs = times_ms(lambda: sb.rearrange_micro_batches(batch, max_token_len=MAX_TOKENS), repeats)
        for layout in ("zigzag", "contiguous"):
            ours = times_ms(lambda: cv.rearrange_micro_batches(batch, MAX_TOKENS, cp_size=8, tp_size=1,
                                                               layout=layout), repeats)
            rows.append({"n": n, "layout": layout, "cpshard": ours, "verl": theirs, "per_verl": ours[0] / theirs[0]})
            print(f"{n:>7} {layout:>10} {_fmt(ours):>15} {_fmt(theirs):>15} {ours[0] / theirs[0]:>6.2f}", flush=True)
    return rows


def _thread_case(repeats: int) -> dict[str, tuple[float, float]]:
    lens, few = document_lengths(1024, seed=1), document_lengths(40, seed=2)
    return {
        "pack contiguous cp8": times_ms(lambda: pack(lens, max_tokens=MAX_TOKENS, cp_size=8, layout="contiguous",
                                                     dp_size=2), repeats),
        "pack zigzag cp4": times_ms(lambda: pack(lens, max_tokens=MAX_TOKENS, cp_size=4, dp_size=2), repeats),
        "balanced plan 40 seqs cp8": times_ms(lambda: ShardPlan.build(few, cp_size=8, layout="contiguous",
                                                                      reorder="balanced"), repeats),
    }


def thread_rows(repeats: int) -> list[dict[str, Any]]:
    rows = []
    default = torch.get_num_threads()
    print(f"\nthreads (torch's default here: {default}); ms least/median of {repeats}")
    for threads in (1, 2, 8):
        torch.set_num_threads(threads)
        for case, t in _thread_case(repeats).items():
            rows.append({"setting": f"torch.set_num_threads({threads})", "case": case, "ms": t})
            print(f"  torch.set_num_threads({threads}): {case:<28} {_fmt(t)}", flush=True)
    torch.set_num_threads(default)
    for threads in (1, 2, 8):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--thread-case", str(repeats)], env=env,
                             capture_output=True, text=True, check=True).stdout
        for case, t in json.loads(out.splitlines()[-1]).items():
            rows.append({"setting": f"OMP_NUM_THREADS={threads}", "case": case, "ms": t})
            print(f"  OMP_NUM_THREADS={threads}: {case:<28} {_fmt(tuple(t))}", flush=True)  # type: ignore[arg-type]
    return rows


def draw(result: dict[str, Any], path: str) -> None:
    """Time against sequences, log-log, one line per path, at cp 8 and cp 64 side by side (the least times)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for ax, cp in zip(axes, (8, 64)):
        lines: dict[str, dict[int, float]] = {}
        for row in result["index"]:
            if row["cp"] != cp:
                continue
            for key in ("build", "shard_cold", "shard_warm", "unshard_cold", "unshard_warm", "shift_cold",
                        "halo_cold"):
                if key in row:
                    lines.setdefault(f"{key.replace('_', ' ')} ({row['layout']})", {})[row["n"]] = row[key][0]
        for row in result["pack"]:
            if row["cp"] != cp:
                continue
            lines.setdefault(f"pack {row['layout']} (documents)", {})[row["n"]] = row["pack"][0]
            lines.setdefault("verl partition (documents)", {})[row["n"]] = row["verl"][0]
        colors = plt.get_cmap("tab20")
        for i, (name, pts) in enumerate(sorted(lines.items())):
            xs = sorted(pts)
            style = "--" if "verl" in name else ("-" if "pack" in name else ":")
            ax.plot(xs, [pts[x] for x in xs], style, marker="o", markersize=3, label=name, color=colors(i % 20))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("sequences")
        ax.set_title(f"cp = {cp}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2, loc="upper left")
    axes[0].set_ylabel("ms (least); index paths: sequences of 1..64 tokens")
    fig.suptitle("cpshard host-side cost against the batch")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large", action="store_true", help="add 16k and 64k sequences")
    parser.add_argument("--huge", action="store_true", help="add 16k, 64k and 100k sequences")
    parser.add_argument("--sizes", type=int, nargs="+", help="these sequence counts instead (a smoke run: --sizes 64)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads first (0: torch's default)")
    parser.add_argument("--only", choices=["index", "pack", "dropin", "threads"], action="append",
                        help="run only these tables (repeatable)")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--png", help="draw the log-log figure to this file (matplotlib)")
    parser.add_argument("--plot-from", nargs="+", metavar="JSON",
                        help="measure nothing: draw --png from these --json files (their tables merged)")
    parser.add_argument("--thread-case", type=int, help=argparse.SUPPRESS)  # a fresh process's threads rows
    args = parser.parse_args()
    if args.plot_from:
        merged: dict[str, Any] = {"index": [], "pack": []}
        for name in args.plot_from:
            with open(name) as f:
                part = json.load(f)
            for table in merged:
                merged[table] += part.get(table, [])
        draw(merged, args.png or "scale.png")
        return
    if args.thread_case:
        print(json.dumps(_thread_case(args.thread_case)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = args.sizes or [1024, 4096] + ([16384, 65536] if args.large or args.huge else []) + \
        ([100_000] if args.huge else [])
    cps = [2, 8, 64]
    want = set(args.only or ["index", "pack", "dropin", "threads"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs; "
          f"sizes {sizes}")
    result: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "sizes": sizes}
    result["index"] = index_rows(sizes, cps, args.repeats) if "index" in want else []
    result["pack"] = pack_rows(sizes, cps, args.repeats) if "pack" in want else []
    result["dropin"] = dropin_rows([512, 2048], args.repeats) if "dropin" in want else []
    result["threads"] = thread_rows(args.repeats) if "threads" in want else []
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        draw(result, args.png)


if __name__ == "__main__":
    main()
