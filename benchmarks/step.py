"""Benchmark: one training step's sharding on one CP rank, against the copy floor (and verl's).

A step plans a fresh micro-batch and shards three tensors for its rank: token ids, next-token
labels (``shift=1``) and the loss mask (``shift=1``). The floor is what no scheme can beat: three
``index_select`` of the same rows by a ready-made index. Run::

    .venv/bin/python benchmarks/step.py            # 256 sequences, lengths U[128, 8192], cp=4, tp=2
    .venv/bin/python benchmarks/step.py --quick    # fewer repeats, smaller tables

Prints medians (ms) and ratios to the floor for both layouts (cold: a fresh plan each step, as in
training; warm: the plan's indices cached), the restore (``unshard`` of every rank's output) against
one ``index_select`` of the token rows, plan build time at 4096 sequences, and the padding table:
the padding overhead of ``padding="aligned"`` (SPEC's default) against ``padding="minimal"`` for
short RL-like sequences. With ``--device cuda`` it synchronizes around every call and prints peak
extra memory and the host synchronisations of one call (``torch.cuda.set_sync_debug_mode``; issue
10 asks for at most one per batch): the prepared GPU check is ::

    python benchmarks/step.py --device cuda --repeats 50

verl's ``preprocess_thd_engine`` is compared in ``benchmarks/verl.py``.
"""

from __future__ import annotations

import argparse

import torch
from _timing import add_batch_args, batch_lengths, host_syncs, interleaved_ms, median_ms, peak_mib

from cpshard import ShardPlan, shard, unshard


def _step_table(lens: list[int], args: argparse.Namespace, device: torch.device) -> None:
    g = torch.Generator().manual_seed(1)
    n = sum(lens)
    ids = torch.randint(0, 50_000, (n,), generator=g).to(device)
    mask = torch.ones(n, dtype=torch.bool, device=device)
    rank = 1
    print(f"\nstep: {len(lens)} sequences, {n} tokens, cp={args.cp}, tp={args.tp}, rank {rank}, device={device} "
          "(each path timed in turn within every repeat)")
    print(f"{'layout':<11} {'path':<44} {'ms':>8} {'x floor':>8} {'peak MiB':>9} {'syncs':>6}")
    for layout in ("zigzag", "contiguous"):
        plan = ShardPlan.build(lens, cp_size=args.cp, tp_size=args.tp, layout=layout)
        index = plan.global_rows(rank).clamp(max=n - 1).to(device)  # any index of local_len rows

        def floor() -> None:
            ids.index_select(0, index), ids.index_select(0, index), mask.index_select(0, index)

        def step(p: ShardPlan | None = None) -> None:
            p = p or ShardPlan.build(lens, cp_size=args.cp, tp_size=args.tp, layout=layout)
            shard(ids, p, rank), shard(ids, p, rank, shift=1, fill=-100), shard(mask, p, rank, shift=1, fill=False)

        base, cold, warm = interleaved_ms([floor, step, lambda: step(plan)], args.repeats, device)
        rows = [("3x index_select (the floor)", base, peak_mib(floor, device), host_syncs(floor, device)),
                ("ShardPlan.build + 3 shards (cold, per step)", cold, peak_mib(step, device), host_syncs(step, device)),
                ("3 shards, plan cached (warm)", warm, peak_mib(lambda: step(plan), device),
                 host_syncs(lambda: step(plan), device))]
        parts = [torch.randn(plan.local_len, device=device) for _ in range(args.cp)]
        token_index = torch.arange(n, device=device)
        def restore_floor_fn() -> None:
            torch.cat(parts).index_select(0, token_index)

        def restore_fn() -> None:
            unshard(parts, ShardPlan.build(lens, cp_size=args.cp, tp_size=args.tp, layout=layout))

        restore_floor, restore = interleaved_ms([restore_floor_fn, restore_fn], args.repeats, device)
        rows += [("restore floor: cat + index_select of tokens", restore_floor, peak_mib(restore_floor_fn, device),
                  host_syncs(restore_floor_fn, device)),
                 ("unshard (restore, cold)", restore, peak_mib(restore_fn, device), host_syncs(restore_fn, device))]
        for name, ms, peak, syncs in rows:
            ref = restore_floor if name.startswith("unshard") else base
            print(f"{layout:<11} {name:<44} {ms:>8.3f} {ms / ref:>8.2f} {peak:>9} {syncs:>6}")


def _build_table(args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(1, 513, (4096,), generator=g).tolist()
    for layout in ("zigzag", "contiguous"):
        ms = median_ms(lambda: ShardPlan.build(lens, cp_size=args.cp, tp_size=args.tp, layout=layout),
                        args.repeats, torch.device("cpu"))
        print(f"plan build, 4096 sequences (U[1, 512]), {layout}: {ms:.3f} ms")


def _padding_table(args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(64, 513, (64,), generator=g).tolist() for _ in range(4 if args.quick else 32)]
    print("\npadding overhead (pad rows / tokens), RL-like batches of 64 sequences, lengths U[64, 512]:")
    print(f"{'(tp, cp)':>9} {'layout':<11} {'aligned':>9} {'minimal':>9} {'saved rows':>11}")
    for tp, cp in ((2, 2), (4, 4), (8, 8)):
        for layout in ("zigzag", "contiguous"):
            over = {}
            for padding in ("aligned", "minimal"):
                plans = [ShardPlan.build(b, cp_size=cp, tp_size=tp, layout=layout, padding=padding) for b in batches]
                over[padding] = (sum(p.padding_overhead for p in plans) / len(plans),
                                 sum(p.total_len for p in plans))
            saved = 1 - over["minimal"][1] / over["aligned"][1]
            aligned, minimal = 100 * over["aligned"][0], 100 * over["minimal"][0]
            print(f"{str((tp, cp)):>9} {layout:<11} {aligned:>8.1f}% {minimal:>8.1f}% {100 * saved:>10.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(parser)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 5 if args.quick else 25
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lens = batch_lengths(args, g)
    _step_table(lens, args, torch.device(args.device))
    print()
    _build_table(args)
    _padding_table(args)


if __name__ == "__main__":
    main()
