"""Benchmark: sequence parallelism for Hugging Face models (R ring ranks x U Ulysses ranks), side by side.

Run (CPU, one process, one torch thread)::

    .venv/bin/python benchmarks/hf_sp.py            # S 8k, 32k, 128k; R 2, 4, 8; U 1, 2, 4, 8; 4 rows each
    .venv/bin/python benchmarks/hf_sp.py --quick    # S 8k, R 2 and 8, U 1 and 8, 2 rows, 3 timing repeats

Rows: packed rows of exactly ``S`` tokens, documents drawn (one fixed seed per row) until the row is
full, the last one cut to fill it: ``exp`` (exponential, mean 2048 tokens) and ``lognormal`` (median
1024, sigma 1.5: one document in a hundred is longer than 34k).

**Work and padding.** A ring rank's ``L`` rows are split into ``U`` equal pieces for the Ulysses ranks,
which after the all-to-all all attend over all ``L`` rows for ``H / U`` heads: the ring axis alone
decides the balance. Work: a token at position ``p`` of its document attends to ``p + 1`` keys (the
document-causal mask, no window), a pad row to none; a row's score is ``max / mean`` of the ring
ranks' work (1.00 is perfect), and ``pad`` the pad rows over the row's ``S`` tokens. Layouts:

* ``cp-zigzag``: cpshard's zigzag, ``padding="minimal"`` (each document padded to ``2 R``, the last so that
  every rank's rows divide by ``U``);
* ``cp-zigzag-none``: cpshard's zigzag without padding, ``padding="none"`` (no document padded, chunks one
  row apart, only the total extended to a multiple of ``R U``: the Hugging Face adapter's default);
* ``cp-contig``: cpshard's contiguous layout with its balanced document order, ``padding="minimal"``;
* ``row-contig``: the whole row cut into ``R`` contiguous pieces, padded at its end to a multiple of
  ``R U`` (ring-flash-attn's llama3 varlen path, DeepSpeed ALST, verl's Ulysses): a document-blind cut;
* ``row-zigzag``: the whole row padded to ``2 R U`` and cut into ``2 R`` chunks, ring rank ``r`` holding
  chunks ``r`` and ``2 R - 1 - r`` (yunchang's USP zigzag), scored with the documents' mask;
* ``doc-2UR``: every document padded to a multiple of ``2 U R`` and zigzagged on its own (ms-swift's
  packing under sequence parallelism; cpshard's zigzag with ``padding="aligned"``).

**Bytes per layer** each rank sends, a formula per configuration (``--heads``, ``--kv-heads``,
``--head-dim``, ``--bytes``; default 32 / 8 / 128, bf16), with ``L`` the ring rank's rows under
``cp-zigzag-none`` (the adapter's default) and ``Hkv' = max(Hkv, U)`` (key/value heads repeated only as far
as ``U`` needs): the Ulysses all-to-all, there and back, ``(U - 1) / U * L / U * (2 H + 2 Hkv') * D * b``; the
keys' and values' all-gather over the ring, ``(R - 1) * L * 2 Hkv' / U * D * b``, and its backward's
reduce-scatter the same; a ring pass instead (ring attention: ``R - 1`` K/V blocks forward; K/V and
their gradients, ``2 (R - 1)`` blocks, backward). ``kv MiB``: the gathered keys and values a rank holds
(``R L`` rows), which the ring's one block at a time avoids.

**Host time** of one rank's preparation (least of ``--repeats``, a fresh plan each run; the slowest of
the rows):
the lengths from the ``(1, S)`` position ids, ``ShardPlan.build``, ``cpshard.shard`` of the input
ids, the positions and the shifted labels for one rank, and ``varlen_metadata`` for that rank (the
flash kernel's arguments). Target: 10 ms at ``S = 128k``, ``R = 8``, ``U = 8``.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _timing import least_ms, packed_row_lengths

from cpshard import ShardPlan, shard, varlen_metadata
from cpshard.index.balance import work_lower_bound

SIZES = (8192, 32768, 131072)
RINGS = (2, 4, 8)
ULYSSES = (1, 2, 4, 8)
DISTS = ("exp", "lognormal")
NAMES = ("cp-zigzag", "cp-zigzag-none", "cp-contig", "row-contig", "row-zigzag", "doc-2UR")


def lengths(rng: random.Random, dist: str, total: int) -> list[int]:
    """One packed row's document lengths (sum ``total``)."""
    return packed_row_lengths(rng, dist, total)


