"""Benchmark: cpshard's ``shift_sharded`` vs Megatron-core's ``roll_tensor`` (packed THD, zigzag CP).

Run (CPU, gloo, 4 ranks on 127.0.0.1)::

    .venv/bin/python benchmarks/shift.py            # batches of 8 / 64 / 256 sequences
    .venv/bin/python benchmarks/shift.py --quick    # fewer repeats

Needs megatron-core 0.19.2 (see ``benchmarks/_megatron.py`` for the install commands). Both sides
shift the same zigzag-sharded next-token labels: cpshard with
``shift_sharded(local, plan, group, shift=1, fill=FILL, pad_value=PAD)``, Megatron with
``roll_tensor(local[None], shifts=-1, dims=-1, cp_group=group, packed_seq_params=psp)`` where
``psp.cu_seqlens_q`` is cpshard's ``plan.cu_seqlens_padded`` (Megatron's packed roll reads only
``cu_seqlens_q`` and divides it by ``cp_size`` to find each sequence's local slice, so it must be
given the *padded* offsets; it never reads ``cu_seqlens_q_padded``).

The same batches are also sharded with the contiguous layout (DeepSeek-V4): cpshard's result is
checked against ``shard(x, shift=1)`` and Megatron's roll, which assumes zigzag, is counted wrong
on the token rows where both conventions agree (about 1.3% of labels here, silently).

Semantics (megatron/core/transformer/multi_token_prediction.py, ``_roll_tensor_packed_seq``):
``shifts=-1`` means row ``p`` receives row ``p + 1`` (the same direction as cpshard's ``shift=1``);
only ``shifts=-1`` on the last dim is supported. Megatron rolls each *padded* sequence: it does not
know the real lengths, so

* the last real token of sequence ``i`` (position ``n_i - 1``) receives whatever the input holds at
  position ``n_i`` (a pad row's content), or 0 when the sequence has no pad rows
  (``n_i == padded_i``); cpshard writes ``fill`` there;
* a pad row at position ``p < padded_i - 1`` receives the content of pad row ``p + 1``, and the last
  padded row receives 0; cpshard writes ``pad_value`` on every pad row.

So the two agree on every token row ``p <= n_i - 2`` (checked below on every rank), and they agree
on *every* row when ``fill == pad_value == 0`` and the input's pad rows hold 0 (also checked).
Megatron's output is further checked row for row against a model of its semantics: cpshard's
``shard(..., shift=1, fill=0)`` of the padded sequences taken as if every row were a token.

Timing: per call, every rank does ``barrier(); t0; call; t1``; a call's time is the max over ranks,
the table shows the median over repeats. "cold" is cpshard's first call on a freshly built plan
(whose per-plan exchange indices are not yet cached, as for a new micro-batch), after the rank has
sharded its inputs with that plan. Communication is counted on a separate, untimed call with
``cpshard.spawn.CollectiveCounter`` (a dispatch mode that sees every c10d call, p2p
included); "bytes" is what a rank hands the backend to send (all ranks summed). The ranks run under
``cpshard.spawn.run_ranks``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import cpshard
from _timing import add_sweep_args
from cpshard.spawn import CollectiveCounter, run_ranks

WORLD = 4
PAD = -1  # content of pad rows (labels input) and cpshard's pad_value
FILL = -100  # cpshard's fill past a sequence's end (the usual ignore index)
VOCAB = 32000

# -- one rank -----------------------------------------------------------------------------------


def _batch(num_seqs: int, seed: int, lo: int, hi: int) -> tuple[list[int], torch.Tensor]:
    g = torch.Generator().manual_seed(seed + num_seqs)
    seqlens = torch.randint(lo, hi + 1, (num_seqs,), generator=g).tolist()
    labels = torch.randint(0, VOCAB, (sum(seqlens),), generator=g, dtype=torch.int64)
    return seqlens, labels


def _padded_input(labels: torch.Tensor, plan: Any, pad: int) -> list[torch.Tensor]:
    """Per-sequence padded rows: the tokens, then ``pad`` up to the padded length."""
    out = []
    for i, (n, npad) in enumerate(zip(plan.seqlens_py, plan.padded_seqlens_py)):
        start = plan.cu_seqlens_py[i]
        seq = torch.full((npad,), pad, dtype=labels.dtype)
        seq[:n] = labels[start:start + n]
        out.append(seq)
    return out


def _timed(fn: Callable[[], Any], group: Any, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _check(ok: bool, what: str, rank: int, num_seqs: int) -> None:
    if not ok:
        raise AssertionError(f"rank {rank}, B={num_seqs}: {what}")


def _run_batch(rank: int, group: Any, num_seqs: int, args: argparse.Namespace, roll_tensor: Any,
               PackedSeqParams: Any) -> dict[str, Any]:
    from cpshard.distributed import shift_sharded

    seqlens, labels = _batch(num_seqs, args.seed, args.min_len, args.max_len)
    plan = cpshard.ShardPlan.build(seqlens, cp_size=WORLD, tp_size=1, layout="zigzag")
    local = cpshard.shard(labels, plan, rank, pad_value=PAD)
    cu = plan.cu_seqlens_padded  # int32; Megatron divides it by cp_size to get local offsets
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=plan.max_seqlen, max_seqlen_kv=plan.max_seqlen)

    def run_cpshard(x: torch.Tensor = local, p: Any = plan, fill: int = FILL, pad: int = PAD) -> torch.Tensor:
        return shift_sharded(x, p, group, shift=1, fill=fill, pad_value=pad)

    def run_megatron(x: torch.Tensor = local) -> torch.Tensor:
        return roll_tensor(x.view(1, -1), shifts=-1, dims=-1, cp_group=group, packed_seq_params=psp)[0].view(-1)

    # ---- correctness -------------------------------------------------------------------------
    expected = cpshard.shard(labels, plan, rank, shift=1, fill=FILL, pad_value=PAD)
    got_cp = run_cpshard()
    _check(torch.equal(got_cp, expected), "shift_sharded != shard(x, shift=1)", rank, num_seqs)
    got_mg = run_megatron()
    _check(got_mg.shape == got_cp.shape and got_mg.dtype == got_cp.dtype, "shape/dtype differ", rank, num_seqs)

    seq, pos = plan.sequence_ids(rank), plan.position_ids(rank)
    n = plan.seqlens.to(torch.int64)[seq]
    agree = pos <= n - 2  # token rows whose successor is a token of the same sequence
    _check(torch.equal(got_mg[agree], got_cp[agree]), "Megatron != cpshard on rows p <= n-2", rank, num_seqs)

    # Megatron's semantics, modelled with cpshard: shift every padded sequence as if its pad rows
    # were tokens, 0 past the padded end.
    plan_padded = cpshard.ShardPlan.build(plan.padded_seqlens_py, cp_size=WORLD, layout="zigzag")
    _check(plan_padded.padded_seqlens_py == plan.padded_seqlens_py, "padded plan re-pads", rank, num_seqs)
    model = cpshard.shard(_padded_input(labels, plan, PAD), plan_padded, rank, shift=1, fill=0)
    _check(torch.equal(got_mg, model), "Megatron != model (roll of padded sequences, 0 at the end)",
           rank, num_seqs)

    last = pos == n - 1
    pads = pos >= n
    diff_last = int((got_mg[last] != got_cp[last]).sum())
    diff_pad = int((got_mg[pads] != got_cp[pads]).sum())

    # With fill == pad_value == 0 and zero pad rows the two agree on every row.
    local0 = cpshard.shard(labels, plan, rank, pad_value=0)
    _check(torch.equal(run_megatron(local0), run_cpshard(local0, plan, 0, 0)),
           "Megatron != cpshard with fill = pad_value = 0", rank, num_seqs)

    contiguous = _contiguous_check(rank, group, seqlens, labels, roll_tensor, PackedSeqParams, num_seqs)

    # ---- communication -----------------------------------------------------------------------
    dist.barrier(group=group)
    with CollectiveCounter() as c_cp:
        run_cpshard()
    dist.barrier(group=group)
    with CollectiveCounter() as c_mg:
        run_megatron()
    dist.barrier(group=group)

    # ---- timing ------------------------------------------------------------------------------
    for _ in range(args.warmup):
        run_cpshard()
        run_megatron()
    t_cp = _timed(run_cpshard, group, args.repeats)
    t_mg = _timed(run_megatron, group, args.repeats)
    t_cold = []
    for _ in range(args.cold_repeats):
        fresh = cpshard.ShardPlan.build(seqlens, cp_size=WORLD, tp_size=1, layout="zigzag")
        x = cpshard.shard(labels, fresh, rank, pad_value=PAD)
        t_cold += _timed(lambda: run_cpshard(x, fresh), group, 1)

    return {
        "rank": rank, "num_seqs": num_seqs, "tokens": plan.num_tokens, "total_len": plan.total_len,
        "local_len": plan.local_len, "t_cp": t_cp, "t_mg": t_mg, "t_cold": t_cold,
        "calls_cp": dict(collections.Counter(c_cp.calls)), "calls_mg": dict(collections.Counter(c_mg.calls)),
        "sent_cp": c_cp.bytes, "sent_mg": c_mg.bytes,
        "agree_rows": int(agree.sum()), "last_rows": int(last.sum()), "pad_rows": int(pads.sum()),
        "diff_last": diff_last, "diff_pad": diff_pad, **contiguous,
    }


def _contiguous_check(rank: int, group: Any, seqlens: list[int], labels: torch.Tensor, roll_tensor: Any,
                      PackedSeqParams: Any, num_seqs: int) -> dict[str, Any]:
    """The contiguous layout (DeepSeek-V4): cpshard stays exact; Megatron's packed roll assumes zigzag.

    Compares both on the rows where their semantics agree under zigzag (token rows ``p <= n - 2``),
    so every difference counted here is a wrong label, not a convention.
    """
    from cpshard.distributed import shift_sharded

    plan = cpshard.ShardPlan.build(seqlens, cp_size=WORLD, tp_size=1, layout="contiguous")
    local = cpshard.shard(labels, plan, rank, pad_value=PAD)
    got_cp = shift_sharded(local, plan, group, shift=1, fill=FILL, pad_value=PAD)
    _check(torch.equal(got_cp, cpshard.shard(labels, plan, rank, shift=1, fill=FILL, pad_value=PAD)),
           "contiguous: shift_sharded != shard(x, shift=1)", rank, num_seqs)
    n = plan.seqlens.to(torch.int64)[plan.sequence_ids(rank)]
    agree = plan.position_ids(rank) <= n - 2
    cu = plan.cu_seqlens_padded
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=plan.max_seqlen, max_seqlen_kv=plan.max_seqlen)
    try:
        got_mg = roll_tensor(local.view(1, -1), shifts=-1, dims=-1, cp_group=group,
                             packed_seq_params=psp)[0].view(-1)
        wrong = int((got_mg[agree] != got_cp[agree]).sum())
        error = ""
    except Exception as exc:  # Megatron may also fail outright on these offsets
        wrong, error = int(agree.sum()), f"{type(exc).__name__}: {str(exc)[:80]}"
    return {"contig_rows": int(agree.sum()), "contig_wrong": wrong, "contig_error": error}


def _ranks(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One gloo rank (cpshard.spawn.run_ranks): every batch, returned to the parent for the report."""
    group = dist.new_group(list(range(world)))
    from cpshard.megatron import import_roll_tensor
    roll_tensor, PackedSeqParams = import_roll_tensor()
    return [_run_batch(rank, group, b, args, roll_tensor, PackedSeqParams) for b in args.batches]


