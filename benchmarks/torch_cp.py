"""Benchmark: document-causal work per rank under torch's CP load balancers and cpshard's, side by side.

Run (CPU, one process, one torch thread)::

    .venv/bin/python benchmarks/torch_cp.py            # S 8k, 32k, 128k; cp 2, 4, 8, 16; 4 rows each
    .venv/bin/python benchmarks/torch_cp.py --quick    # S 8k, cp 2 and 8, 2 rows, fewer timing repeats

Rows: packed rows of exactly ``S`` tokens, documents drawn (one fixed seed per row) until the row is
full, the last one cut to fill it. Three length distributions:

* ``exp``: exponential, mean 2048 tokens;
* ``lognormal``: long-tailed, median 1024 tokens, sigma 1.5 (mean about 3100; one document in a
  hundred is longer than 34k);
* ``exp-2cp``: ``exp`` with every length rounded up to a multiple of ``2 * cp`` (the only rows torch
  2.13's per-document head-tail balancer accepts; the last document cut to a multiple too).

Work: a token at position ``p`` of its document attends to ``p + 1`` keys, a pad row to none. Each
balancer's indices (its ``_generate_indices()``, ``(B, S')``: the buffer's rows in rank order) cut into
``cp`` equal parts give each rank's rows; a rank's work is the sum over its rows, and a row's score is
``max / mean`` over ranks (1.00 is perfect). Balancers:

* ``none``: no balancer (rank ``r`` holds the ``r``-th contiguous part of the row);
* ``headtail``: ``_HeadTailLoadBalancer`` (torchtitan's default), blind to documents;
* ``perdoc-ht``: ``_PerDocumentHeadTailLoadBalancer`` given the row's lengths; "refused" where it raises
  (a length not a multiple of ``2 * cp``). torch 2.13's, before pytorch #189902;
* ``ptrr``: ``_PTRRLoadBalancer`` from a document-causal ``BlockMask`` of 128-token blocks. The mask is
  built from its block counts (``BlockMask.from_kv_blocks``; a query block's keys are one run of blocks,
  from its first token's document start to its last token), not by ``create_block_mask``, which on the
  CPU materializes the ``S x S`` mask (17 GB at 128k): the time is PTRR's own, the mask given;
* ``cp-zigzag``: cpshard's zigzag plans over ``cpshard.compat.torch_cp.to_buffer``'s padded buffer (every
  document padded to a multiple of ``2 * cp``: ``S'`` grows, the pad rows cost nothing; the padding is
  reported);
* ``cp-zz-full``: cpshard's zigzag on the full row, no padding (``S' = S``):
  ``plans_from_positions(..., layout="zigzag")``, each document's ``2 * cp`` chunks one row apart
  (``padding="none"``), what torchtitan's ``"cpshard_zigzag"`` runs;
* ``cp-contig``: cpshard's contiguous layout with its balanced order, no padding (``S' = S``).

``fit``: the share of rows whose longest document fits a rank's share (``S / cp`` tokens); ``bound``:
the mean over the rows of ``cpshard.index.balance.work_lower_bound`` / mean, what no order of the
contiguous layout can beat (a document that fits a share in tokens can still outweigh a share in
work: its tail rows are dear). The last table is the host time to build each balancer and its
indices for one row (least of ``--repeats``; cpshard's includes the plans from the positions).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from _timing import least_ms, packed_row_lengths

from cpshard import ShardPlan
from cpshard.compat import torch_cp
from cpshard.index.balance import work_lower_bound

BLOCK = 128
SIZES = (8192, 32768, 131072)
CPS = (2, 4, 8, 16)
DISTS = ("exp", "lognormal", "exp-2cp")
NAMES = ("none", "headtail", "perdoc-ht", "ptrr", "cp-zigzag", "cp-zz-full", "cp-contig")


def lengths(rng: random.Random, dist: str, total: int, cp: int) -> list[int]:
    """One packed row's document lengths (sum ``total``); ``exp-2cp``: each a multiple of ``2 * cp``."""
    return packed_row_lengths(rng, dist, total, 2 * cp if dist == "exp-2cp" else 1)