def _round_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _row_cost(lens: list[int], rows: int) -> np.ndarray:
    """``(rows,)``: each row's work in the whole packed row padded at its end to ``rows`` rows."""
    cost = np.zeros(rows, dtype=np.int64)
    starts = np.repeat(np.cumsum([0, *lens[:-1]]), lens)
    cost[:sum(lens)] = np.arange(sum(lens)) - starts + 1
    return cost


def layouts(lens: list[int], ring: int, ulysses: int) -> dict[str, tuple[list[int], int]]:
    """Each layout's ``(work per ring rank, rows in all)``."""
    def plan_work(**kw: Any) -> tuple[list[int], int]:
        plan = ShardPlan.build(lens, cp_size=ring, tp_size=ulysses, **kw)
        return plan.indices().work(), plan.total_len

    def whole_row(zigzag: bool) -> tuple[list[int], int]:
        rows = _round_up(sum(lens), (2 if zigzag else 1) * ring * ulysses)
        chunks = _row_cost(lens, rows).reshape(2 * ring if zigzag else ring, -1).sum(1)
        work = chunks[:ring] + chunks[::-1][:ring] if zigzag else chunks
        return work.tolist(), rows

    return {"cp-zigzag": plan_work(layout="zigzag", padding="minimal"),
            "cp-zigzag-none": plan_work(layout="zigzag", padding="none"),
            "cp-contig": plan_work(layout="contiguous", padding="minimal", reorder="balanced"),
            "row-contig": whole_row(False), "row-zigzag": whole_row(True),
            "doc-2UR": plan_work(layout="zigzag", padding="aligned")}


