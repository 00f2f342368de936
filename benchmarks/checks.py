"""Benchmark: what the call headers (Note [Call headers] in ``src/cpshard/_header.py``) and ``check=True`` cost.

Run (CPU, gloo, on 127.0.0.1; small, for a shared 2-core machine)::

    .venv/bin/python benchmarks/checks.py              # 2 and 4 ranks, 16k and 256k tokens, rows of 8 float32
    .venv/bin/python benchmarks/checks.py --quick      # fewer repeats, 2 ranks

Per world size and batch, for the all-gather of ``gather`` and the all-to-all of ``shift_sharded``
(shift 1) and ``relayout`` (zigzag to its contiguous twin):

- "bare": the collective alone on the same bytes, as before the headers (``all_gather_single`` /
  ``all_to_all_single`` of the rows, no header);
- "headed": the same collective with each contribution (all-gather) or chunk (all-to-all) led by the
  64-byte header, checked on arrival (``distributed.stamp.all_gather_stamped`` / ``all_to_all``);
- "call": the public call, checks off (the default), and "checked": with ``check=True`` (the
  agreement all-gather of 272 bytes per rank first).

Per call, every rank does ``barrier(); t0; call; t1``; a call's time is the max over ranks, the table
the median over repeats. "+bytes" is what the header adds to the bytes one rank sends per call.

Then the losses' protection (Note [Stamped reductions] in ``_header.py``, Note [Failure in a loss] in
``loss/reductions.py``), per world size, for ``token_mean`` (one count) and ``sequence_mean`` (64 sequences'
counts), float64, checks off unless named:

- "bare": the same loss with an unprotected count sum (the arithmetic of ``cpshard.loss``, one plain
  ``all_reduce`` of the counts): what the losses cost before;
- "stamped": the public call (its count sum led by the trailer, checked on arrival);
- "checked": the public call with ``check=True`` (the agreement's all-gather first).

The three run interleaved (one call of each per round, the median over rounds), so that a busy
machine's drift reaches them alike.

"+bytes" is what the trailer adds to the bytes one rank sends per call.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from _timing import slowest_rank_ms as timed


def _body(rank: int, world: int, tokens: int, repeats: int) -> list[tuple[str, int, float, float, float, float]]:
    from cpshard import ShardPlan, shard, twin_plan
    from cpshard.base.dtypes import wire
    from cpshard.distributed import gather, relayout, shift_sharded
    from cpshard.distributed.header import HEADER_BYTES
    from cpshard.distributed.stamp import Stamp, all_gather_stamped, all_to_all
    from cpshard.plan.twins import relayout_route

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    lens = (torch.rand(max(1, tokens // 512), generator=g) * 1024 + 1).long().tolist()
    plan = ShardPlan.build(lens, cp_size=world)
    local = shard(torch.randn(plan.num_tokens, 8, generator=g), plan, rank)
    rows = local.contiguous()
    call = {"dtype": rows.dtype, "row shape": (8,)}
    out = []

    # all-gather (gather)
    stamp = Stamp("gather", rank, False, (plan,), call)
    buf = torch.empty((world * rows.shape[0], 8))

    def bare_gather() -> None:
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(wire(buf), wire(rows), group=group)
    out.append(("gather", HEADER_BYTES,
                timed(bare_gather, repeats), timed(lambda: all_gather_stamped(rows, group, world, stamp), repeats),
                timed(lambda: gather(local, plan, group), repeats),
                timed(lambda: gather(local, plan, group, check=True), repeats)))

    # all-to-all: shift_sharded's exchange and relayout's route
    ex = plan.indices().shift_exchange(rank, 1, rows.device)
    dst = twin_plan(plan, "contiguous")
    route = relayout_route(plan, dst, rank, rows.device)
    for name, x, stamp, public in (
            ("shift_sharded", ex, Stamp("shift_sharded", rank, False, (plan,), call),
             lambda c: shift_sharded(local, plan, group, shift=1, check=c)),
            ("relayout", route, Stamp("relayout", rank, False, (plan, dst), call),
             lambda c: relayout(local, plan, dst, group, check=c))):
        send = rows.index_select(0, x.send_rows)

        def bare(x=x, send=send) -> None:
            recv = torch.empty((sum(x.recv_splits), 8))
            dist.all_to_all_single(recv, send, list(x.recv_splits), list(x.send_splits), group=group)

        out.append((name, HEADER_BYTES * world, timed(bare, repeats),
                    timed(lambda x=x, send=send, stamp=stamp: all_to_all(send, x.recv_splits, x.send_splits,
                                                                          group, stamp), repeats),
                    timed(lambda public=public: public(False), repeats),
                    timed(lambda public=public: public(True), repeats)))
    return out if rank == 0 else []


def _loss_body(rank: int, world: int, repeats: int) -> list[tuple[str, int, float, float, float]]:
    from cpshard import ShardPlan
    from cpshard.loss import masked_rows, sequence_mean, token_mean

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(1)
    lens = (torch.rand(64, generator=g) * 512 + 1).long().tolist()
    plan = ShardPlan.build(lens, cp_size=world)
    values = torch.rand(plan.local_len, dtype=torch.float64, generator=g)
    mask = plan.label_mask(rank)
    tokens = plan.token_mask(rank)
    seq = plan.sequence_ids(rank)

    def bare_token_mean() -> torch.Tensor:  # the loss without protection: a plain all_reduce of the count
        m = torch.where(tokens, mask, False)
        count = m.sum(dtype=torch.float64)
        dist.all_reduce(count, group=group)
        return world * masked_rows(values, m).sum() / count.clamp(min=1)

    def bare_sequence_mean() -> torch.Tensor:
        m = torch.where(tokens, mask, False)
        v = masked_rows(values, m)
        sums = v.new_zeros(plan.num_seqs).index_add(0, seq, v)
        counts = torch.zeros(plan.num_seqs, dtype=torch.float64).index_add(0, seq, m.double())
        dist.all_reduce(counts, group=group)
        labelled = counts > 0
        return world * (sums / counts.clamp(min=1)).sum() / labelled.sum().clamp(min=1)

    out = []
    for name, bare, public, values_sent in (
            ("token_mean", bare_token_mean, lambda c: token_mean(values, mask, plan, group, check=c), 1),
            ("sequence_mean", bare_sequence_mean, lambda c: sequence_mean(values, mask, plan, group, check=c), 64)):
        assert torch.allclose(bare(), public(False))  # the same loss, the protection aside
        from cpshard.spawn import CollectiveCounter
        with CollectiveCounter() as counter:
            public(False)
        added = counter.bytes - 8 * values_sent
        # interleaved, one call of each per round: a busy machine's drift hits the three alike
        runs: list[list[float]] = [[], [], []]
        for _ in range(repeats):
            for i, fn in enumerate((bare, lambda public=public: public(False), lambda public=public: public(True))):
                runs[i].append(timed(fn, 1))
        out.append((name, added, *(statistics.median(r) for r in runs)))
    return out if rank == 0 else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, 2 ranks, 16k tokens")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    from cpshard.spawn import run_ranks

    repeats = args.repeats or (5 if args.quick else 21)
    worlds = (2,) if args.quick else (2, 4)
    sizes = (1 << 14,) if args.quick else (1 << 14, 1 << 18)
    print(f"{'ranks':>5} {'tokens':>7} {'collective':<14} {'+bytes':>6} {'bare ms':>8} {'headed ms':>9} {'ratio':>6} "
          f"{'call ms':>8} {'checked ms':>10} {'ratio':>6}")
    for world in worlds:
        for tokens in sizes:
            rows = run_ranks(_body, world, tokens, repeats, timeout=600)[0]
            for name, added, bare, headed, call, checked in rows:
                print(f"{world:>5} {tokens:>7} {name:<14} {added:>6} {bare:>8.3f} {headed:>9.3f} {headed / bare:>6.2f} "
                      f"{call:>8.3f} {checked:>10.3f} {checked / call:>6.2f}")
    print()
    print(f"{'ranks':>5} {'loss':<14} {'+bytes':>6} {'bare ms':>8} {'stamped ms':>10} {'ratio':>6} {'checked ms':>10} "
          f"{'ratio':>6}")
    for world in worlds:
        for name, added, bare, stamped, checked in run_ranks(_loss_body, world, repeats, timeout=600)[0]:
            print(f"{world:>5} {name:<14} {added:>6} {bare:>8.3f} {stamped:>10.3f} {stamped / bare:>6.2f} "
                  f"{checked:>10.3f} {checked / bare:>6.2f}")


if __name__ == "__main__":
    main()