def positions(rows: list[list[int]]) -> torch.Tensor:
    """``(B, S)`` position ids restarting at 0 at each document (torchtitan's convention)."""
    return torch.stack([torch.cat([torch.arange(n) for n in lens]) for lens in rows])


def doc_block_mask(rows: list[list[int]]) -> Any:
    """A document-causal ``BlockMask`` (128-token blocks) of the rows, built from its block counts."""
    from torch.nn.attention.flex_attention import BlockMask
    nums, idxs = [], []
    for lens in rows:
        start = torch.repeat_interleave(torch.cumsum(torch.tensor([0, *lens[:-1]]), 0), torch.tensor(lens))
        n_blocks = start.numel() // BLOCK
        first = start[::BLOCK] // BLOCK  # the first key block a query block reaches
        block = torch.arange(n_blocks)
        nums.append(block - first + 1)
        idxs.append((first[:, None] + torch.arange(n_blocks)[None, :]).clamp(max=n_blocks - 1))
    kv_num = torch.stack(nums)[:, None].to(torch.int32)
    kv_idx = torch.stack(idxs)[:, None].to(torch.int32)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=BLOCK)


def balancers(rows: list[list[int]], cp: int) -> dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor] | str]]:
    """Each balancer as a function of nothing: ``(indices (B, S'), cost (B, S'))`` or why it has none."""
    lb = torch_cp.torch_names()  # torch's balancers, by their (private) names, checked by cpshard
    total = sum(rows[0])
    pos = positions(rows)
    cost = (pos + 1).to(torch.int64)

    def plain() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(total).expand(len(rows), total), cost

    def headtail() -> tuple[torch.Tensor, torch.Tensor]:
        idx = lb._HeadTailLoadBalancer(total, cp, "cpu")._generate_indices()
        return idx.expand(len(rows), total).long(), cost

    def perdoc() -> tuple[torch.Tensor, torch.Tensor] | str:
        try:
            return lb._PerDocumentHeadTailLoadBalancer(rows, cp, "cpu")._generate_indices().long(), cost
        except AssertionError:
            return "refused"

    mask = doc_block_mask(rows)

    def ptrr() -> tuple[torch.Tensor, torch.Tensor]:
        return lb._PTRRLoadBalancer(mask, cp)._generate_indices().long(), cost

    def cpshard(layout: str) -> Callable[[], tuple[torch.Tensor, torch.Tensor] | str]:
        def run() -> tuple[torch.Tensor, torch.Tensor] | str:
            if layout == "zigzag-padded":  # each document padded to a multiple of 2 * cp: a longer buffer
                total = max(ShardPlan.build(lens, cp_size=cp, layout="zigzag").total_len for lens in rows)
                plans = [ShardPlan.build(lens, cp_size=cp, layout="zigzag", total_len=total) for lens in rows]
                buffer_cost = torch_cp.to_buffer([[torch.arange(1, n + 1) for n in lens] for lens in rows], plans)
            else:  # the row itself: zigzag's chunks one row apart, or the contiguous balanced order
                plans = torch_cp.plans_from_positions(pos, cp_size=cp, layout=layout)
                buffer_cost = cost
            return torch_cp.load_balancer(plans)._generate_indices(), buffer_cost
        return run

    return {"none": plain, "headtail": headtail, "perdoc-ht": perdoc, "ptrr": ptrr,
            "cp-zigzag": cpshard("zigzag-padded"), "cp-zz-full": cpshard("zigzag"), "cp-contig": cpshard("contiguous")}


def scores(indices: torch.Tensor, cost: torch.Tensor, cp: int) -> list[float]:
    """Each row's ``max / mean`` of its ranks' work, from the indices (rank ``r``: the ``r``-th part)."""
    work = cost.gather(1, indices).view(indices.shape[0], cp, -1).sum(-1).double()
    return (work.max(1).values / work.mean(1)).tolist()


