"""The test suite's gloo ranks, forked from a server instead of spawned (tests/conftest.py makes it what
``cpshard.spawn.run_ranks`` starts ranks with, through ``cpshard.spawn.set_default_context``).

A rank that ``run_ranks`` starts with ``spawn`` (its default) is a fresh interpreter that imports torch
and ``cpshard.spawn`` before its function runs: about 5 s of CPU each, so 8 ranks on 2 cores take 40 s
to start. Here a fork server that imported them once forks each rank instead: still a process of its
own, with its own gloo group and port and nothing of the test process's state, ready in a fraction of a
second. As a spawned rank does, it writes to the stdout and stderr the caller had when it started (where
pytest's ``capfd`` reads them), not to the server's.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

# What the server imports once, before it forks any rank: what cpshard.spawn's worker needs, what the rank
# bodies' modules import, and torch's compiler, which megatron-core's import pulls in (1.4 of its 2 s)
PRELOAD = ["torch", "torch.distributed", "cpshard", "cpshard.spawn", "cpshard.distributed", "pytest", "hypothesis",
           "torch._inductor.compile_fx", __name__]


class _Fd:
    """One of the caller's file descriptors, handed to the rank as it starts (the server passes it on)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _received, (reduction.DupFd(self.fd),)


def _received(dup: Any) -> int:
    return int(dup.detach())


def _with_callers_stdio(stdout: int, stderr: int, target: Callable[..., Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> None:
    for fd, into in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, into)
        os.close(fd)
    target(*args, **kwargs)


class ForkServer:
    """What ``cpshard.spawn`` uses of a multiprocessing context (``Queue``, ``Process``: what
    ``set_default_context`` accepts), from the ``forkserver`` context with ``PRELOAD`` imported; the
    server starts at the first rank. ``before_start()`` runs before each rank's process is made (it may
    refuse it by raising)."""

    def __init__(self, before_start: Callable[[], None] = lambda: None) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)
        self._before_start = before_start

    def get_start_method(self) -> str:
        return "forkserver"

    def Queue(self) -> Any:  # noqa: N802 - multiprocessing's names
        return self._ctx.Queue()

    def Process(self, target: Callable[..., Any], args: tuple[Any, ...] = (),  # noqa: N802
                kwargs: dict[str, Any] | None = None, **options: Any) -> Any:
        self._before_start()
        return self._ctx.Process(target=_with_callers_stdio, args=(_Fd(1), _Fd(2), target, args, kwargs or {}),
                                 **options)
