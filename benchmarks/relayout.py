"""Benchmark: ``cpshard.distributed.relayout`` against an all-gather of the whole buffer and a select.

Run (CPU, gloo, 4 ranks on 127.0.0.1)::

    .venv/bin/python benchmarks/relayout.py            # 1 M tokens, 256 documents, rows of 4 float32
    .venv/bin/python benchmarks/relayout.py --quick    # fewer repeats

Both sides turn a rank's rows under a zigzag plan into its rows under the plan's contiguous twin
(``cpshard.twin_plan(plan, "contiguous")``) and back: ``relayout`` with one ``all_to_all_single``
of only the rows whose rank changes; the simple alternative all-gathers every rank's rows
(``all_gather_single``) and selects its own rows of the twin from them. Per call, every rank does
``barrier(); t0; call; t1``; a call's time is the max over ranks, the table the median over repeats.
"cold" is relayout's first call on freshly built plans (the route is computed then, and cached).
Communication is counted on a separate call with ``cpshard.spawn.CollectiveCounter`` (every c10d
call); "sent MB" is what the ranks hand the backend (all ranks summed), "moved MB" what
crosses ranks (a rank's own rows in the gathered buffer do not).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import slowest_rank_ms  # noqa: E402

WORLD, TOKENS, DOCS, WIDTH = 4, 1 << 20, 256, 4


def _lengths(tokens: int, docs: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    w = torch.rand(docs, generator=g) ** 3 + 0.01  # long-tailed, as packed batches are
    lens = (w / w.sum() * tokens).floor().long()
    lens[0] += tokens - int(lens.sum())
    return lens.tolist()


def _body(rank: int, world: int, repeats: int) -> list[tuple[str, float, float, float, int]] | None:
    from cpshard import ShardPlan, shard, twin_plan
    from cpshard.distributed import relayout
    from cpshard.spawn import CollectiveCounter

    torch.set_num_threads(1)
    group = dist.group.WORLD
    lens = _lengths(TOKENS, DOCS)
    zz = ShardPlan.build(lens, cp_size=world)
    cont = twin_plan(zz, "contiguous")
    x = torch.randn(sum(lens), WIDTH, generator=torch.Generator().manual_seed(1))
    rows = []
    for name, src, dst in (("zigzag -> contiguous", zz, cont), ("contiguous -> zigzag", cont, zz)):
        fresh_src, fresh_dst = ShardPlan.build(lens, cp_size=world), None
        fresh_dst = twin_plan(fresh_src, "contiguous")
        if src is cont:
            fresh_src, fresh_dst = fresh_dst, fresh_src
        local = shard(x, src, rank)
        row_bytes = local[0].numel() * local.element_size()
        dist.barrier()
        t = time.perf_counter()
        relayout(local, fresh_src, fresh_dst, group)
        cold = torch.tensor([time.perf_counter() - t])
        dist.all_reduce(cold, op=dist.ReduceOp.MAX)
        tgt, inv, moved_rows = src.indices().permutation(dst)
        mine = torch.from_numpy(inv[rank * src.local_len:(rank + 1) * src.local_len].copy())

        def gather_select() -> torch.Tensor:
            buf = local.new_empty((world * local.shape[0], *local.shape[1:]))
            dist.all_gather_single(buf, local, group=group)
            return buf.index_select(0, mine)

        assert torch.equal(relayout(local, src, dst, group), shard(x, dst, rank))
        assert torch.equal(gather_select(), shard(x, dst, rank))
        for label, fn, moved in (("relayout", lambda: relayout(local, src, dst, group), moved_rows),
                                 ("all-gather + select", gather_select, world * (world - 1) * src.local_len)):
            with CollectiveCounter() as comm:
                fn()
            sent = torch.tensor([comm.bytes])
            dist.all_reduce(sent)
            ms = slowest_rank_ms(fn, repeats)
            rows.append((f"{name}: {label}", ms, float(cold) * 1e3 if label == "relayout" else float("nan"),
                         int(sent) / 1e6, moved * row_bytes / 1e6, len(comm.calls), comm.calls))
    return rows if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats instead of 20")
    args = parser.parse_args()
    from cpshard.spawn import run_ranks

    rows = run_ranks(_body, WORLD, 5 if args.quick else 20, timeout=900)[0]
    print(f"{TOKENS} tokens in {DOCS} documents, rows of {WIDTH} float32, cp={WORLD} gloo ranks on "
          f"{os.cpu_count()} cores")
    head = f"{'direction: method':44} {'ms':>8} {'cold ms':>8} {'sent MB':>8} {'moved MB':>9} collectives"
    print(head + "\n" + "-" * len(head))
    for name, ms, cold, sent, moved, count, calls in rows:
        cold_s = f"{cold:8.1f}" if cold == cold else f"{'':8}"
        print(f"{name:44} {ms:8.1f} {cold_s} {sent:8.1f} {moved:9.1f} {count} {calls}")
    for i in (0, 2):
        (a, ms_a, _, _, moved_a, *_), (_, ms_b, _, _, moved_b, *_) = rows[i], rows[i + 1]
        print(f"{a.split(':')[0]}: all-gather + select / relayout: time {ms_b / ms_a:.2f}x, "
              f"moved bytes {moved_b / moved_a:.2f}x")


if __name__ == "__main__":
    main()
