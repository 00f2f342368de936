"""Benchmark: ``cpshard.spawn.CollectiveCounter`` (a plain dispatch mode) against the counter it replaced.

The baseline is the previous ``CollectiveCounter``: a subclass of PyTorch's ``CommDebugMode``
(``torch.distributed.tensor.debug``) recording the same names and bytes (``CollectiveCounter._record``)
before handing each operation to ``CommDebugMode``. Both count the same calls; what differs is the cost:

- import: what a fresh rank pays to start counting, in fresh interpreters that have imported torch and
  ``torch.distributed`` already (median over ``--imports`` runs each): the counter's import and its first
  counted operation (``CommDebugMode`` imports the DTensor stack, and any dispatch mode that torch hides
  from torch.compile imports ``torch._dynamo`` at its first operation);
- per op: microseconds per small tensor operation (``x.add(1)``, 4 floats) and per forward + backward of
  a linear layer and a ReLU (7 operations), outside any counter and inside each. No ``nn.Module`` is
  timed: ``CommDebugMode``'s module tracker (torch 2.13) raises ``IndexError`` at a module's second
  forward inside one block, the new counter does not look at modules;
- per collective: an ``all_reduce`` of 4 floats on a one-rank gloo group (127.0.0.1), inside each.

The new counter is timed twice in the main process: before the baseline is imported (as a rank that
never loads ``torch._dynamo`` runs it) and after (then it is the variant hidden from torch.compile).
Run::

    .venv/bin/python benchmarks/collective_counter.py            # 5 fresh interpreters per import
    .venv/bin/python benchmarks/collective_counter.py --quick    # a smoke run

"overhead" is the time inside a counter less the time outside any; the ratios are baseline / new.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from cpshard.spawn import CollectiveCounter, free_port


def baseline_counter() -> type:
    """The previous ``CollectiveCounter``: ``CommDebugMode`` plus the same names and bytes."""
    from torch.distributed.tensor.debug import CommDebugMode

    class CommDebugCounter(CommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []
            self.bytes = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.namespace == "c10d":
                CollectiveCounter._record(self, func, args, kwargs or {})  # type: ignore[arg-type]
            return super().__torch_dispatch__(func, types, args, kwargs)

    return CommDebugCounter


def _child(which: str) -> None:
    """In a fresh interpreter: seconds to import the counter and count a first operation."""
    import torch.distributed  # noqa: F401 - what a rank has imported before it counts anything

    t = time.perf_counter()
    if which == "new":
        from cpshard.spawn import CollectiveCounter as counter
    else:
        counter = baseline_counter()
    with counter():
        torch.ones(4).add(1)
    print(time.perf_counter() - t)


def import_seconds(which: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, __file__, "--child", which], capture_output=True, text=True,
                             check=True).stdout
        times.append(float(out.split()[-1]))
    return statistics.median(times)


def per_call_us(fn: Callable[[], Any], calls: int, inside: Callable[[], Any] | None = None) -> float:
    """Median over 5 rounds of the time per ``fn()`` in microseconds, each round ``calls`` calls inside
    a fresh ``inside()`` context (outside any when ``None``)."""
    rounds = []
    for _ in range(5):
        mode = inside() if inside is not None else None
        if mode is not None:
            mode.__enter__()
        try:
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            rounds.append((time.perf_counter() - t) / calls * 1e6)
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 fresh interpreter per import, fewer calls")
    parser.add_argument("--imports", type=int, default=5, help="fresh interpreters per import (median)")
    parser.add_argument("--child", choices=["new", "baseline"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    torch.set_num_threads(1)
    runs = 1 if args.quick else args.imports
    calls = 200 if args.quick else 2000
    imports = {w: import_seconds(w, runs) for w in ("new", "baseline")}

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        x = torch.ones(4)
        weight, batch = torch.randn(8, 8, requires_grad=True), torch.randn(4, 8)
        work = {"tensor op": (lambda: x.add(1), calls),
                "linear fwd+bwd": (lambda: torch.nn.functional.linear(batch, weight).relu().sum().backward(),
                                   calls // 10),
                "all_reduce": (lambda: dist.all_reduce(x), calls // 10)}
        plain = {k: per_call_us(fn, n) for k, (fn, n) in work.items()}
        new_first = {k: per_call_us(fn, n, CollectiveCounter) for k, (fn, n) in work.items()}
        baseline = baseline_counter()
        old = {k: per_call_us(fn, n, baseline) for k, (fn, n) in work.items()}
        new_after = {k: per_call_us(fn, n, CollectiveCounter) for k, (fn, n) in work.items()}
        for counter in (CollectiveCounter, baseline):
            with counter() as c:
                dist.all_reduce(x)
                dist.barrier()
                x.add(1)
            assert (c.calls, c.bytes) == (["allreduce"], 16), (counter, c.calls, c.bytes)
    finally:
        dist.destroy_process_group()

    print(f"torch {torch.__version__}, {os.cpu_count()} cores, one thread; the counters record the same calls")
    print(f"import + first counted op, fresh interpreter (median of {runs}): new {imports['new'] * 1e3:.0f} ms, "
          f"baseline {imports['baseline'] * 1e3:.0f} ms, baseline/new {imports['baseline'] / imports['new']:.1f}x")
    head = (f"{'per op':16} {'no counter':>11} {'new':>9} {'new*':>9} {'baseline':>9} {'overhead new':>13} "
            f"{'baseline':>9} {'baseline/new':>13}")
    print(head + "\n" + "-" * len(head))
    for k in work:
        over_new, over_old = new_first[k] - plain[k], old[k] - plain[k]
        ratio = over_old / over_new if over_new > 0 else float("inf")
        print(f"{k:16} {plain[k]:9.1f}us {new_first[k]:7.1f}us {new_after[k]:7.1f}us {old[k]:7.1f}us "
              f"{over_new:11.1f}us {over_old:7.1f}us {ratio:12.1f}x")
    print("new* = the new counter once torch._dynamo is loaded (its variant hidden from torch.compile)")


if __name__ == "__main__":
    main()
