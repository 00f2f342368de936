"""Run a function on ``world_size`` real gloo processes on 127.0.0.1 and collect what each returns.

The harness cpshard's own multi-process tests use, public so that tests of code built on cpshard
(and tools such as a CPU end-to-end check) can run real ``torch.distributed`` ranks the same way.

``run_ranks(fn, world_size, *args)`` spawns fresh interpreters (``spawn``: no inherited state),
initializes the default gloo group on a free port, calls ``fn(rank, world_size, *args)`` on each,
and returns the ranks' results in rank order. The first traceback from any rank is re-raised in the
caller (with the rank named); a run that outlives ``timeout`` seconds is killed and raises
``TimeoutError`` instead of hanging the suite. No process is left behind either way.

``fn`` and its arguments must be picklable: define ``fn`` at module level in an importable module.

Example::

    def body(rank, world_size):
        import torch, torch.distributed as dist
        t = torch.tensor([rank])
        dist.all_reduce(t)
        return int(t)

    assert run_ranks(body, 3) == [3, 3, 3]
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks"]

_CTX = mp.get_context("spawn")


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            results: Any, collective_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              collective_timeout: float = 60.0) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each in its own process."""
    results = _CTX.Queue()
    port = free_port()
    procs = [_CTX.Process(target=_worker, args=(r, world_size, port, fn, args, results, collective_timeout),
                          daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                       "without reporting") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [out[r] for r in range(world_size)]
