"""Benchmark: cpshard's verl drop-ins against verl 0.9.1's own functions, side by side in one process.

Needs verl and megatron-core (``scripts/setup.sh`` installs both). Megatron's parallel state is
faked (``tp``, ``cp``, rank 1), and verl's contiguous path is given a ``PackedSeqParams`` with
``cp_partition_mode`` (no megatron-core release has it yet). Run::

    .venv/bin/python benchmarks/verl.py            # 256 sequences, lengths U[128, 8192], cp=4, tp=2
    .venv/bin/python benchmarks/verl.py --quick    # 32 sequences up to 1024: a smoke run

Each case times one rank's call (median of ``--repeats`` after a warm-up). cpshard's drop-in is timed
as verl calls it, building its plan inside every call (what a trainer pays per micro-batch), and
again with ``plan=`` (a plan shared by the step). The restore (``postprocess_*``) needs every rank's
output: verl's all-gather is replaced by a copy of the other ranks' outputs, and cpshard's by
``cpshard.unshard`` (the same rows without communication), so both time their index work plus one
copy of the gathered rows. Each row also checks that the two results agree on every real token.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

# This file is named verl.py: keep its folder off the path so that `import verl` finds the package;
# the fakes of Megatron's parallel state are the tests' (tests/verl_fakes.py).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "tests"))
sys.path.append(_HERE)  # last: `import verl` finds the package, `import _timing` this folder's helper
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _timing import add_batch_args, batch_lengths, interleaved_ms, median_ms  # noqa: E402

import verl_fakes as vf  # noqa: E402
from cpshard import ShardPlan, shard
from cpshard.compat import verl as cv
from cpshard.distributed.header import HEADER_BYTES

vutil = vf.vutil


@contextlib.contextmanager
def _megatron(tp: int, cp: int, rank: int, others: list[torch.Tensor] | None = None) -> Iterator[None]:
    """Megatron's getters answer (tp, cp, rank); a one-process torch.distributed whose all-gathers
    copy ``others`` (every rank's output) into place, for verl's and cpshard's restore alike."""
    def sent(r: int, inp: torch.Tensor) -> torch.Tensor:
        """What rank ``r`` hands the all-gather: cpshard leads its rows with the call's header (this
        rank's, with ``r``'s rank word: Note [Call headers] in ``distributed/header.py``)."""
        assert others is not None
        body = others[r].contiguous().reshape(-1)
        if inp.dtype != torch.uint8 or inp.numel() != body.numel() * body.element_size() + HEADER_BYTES:
            return others[r]
        head = inp[:HEADER_BYTES].clone()
        head.view(torch.int64)[2] = r
        return torch.cat([head, body.view(torch.uint8)])

    def all_gather(out: list[torch.Tensor], inp: torch.Tensor, group: Any = None) -> None:
        for r, t in enumerate(out):
            src = (inp if r == rank or others is None else sent(r, inp)).contiguous().reshape(-1)
            if src.dtype != t.dtype:  # cpshard moves rows as bytes
                src = src.view(torch.uint8).view(t.dtype)
            t.copy_(src.view(t.shape))

    def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
        all_gather(list(out.view(cp, *inp.shape).unbind(0)), inp)

    with vf.parallel_state(tp, cp, rank, group=vf.FakeGroup(cp, rank)), vf.partition_mode(), \
            vf.swap(torch.distributed, {"all_gather": all_gather, "all_gather_single": all_gather_single,
                                        "all_gather_into_tensor": all_gather_single, "is_initialized": lambda: True,
                                        "get_world_size": lambda group=None: cp,
                                        "get_rank": lambda group=None: rank}):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_args(parser)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="32 sequences up to 1024 tokens, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.seqs, args.max_len, args.repeats = 32, 1024, 3
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    lens = batch_lengths(args, g)
    ids = torch.nested.nested_tensor([torch.randint(1, 150_000, (n,), generator=g) for n in lens],
                                     layout=torch.jagged)
    cp, tp, rank = args.cp, args.tp, 1 % args.cp
    mine = dict(tp_size=tp, cp_size=cp, cp_rank=rank)
    print(f"verl 0.9.1 vs cpshard.compat.verl: {args.seqs} sequences, lengths U[{args.min_len}, {args.max_len}] "
          f"({sum(lens)} tokens), cp={cp}, tp={tp}, rank {rank}; median of {args.repeats} (ms), "
          f"{args.threads} thread(s)")
    print(f"{'case':42} {'verl':>10} {'cpshard':>10} {'plan=':>10} {'verl/cpshard':>13} {'same':>5}")

    def row(name: str, verl_fn: Callable[[], Any], ours_fn: Callable[[], Any], shared_fn: Callable[[], Any],
            same: Callable[[Any, Any], bool], others: list[torch.Tensor] | None = None) -> None:
        with _megatron(tp, cp, rank, others):
            t_verl = median_ms(verl_fn, args.repeats)
            t_ours = median_ms(ours_fn, args.repeats)
            t_shared = median_ms(shared_fn, args.repeats)
            ok = same(verl_fn(), ours_fn())
        print(f"{name:42} {t_verl:10.2f} {t_ours:10.2f} {t_shared:10.2f} {t_verl / t_ours:12.1f}x {str(ok):>5}")

    # one step: tokens, next-token labels and the loss mask for one rank, a fresh plan per step
    values = ids.values()
    mask = torch.nested.nested_tensor_from_jagged(torch.ones(values.shape[0], dtype=torch.bool), ids.offsets())
    for layout in ("zigzag", "contiguous"):
        plan = cv.thd_plan(ids, cp_layout=layout, tp_size=tp, cp_size=cp)
        index = plan.global_rows(rank).clamp(max=values.shape[0] - 1)

        def floor() -> None:
            values.index_select(0, index), values.index_select(0, index), mask.values().index_select(0, index)

        def verl_step(layout: str = layout) -> None:
            for x, roll in ((ids, False), (ids, True), (mask, True)):
                vutil.preprocess_thd_engine(x, need_roll=roll, cp_layout=layout)

        def ours_step(layout: str = layout) -> None:
            p = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout)
            shard(values, p, rank), shard(values, p, rank, shift=1, fill=-100)
            shard(mask.values(), p, rank, shift=1, fill=False)

        with _megatron(tp, cp, rank):
            t_floor, t_ours = interleaved_ms([floor, ours_step], 4 * args.repeats)  # fair to each other
            t_verl = median_ms(verl_step, args.repeats)
        print(f"{'step (3 tensors, fresh plan) ' + layout:42} {t_verl:10.2f} {t_ours:10.2f} {'':>10} "
              f"{t_verl / t_ours:12.1f}x  floor {t_floor:.2f} ms: cpshard {t_ours / t_floor:.2f}x the floor")

    for layout in ("zigzag", "contiguous"):
        plan = cv.thd_plan(ids, cp_layout=layout, tp_size=tp, cp_size=cp)
        tokens = plan.token_mask(rank)
        for roll in (False, True):
            keep = tokens & (plan.position_ids(rank) + 1 < torch.tensor(lens)[plan.sequence_ids(rank)]) \
                if roll else tokens
            row(f"preprocess_thd_engine {layout}{' need_roll' if roll else ''}",
                lambda: vutil.preprocess_thd_engine(ids, need_roll=roll, cp_layout=layout),
                lambda: cv.preprocess_thd_engine(ids, need_roll=roll, cp_layout=layout, **mine),
                lambda: cv.preprocess_thd_engine(ids, need_roll=roll, cp_layout=layout, plan=plan, **mine),
                lambda a, b: torch.equal(a[0][0][keep], b[0][0][keep]))
        # the restore: every rank's log-probs (float32), gathered and split per sequence. cpshard's
        # drop-in re-derives the plan from a PackedSeqParams that does not carry it (the cold path)
        others = [torch.randn(1, plan.local_len, generator=g) for _ in range(cp)]
        local = others[rank]
        with _megatron(tp, cp, rank):
            psp = cv.preprocess_thd_engine(ids, cp_layout=layout, pre_process=False, plan=plan, **mine)[1]
        bare = vf.PackedSeqParamsWithMode(qkv_format="thd", cu_seqlens_q_padded=psp.cu_seqlens_q_padded,
                                        cp_partition_mode=layout)
        row(f"postprocess_thd_engine {layout}",
            lambda: vutil.postprocess_thd_engine(local, psp, ids, len(lens), cp_layout=layout),
            lambda: cv.postprocess_thd_engine(local, bare, ids, len(lens), cp_layout=layout, **mine),
            lambda: cv.postprocess_thd_engine(local, psp, ids, len(lens), cp_layout=layout, plan=plan, **mine),
            lambda a, b: torch.equal(a.values(), b.values()), others)

    bplan = cv.bshd_plan(ids, tp_size=tp, cp_size=cp)
    cols = bplan.columns(rank).unsqueeze(0)
    for roll in (False, True):
        keep = cols + 1 < torch.tensor(lens).unsqueeze(1) if roll else cols < torch.tensor(lens).unsqueeze(1)
        row(f"preprocess_bshd_engine{' need_roll' if roll else ''}",
            lambda: vutil.preprocess_bshd_engine(ids, need_roll=roll),
            lambda: cv.preprocess_bshd_engine(ids, need_roll=roll, **mine),
            lambda: cv.preprocess_bshd_engine(ids, need_roll=roll, plan=bplan, **mine),
            lambda a, b: torch.equal(a[0][keep], b[0][keep]))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