def _timed(fn: Callable[[], Any], repeats: int) -> float | str:
    got = fn()
    return got if isinstance(got, str) else least_ms(fn, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="S 8k, cp 2 and 8, 2 rows, 3 timing repeats")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="row lengths S (default 8k 32k 128k)")
    parser.add_argument("--cps", type=int, nargs="+", default=None, help="CP sizes (default 2 4 8 16)")
    parser.add_argument("--rows", type=int, default=None, help="rows (seeds) per configuration (default 4)")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats, least kept (default 7)")
    args = parser.parse_args()
    sizes = args.sizes or ((8192,) if args.quick else SIZES)
    cps = args.cps or ((2, 8) if args.quick else CPS)
    n_rows = args.rows or (2 if args.quick else 4)
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(1)

    print(f"document-causal work per rank, max/mean (mean over {n_rows} rows / worst row); 1.00 is perfect")
    header = (f"{'S':>7} {'cp':>3} {'dist':>10} {'fit':>5} {'bound':>6} " + " ".join(f"{n:>15}" for n in NAMES)
              + f" {'zz pad':>7}")
    print(header)
    print("-" * len(header))
    times: dict[tuple[int, int], dict[str, float | str]] = {}
    for size in sizes:
        for cp in cps:
            for dist in DISTS:
                rows = [lengths(random.Random(1000 * seed + cp), dist, size, cp) for seed in range(n_rows)]
                fit = sum(max(r) <= size // cp for r in rows) / n_rows
                bound = statistics.mean(work_lower_bound(r, r, cp) * cp / sum(n * (n + 1) // 2 for n in r)
                                        for r in rows)
                cells, pad = [], ""
                for name, fn in balancers(rows, cp).items():
                    got = fn()
                    if isinstance(got, str):
                        cells.append(f"{got:>15}")
                        continue
                    if name == "cp-zigzag":
                        pad = f"{got[0].shape[1] / size - 1:>6.1%}"
                    s = scores(*got, cp)
                    cells.append(f"{statistics.mean(s):>7.3f}/{max(s):<7.3f}")
                print(f"{size:>7} {cp:>3} {dist:>10} {fit:>5.0%} {bound:>6.3f} " + " ".join(cells) + f" {pad:>7}")
                if dist == "exp":  # unpadded zigzag where chunks differ (the indices from the segments)
                    exp_full = _timed(balancers(rows[:1], cp)["cp-zz-full"], repeats)
                if dist == "exp-2cp":
                    times[size, cp] = {name: _timed(fn, repeats) for name, fn in balancers(rows[:1], cp).items()}
                    times[size, cp]["zzfull/exp"] = exp_full
        print()

    print(f"host ms to build one row's balancer and its indices (least of {repeats}; exp-2cp rows; cpshard's: plans "
          "from positions + indices; ptrr: the BlockMask given; zzfull/exp: cp-zz-full on an exp row, whose "
          "chunks differ)")
    header = f"{'S':>7} {'cp':>3} " + " ".join(f"{n:>10}" for n in NAMES) + f" {'zzfull/exp':>10}"
    print(header)
    print("-" * len(header))
    for (size, cp), row in times.items():
        print(f"{size:>7} {cp:>3} " + " ".join(f"{v:>10.2f}" if isinstance(v, float) else f"{v:>10}"
                                              for v in row.values()))
    print()
    many_documents(sizes, cps, repeats)


def many_documents(sizes: Sequence[int], cps: Sequence[int], repeats: int) -> None:
    """Host ms of ``plans_from_positions`` (contiguous, balanced order) on rows of thousands of short
    documents: all-zero positions (every token its own document: a collator that pads positions with 0),
    alternating 0, 1 (pairs), and documents of 1-3 tokens drawn (a fixed seed)."""
    print(f"host ms of plans_from_positions on rows of many short documents (least of {repeats}; contiguous)")
    header = f"{'S':>7} {'cp':>3} {'all-zero':>10} {'pairs':>10} {'1-3 drawn':>10}"
    print(header)
    print("-" * len(header))
    for size in sizes:
        rng = random.Random(size)
        drawn = []
        while sum(drawn) < size:
            drawn.append(min(rng.randint(1, 3), size - sum(drawn)))
        rows = [torch.zeros(1, size, dtype=torch.long), (torch.arange(size) % 2)[None], positions([drawn])]
        for cp in cps:
            cells = [least_ms(lambda pos=pos: torch_cp.plans_from_positions(pos, cp_size=cp), repeats) for pos in rows]
            print(f"{size:>7} {cp:>3} " + " ".join(f"{v:>10.2f}" for v in cells))


if __name__ == "__main__":
    main()
