"""Benchmark: cpshard's ``process_mtp_loss`` drop-in vs megatron-core's (packed THD, zigzag CP, 4 gloo ranks).

Run (CPU, gloo, 4 ranks on 127.0.0.1; needs megatron-core 0.19.2, see ``cpshard/megatron/_import.py``)::

    .venv/bin/python benchmarks/mtp.py            # N = 1 and 3 depths, batches of 8 / 64 / 256 sequences
    .venv/bin/python benchmarks/mtp.py --quick    # fewer repeats

Both sides get the same call (megatron-core 0.19's signature): hidden states ``[(1 + N) L, 1, h]``,
labels and a random 0/1 loss mask ``[1, L]`` sharded by cpshard's zigzag plan, ``packed_seq_params``
with the plan's padded ``cu_seqlens``, a linear output layer and per-token cross entropy, float64,
``calculate_per_token_loss=False``. Per call: forward and backward (``(out * 0).sum().backward()``,
so only the MTP gradients flow), time = max over ranks after a barrier, median over repeats.

"collectives" counts torch.distributed calls per call on the busiest rank (Megatron's packed roll
posts up to four ``isend``/``irecv`` per sequence, per depth, per tensor; cpshard one
``all_to_all_single`` for the labels and mask of every depth and one ``all_reduce`` of the counts).

"loss diff" and "grad diff" compare with the same batch at ``cp = 1`` (computed on every rank with
no group; at ``cp = 1`` both implementations are equal): the objective each implementation
back-propagates (the sum of what it hands ``MTPLossAutoScaler``, averaged over the CP ranks as DP x
CP gradient averaging does) and the output weight's gradient averaged over the ranks, as relative
max differences. Megatron's differ because its token counts are local to each rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from _timing import add_sweep_args
from cpshard.spawn import CollectiveCounter, run_ranks

WORLD = 4
VOCAB, HID = 32, 8


def _batch(num_seqs: int, n: int, seed: int, lo: int, hi: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed * 1000 + num_seqs)
    lens = torch.randint(lo, hi + 1, (num_seqs,), generator=g).tolist()
    tokens = sum(lens)
    return {
        "lens": lens,
        "labels": list(torch.randint(0, VOCAB, (tokens,), generator=g).split(lens)),
        "mask": list((torch.rand(tokens, generator=g) < 0.7).double().split(lens)),
        "hidden": [list(torch.randn(tokens, HID, generator=g, dtype=torch.float64).split(lens)) for _ in range(n + 1)],
        "weight": torch.randn(VOCAB, HID, generator=g, dtype=torch.float64),
    }


class _Recorder:
    """Wraps MTPLossAutoScaler.apply to record the objective each implementation back-propagates."""

    def __init__(self, scaler: Any) -> None:
        self.scaler, self.total = scaler, torch.zeros((), dtype=torch.float64)

    def __enter__(self) -> _Recorder:
        self.saved = self.scaler.apply

        def apply(hidden: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
            self.total = self.total + loss.detach().sum()
            return self.saved(hidden, loss)
        self.scaler.apply = apply
        return self

    def __exit__(self, *exc: object) -> None:
        self.scaler.apply = self.saved


def _call(fn: Any, plan: Any, rank: int, group: Any, data: dict[str, Any], n: int, psp_cls: Any) -> tuple[Any, Any]:
    from cpshard import shard

    cu = plan.cu_seqlens_padded
    psp = psp_cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                  cu_seqlens_kv_padded=cu, max_seqlen_q=plan.max_seqlen, max_seqlen_kv=plan.max_seqlen)
    hidden = torch.cat([shard(h, plan, rank, pad_value=0) for h in data["hidden"]]).unsqueeze(1).requires_grad_()
    w = torch.nn.Parameter(data["weight"].clone())

    def output_layer(x: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None) -> tuple[Any, None]:
        return x @ (w if weight is None else weight).T, None

    def lm_loss(lab: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.transpose(0, 1).reshape(-1, VOCAB), lab.reshape(-1),
                               reduction="none").view(lab.shape)

    config = SimpleNamespace(mtp_num_layers=n, mtp_loss_scaling_factor=0.1, calculate_per_token_loss=False,
                             mtp_detach_heads=False)
    labels = shard(data["labels"], plan, rank, pad_value=0).view(1, -1)
    mask = shard(data["mask"], plan, rank, pad_value=0).view(1, -1)
    out = fn(hidden, labels, mask, output_layer, w, None, False, lm_loss, config, cp_group=group,
             packed_seq_params=psp)
    (out * 0).sum().backward()
    return w.grad, hidden.grad


def _worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from cpshard import ShardPlan
    from cpshard.megatron import import_megatron, process_mtp_loss

    mod = import_megatron("transformer.multi_token_prediction")
    psp_cls = import_megatron("packed_seq_params").PackedSeqParams
    group = dist.new_group(list(range(world)))
    impls = {"cpshard": process_mtp_loss, "megatron": mod.process_mtp_loss}
    rows = []
    for n in args.depths:
        for b in args.batches:
            data = _batch(b, n, args.seed, args.min_len, args.max_len)
            plan1 = ShardPlan.build(data["lens"], cp_size=1)
            with _Recorder(mod.MTPLossAutoScaler) as rec:
                ref_w, _ = _call(process_mtp_loss, plan1, 0, None, data, n, psp_cls)
            ref_obj = rec.total
            plan = ShardPlan.build(data["lens"], cp_size=world, layout="zigzag")
            for name, fn in impls.items():
                with _Recorder(mod.MTPLossAutoScaler) as rec:
                    wgrad, _ = _call(fn, plan, rank, group, data, n, psp_cls)
                obj = rec.total.clone()
                dist.all_reduce(obj, group=group)
                dist.all_reduce(wgrad, group=group)
                obj, wgrad = obj / world, wgrad / world
                dist.barrier(group=group)
                with CollectiveCounter() as counter:
                    _call(fn, plan, rank, group, data, n, psp_cls)
                times = []
                for i in range(args.warmup + args.repeats):
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    _call(fn, plan, rank, group, data, n, psp_cls)
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t0)
                rows.append({
                    "n": n, "b": b, "impl": name, "tokens": plan.num_tokens, "times": times,
                    "calls": len(counter.calls),
                    "loss_diff": float((obj - ref_obj).abs() / ref_obj.abs().clamp(min=1e-300)),
                    "grad_diff": float((wgrad - ref_w).abs().max() / ref_w.abs().max().clamp(min=1e-300)),
                })
    return rows


def _report(per_rank: list[list[dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"\nprocess_mtp_loss: cpshard drop-in vs megatron-core {_version()} (packed THD, zigzag, "
          f"{WORLD} gloo ranks, float64, hidden {HID}, vocab {VOCAB}, seqlens ~ U[{args.min_len}, {args.max_len}], "
          f"random 0/1 loss mask, forward + backward, median of {args.repeats} (max over ranks), torch "
          f"{torch.__version__})\n")
    head = ("N", "seqs", "tokens", "impl", "ms/call", "collectives/call", "loss diff vs cp=1", "grad diff vs cp=1")
    table = []
    for i, row in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        per_call = [max(ts) for ts in zip(*(r["times"] for r in ranks))]
        table.append((row["n"], row["b"], row["tokens"], row["impl"], f"{statistics.median(per_call) * 1e3:.1f}",
                      max(r["calls"] for r in ranks),
                      f"{row['loss_diff']:.1e}", f"{row['grad_diff']:.1e}"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    fmt = "| " + " | ".join(f"{{:>{w}}}" for w in widths) + " |"
    print(fmt.format(*head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in table:
        print(fmt.format(*row))
    print("\ncollectives/call: c10d calls on the busiest rank (cpshard.spawn.CollectiveCounter; Megatron's are "
          "send/recv). diffs: relative to cp = 1 (the objective; the weight gradient "
          "averaged over CP)")


def _version() -> str:
    from cpshard.megatron import megatron_version
    return str(megatron_version())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sweep_args(parser, warmup=1, min_len=8, max_len=200)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 3 if args.quick else 10
    t0 = time.perf_counter()
    per_rank = run_ranks(_worker, WORLD, args, timeout=3600, collective_timeout=600)
    _report(per_rank, args)
    print(f"\n(total wall time {time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