def contiguous_bound(lens: list[int], ring: int, ulysses: int) -> float:
    """``work_lower_bound / mean``: what no document order of the contiguous layout beats."""
    plan = ShardPlan.build(lens, cp_size=ring, tp_size=ulysses, layout="contiguous", padding="minimal")
    return work_lower_bound(lens, plan.input_padded_seqlens_py, ring) * ring / sum(n * (n + 1) // 2 for n in lens)


def bytes_per_layer(rows: int, ring: int, ulysses: int, heads: int, kv_heads: int, dim: int, width: int
                    ) -> dict[str, float]:
    """What one rank sends per attention layer (MiB), forward and backward (module docstring)."""
    local = rows // ring  # the ring rank's rows; a Ulysses rank holds local / U of them before the all-to-all
    kv = max(kv_heads, ulysses)
    a2a = (ulysses - 1) / ulysses * local / ulysses * (2 * heads + 2 * kv) * dim * width
    block = local * 2 * kv / ulysses * dim * width  # one ring rank's keys and values, this rank's heads
    mib = 1 / 2**20
    return {"a2a": a2a * mib, "ag": (ring - 1) * block * mib, "ring": (ring - 1) * block * mib,
            "fwd+bwd": (2 * a2a + 2 * (ring - 1) * block) * mib, "ring f+b": (2 * a2a + 3 * (ring - 1) * block) * mib,
            "kv": ring * block * mib}


def positions_of(lens: list[int]) -> torch.Tensor:
    """``(1, S)`` position ids restarting at 0 at each document (HF's padding-free collators)."""
    return torch.cat([torch.arange(n) for n in lens])[None]


def lengths_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The documents' lengths from ``(1, S)`` position ids: a run starts where the position is 0."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).reshape(-1)
    return torch.diff(starts, append=torch.tensor([flat.numel()]))


def prepare(input_ids: torch.Tensor, position_ids: torch.Tensor, ring: int, ulysses: int, layout: str,
            rank: int, padding: str = "minimal") -> Any:
    """One rank's pure preparation: the plan from the positions, its ids, positions and labels, the metadata."""
    kw = dict(reorder="balanced") if layout == "contiguous" else {}
    plan = ShardPlan.build(lengths_from_positions(position_ids), cp_size=ring, tp_size=ulysses, layout=layout,
                           padding=padding, **kw)
    ids, pos = input_ids.reshape(-1), position_ids.reshape(-1)
    out = (shard(ids, plan, rank), shard(pos, plan, rank), shard(ids, plan, rank, shift=1, fill=-100))
    return out, varlen_metadata(plan, rank)


def sp_shard_pure() -> Callable[..., Any] | None:
    """HOOK: ``SequenceParallel.shard``'s pure part (no collective) from ``cpshard.compat.hf``, once it lands
    (its own branch): return a function of ``(input_ids, position_ids, labels, ring, ulysses, layout, rank)``
    and the host-time table gains its column. None until then."""
    if importlib.util.find_spec("cpshard.compat.hf") is None or importlib.util.find_spec("transformers") is None:
        return None
    from cpshard.compat.hf import shard_row

    def pure(input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, ring: int, ulysses: int,
             layout: str, rank: int) -> Any:
        # what sp.shard computes on rank (rank, U - 1) without its groups, and the flash kernel's metadata
        batch = shard_row(input_ids, position_ids, labels, ring_size=ring, ulysses_size=ulysses, ring_rank=rank,
                          ulysses_rank=ulysses - 1, layout=layout)
        return batch, varlen_metadata(batch.plan, rank)

    return pure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="S 8k, R 2 and 8, U 1 and 8, 2 rows, 3 timing repeats")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="row lengths S (default 8k 32k 128k)")
    parser.add_argument("--rings", type=int, nargs="+", default=None, help="ring sizes R (default 2 4 8)")
    parser.add_argument("--ulysses", type=int, nargs="+", default=None, help="Ulysses sizes U (default 1 2 4 8)")
    parser.add_argument("--rows", type=int, default=None, help="rows (seeds) per configuration (default 4)")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats, least kept (default 9)")
    parser.add_argument("--cpu-clock", action="store_true",
                        help="time the preparation in CPU time (time.process_time): steadier on a shared machine")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--bytes", type=int, default=2, help="bytes per element (bf16: 2)")
    args = parser.parse_args()
    sizes = args.sizes or ((8192,) if args.quick else SIZES)
    rings = args.rings or ((2, 8) if args.quick else RINGS)
    ulyss = args.ulysses or ((1, 8) if args.quick else ULYSSES)
    n_rows = args.rows or (2 if args.quick else 4)
    repeats = args.repeats or (3 if args.quick else 9)
    torch.set_num_threads(1)
    clock = time.process_time if args.cpu_clock else time.perf_counter

    print(f"document-causal work over the ring ranks, max/mean (mean over {n_rows} rows / worst row; 1.00 is "
          "perfect) and pad rows / S (mean); bound: what no order of the contiguous layout beats")
    header = f"{'S':>7} {'R':>2} {'U':>2} {'dist':>9} {'bound':>6} " + " ".join(f"{n:>19}" for n in NAMES)
    print(header)
    print("-" * len(header))
    sent: dict[tuple[int, int, int], int] = {}
    for size in sizes:
        for ring in rings:
            for ulysses in ulyss:
                for dist in DISTS:
                    rows = [lengths(random.Random(1000 * seed + size), dist, size) for seed in range(n_rows)]
                    got = [layouts(lens, ring, ulysses) for lens in rows]
                    cells = []
                    for name in NAMES:
                        s = [max(g[name][0]) * ring / max(sum(g[name][0]), 1) for g in got]
                        pad = statistics.mean(g[name][1] / size - 1 for g in got)
                        cells.append(f"{statistics.mean(s):>5.3f}/{max(s):<5.3f} {pad:>6.2%}")
                    bound = statistics.mean(contiguous_bound(lens, ring, ulysses) for lens in rows)
                    print(f"{size:>7} {ring:>2} {ulysses:>2} {dist:>9} {bound:>6.3f} "
                          + " ".join(f"{c:>19}" for c in cells))
                    sent[size, ring, ulysses] = max(sent.get((size, ring, ulysses), 0), got[0]["cp-zigzag-none"][1])
        print()

    print(f"MiB each rank sends per attention layer ({args.heads} q heads, {args.kv_heads} kv heads, "
          f"D={args.head_dim}, {args.bytes} bytes; cp-zigzag-none's rows): Ulysses all-to-all (there and back), "
          "K/V all-gather, a ring pass instead; forward+backward totals; gathered K/V held")
    keys = ("a2a", "ag", "ring", "fwd+bwd", "ring f+b", "kv")
    header = f"{'S':>7} {'R':>2} {'U':>2} " + " ".join(f"{k:>9}" for k in keys)
    print(header)
    print("-" * len(header))
    for (size, ring, ulysses), total in sent.items():
        b = bytes_per_layer(total, ring, ulysses, args.heads, args.kv_heads, args.head_dim, args.bytes)
        print(f"{size:>7} {ring:>2} {ulysses:>2} " + " ".join(f"{b[k]:>9.2f}" for k in keys))
    print()

    hook = sp_shard_pure()
    print(f"host ms ({'CPU' if args.cpu_clock else 'wall'}) of one rank's preparation (least of {repeats}, the "
          f"slowest of the {n_rows} rows; rank R-1): lengths from positions + ShardPlan.build + shard of ids, "
          "positions, labels + varlen_metadata, for each layout and length distribution ('zz-none': zigzag, "
          "padding='none'; 'zigzag': padding='minimal'); 'order': the contiguous plan's build alone (its balanced "
          "order's search); "
          + ("'sp.shard': cpshard.compat.hf.shard_row (what sp.shard computes, rank (R-1, U-1)) + varlen_metadata, "
             "zigzag (its default padding='none'), exponential lengths" if hook
             else "sp.shard: not timed (cpshard.compat.hf does not import here)"))
    cols = [f"{layout[:7]} {dist[:3]}" for dist in DISTS for layout in ("zigzag", "zz-none", "contig", "order")]
    header = f"{'S':>7} {'R':>2} {'U':>2} " + " ".join(f"{c:>11}" for c in [*cols, *(["sp.shard"] if hook else [])])
    print(header)
    print("-" * len(header))
    for size in sizes:
        inputs = {dist: [] for dist in DISTS}  # the work table's rows
        for dist in DISTS:
            for seed in range(n_rows):
                lens = lengths(random.Random(1000 * seed + size), dist, size)
                ids = torch.randint(0, 32000, (1, size), generator=torch.Generator().manual_seed(seed))
                inputs[dist].append((lens, ids, positions_of(lens)))
        for ring in rings:
            for ulysses in ulyss:
                def slowest(fn: Callable[..., Any], dist: str) -> float:
                    return max(least_ms(lambda: fn(*row), repeats, clock) for row in inputs[dist])
                times = []
                for dist in DISTS:
                    times += [slowest(lambda _, ids, pos: prepare(ids, pos, ring, ulysses, layout, ring - 1, padding),
                                      dist)
                              for layout, padding in (("zigzag", "minimal"), ("zigzag", "none"),
                                                      ("contiguous", "minimal"))]
                    times.append(slowest(lambda lens, *_: ShardPlan.build(
                        lens, cp_size=ring, tp_size=ulysses, layout="contiguous", padding="minimal",
                        reorder="balanced"), dist))
                if hook:
                    times.append(slowest(lambda _, ids, pos: hook(ids, pos, ids, ring, ulysses, "zigzag", ring - 1),
                                         "exp"))
                print(f"{size:>7} {ring:>2} {ulysses:>2} " + " ".join(f"{t:>11.2f}" for t in times))


if __name__ == "__main__":
    main()