# -- report -------------------------------------------------------------------------------------


def _per_call_max(per_rank: list[list[float]]) -> list[float]:
    return [max(ts) for ts in zip(*per_rank)]


def _calls(d: dict[str, int]) -> str:
    return " + ".join(f"{v} {k}" for k, v in sorted(d.items())) or "none"


def _report(every: list[list[dict[str, Any]]], args: argparse.Namespace) -> None:
    rows = []
    print(f"\ncpshard.distributed.shift_sharded vs megatron.core roll_tensor (packed THD, zigzag), "
          f"{WORLD} gloo ranks, int64 labels, seqlens ~ U[{args.min_len}, {args.max_len}] (seed {args.seed}), "
          f"torch {torch.__version__}, {args.repeats} repeats (median of per-call max over ranks)\n")
    head = ("B", "tokens", "T_pad", "cpshard ms", "cold ms", "megatron ms", "mg/cp", "comm/rank cp",
            "comm/rank mg", "msgs all cp", "msgs all mg", "bytes cp", "bytes mg")
    for i, b in enumerate(args.batches):
        rs = [every[r][i] for r in range(WORLD)]
        cp = statistics.median(_per_call_max([r["t_cp"] for r in rs])) * 1e3
        mg = statistics.median(_per_call_max([r["t_mg"] for r in rs])) * 1e3
        cold = statistics.median(_per_call_max([r["t_cold"] for r in rs])) * 1e3 if args.cold_repeats else float("nan")
        ccp = [sum(r["calls_cp"].values()) for r in rs]
        cmg = [sum(r["calls_mg"].values()) for r in rs]
        rows.append((b, rs[0]["tokens"], rs[0]["total_len"], f"{cp:.3f}", f"{cold:.3f}", f"{mg:.3f}",
                     f"{mg / cp:.1f}x", max(ccp), max(cmg), sum(ccp), sum(cmg),
                     sum(r["sent_cp"] for r in rs), sum(r["sent_mg"] for r in rs)))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    print(fmt.format(*head))
    print(fmt.format(*("-" * w for w in widths)))
    for row in rows:
        print(fmt.format(*row))
    print("\ncomm/rank = collectives or p2p calls per call on the busiest rank; msgs all = summed over ranks; "
          "bytes = bytes handed to the backend to send per call, summed over ranks (cpshard.spawn.CollectiveCounter)")
    print("\nper-rank breakdown (calls per shift):")
    for i, b in enumerate(args.batches):
        rs = [every[r][i] for r in range(WORLD)]
        print(f"  B={b}:")
        for r in rs:
            print(f"    rank {r['rank']}: cpshard {_calls(r['calls_cp'])} ({r['sent_cp']} bytes); "
                  f"megatron {_calls(r['calls_mg'])} ({r['sent_mg']} bytes)")
    print("\ncorrectness (all ranks): shift_sharded == shard(x, shift=1); Megatron == cpshard on every token row "
          "with p <= n-2; Megatron == roll of the padded sequences (0 past the padded end); Megatron == cpshard "
          "on every row with fill = pad_value = 0: OK")
    for i, b in enumerate(args.batches):
        rs = [every[r][i] for r in range(WORLD)]
        tot = {k: sum(r[k] for r in rs) for k in ("agree_rows", "last_rows", "pad_rows", "diff_last", "diff_pad")}
        print(f"  B={b}: {tot['agree_rows']} rows compared equal; with fill={FILL}, pad_value={PAD}: "
              f"{tot['diff_last']}/{tot['last_rows']} last-token rows and {tot['diff_pad']}/{tot['pad_rows']} "
              f"pad rows differ (expected: Megatron writes the next pad row's content / 0 there)")
    print("\ncontiguous layout (DeepSeek-V4's dsv4_hybrid), same batches: shift_sharded == shard(x, shift=1) on "
          "every rank: OK. Megatron's packed roll (which assumes zigzag) on token rows p <= n-2:")
    for i, b in enumerate(args.batches):
        rs = [every[r][i] for r in range(WORLD)]
        errors = sorted({r["contig_error"] for r in rs if r["contig_error"]})
        print(f"  B={b}: {sum(r['contig_wrong'] for r in rs)}/{sum(r['contig_rows'] for r in rs)} labels wrong"
              + (f" ({'; '.join(errors)})" if errors else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sweep_args(parser, warmup=3, min_len=64, max_len=1024)
    parser.add_argument("--cold-repeats", type=int, default=None)
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 5 if args.quick else 30
    if args.cold_repeats is None:
        args.cold_repeats = 3 if args.quick else 10
    if args.quick:
        args.warmup = min(args.warmup, 1)
    t0 = time.perf_counter()
    _report(run_ranks(_ranks, WORLD, args, timeout=3600, collective_timeout=600), args)
    print(f"\n(total wall time {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
