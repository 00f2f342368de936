"""Benchmark: ``cpshard.shard`` against one ``torch.index_select`` of the same number of rows.

The baseline is the floor for any sharding scheme: one gather of ``local_len`` rows by a ready-made
index. cpshard adds the pad/fill writes and (on the first call of a plan) building the index. Run::

    .venv/bin/python benchmarks/shard.py                 # 256 sequences, lengths 128..8192, cp=4, tp=2
    .venv/bin/python benchmarks/shard.py --width 1024    # hidden-state rows instead of token ids
    .venv/bin/python benchmarks/shard.py --quick         # 64 sequences, a smoke run

Prints, per case, the median of ``--repeats`` timed calls (after a warm-up) and the ratio to the
baseline; "cold" is the first call on a freshly built plan (``ShardPlan.build`` + index), the cost a
trainer pays once per micro-batch. Also prints the verl-style per-sequence loop for reference
(slicing each sequence's two zigzag chunks in Python), and on CUDA the peak extra memory of each.
"""

from __future__ import annotations

import argparse

import torch
from _timing import add_batch_args, batch_lengths, median_ms, peak_mib

from cpshard import ShardPlan, shard


def _per_sequence_loop(flat: torch.Tensor, plan: ShardPlan, rank: int) -> torch.Tensor:
    """What framework code does today: pad and slice each sequence in a Python loop (zigzag)."""
    cp = plan.cp_size
    out = flat.new_zeros((plan.local_len, *flat.shape[1:]))
    at = 0
    for i, (n, p) in enumerate(zip(plan.seqlens_py, plan.padded_seqlens_py)):
        seq = flat[plan.cu_seqlens_py[i]:plan.cu_seqlens_py[i] + n]
        padded = flat.new_zeros((p, *flat.shape[1:]))
        padded[:n] = seq
        c = p // (2 * cp)
        out[at:at + c] = padded[rank * c:(rank + 1) * c]
        out[at + c:at + 2 * c] = padded[(2 * cp - 1 - rank) * c:(2 * cp - rank) * c]
        at += 2 * c
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(parser)
    parser.add_argument("--width", type=int, default=0, help="trailing width (0: token ids, shape ())")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="64 sequences and 5 repeats: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.seqs, args.repeats = min(args.seqs, 64), min(args.repeats, 5)
    torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    lens = torch.tensor(batch_lengths(args, g))
    trailing = (args.width,) if args.width else ()
    device = torch.device(args.device)
    flat = torch.randint(0, 50_000, (int(lens.sum()), *trailing), generator=g)
    if args.width:
        flat = flat.float()
    flat = flat.to(device)
    plan = ShardPlan.build(lens, cp_size=args.cp, tp_size=args.tp)
    rank = 1
    index = plan.global_rows(rank).clamp(max=flat.shape[0] - 1).to(device)  # any index of local_len rows

    print(f"{args.seqs} sequences, {plan.num_tokens} tokens, T={plan.total_len}, L={plan.local_len}, "
          f"cp={args.cp}, tp={args.tp}, row shape {tuple(flat.shape[1:])}, dtype {flat.dtype}, "
          f"threads={args.threads}, device={device}")
    base = median_ms(lambda: flat.index_select(0, index), args.repeats, device)
    warm = median_ms(lambda: shard(flat, plan, rank), args.repeats, device)
    warm_shift = median_ms(lambda: shard(flat, plan, rank, shift=1, fill=-100), args.repeats, device)

    def cold() -> None:
        fresh = ShardPlan.build(plan.seqlens_py, cp_size=args.cp, tp_size=args.tp)
        shard(flat, fresh, rank)
    cold_ms = median_ms(cold, max(3, args.repeats // 4), device)
    loop_ms = median_ms(lambda: _per_sequence_loop(flat, plan, rank), max(3, args.repeats // 4), device)
    assert torch.equal(_per_sequence_loop(flat, plan, rank), shard(flat, plan, rank))

    rows = [
        ("index_select (baseline)", base, peak_mib(lambda: flat.index_select(0, index), device)),
        ("cpshard.shard, warm", warm, peak_mib(lambda: shard(flat, plan, rank), device)),
        ("cpshard.shard shift=1, warm", warm_shift, peak_mib(lambda: shard(flat, plan, rank, shift=1), device)),
        ("cpshard.shard, cold (build+index)", cold_ms, peak_mib(cold, device)),
        ("per-sequence Python loop", loop_ms, peak_mib(lambda: _per_sequence_loop(flat, plan, rank), device)),
    ]
    print(f"{'path':<36} {'ms':>9} {'x baseline':>11} {'peak MiB':>9}")
    for name, ms, peak in rows:
        print(f"{name:<36} {ms:>9.3f} {ms / base:>11.2f} {peak:>9}")


if __name__ == "__main__":
    main()
