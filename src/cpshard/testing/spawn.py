"""Run a function on ``world_size`` real gloo processes on 127.0.0.1 and collect what each returns.

The harness cpshard's own multi-process tests use, public so that tests of code built on cpshard
(and tools such as a CPU end-to-end check) can run real ``torch.distributed`` ranks the same way.

``run_ranks(fn, world_size, *args)`` spawns fresh interpreters (``spawn``: no inherited state),
initializes the default gloo group on a free port, calls ``fn(rank, world_size, *args)`` on each,
and returns the ranks' results in rank order. The first traceback from any rank is re-raised in the
caller (with the rank named); a run that outlives ``timeout`` seconds is killed and raises
``TimeoutError`` instead of hanging the suite. No process is left behind either way.
``start_method=`` picks another of ``torch.multiprocessing``'s start methods for one call;
``set_default_context`` changes the default for every call, cpshard's own included (a test suite
that forks its ranks from a server, as cpshard's does).

``fn`` and its arguments must be picklable: define ``fn`` at module level in an importable module. A
script calls ``run_ranks`` under ``if __name__ == "__main__":``: ``spawn`` imports the script again in
every rank, and an unguarded call is refused before any process starts, naming the line; so is a
function defined under that block, which the ranks' import of the script never defines.

When ranks fail, every rank's report is awaited a short while, and the error names the rank whose
own error is the cause: a rank's own exception before a peer's summary of it (the agreement of
``check=True`` raises "ranks [1] ... rejected their input" on the others) and before a peer's
"connection closed". A rank whose process ends without a report (killed, or ``os._exit()``) is
named, with its exit code, as soon as it is gone.

``CollectiveCounter`` records, inside a rank, the c10d collectives a block issues (names in call
order, bytes sent) with a plain dispatch mode: it costs one Python call per tensor operation in the
block, and importing this module does not import ``torch.distributed.tensor``.

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
import functools
import os
import pickle
import queue
import re
import socket
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveCounter", "free_port", "run_ranks", "set_default_context"]

_default_context: Any = mp.get_context("spawn")  # what run_ranks starts ranks with (set_default_context)

# What a rank reports when a peer died first: not the root cause, so reported only if nothing else is.
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Connection refused|ECONNRESET|"
                        r"gloo/transport|Socket Timeout|DistNetworkError", re.IGNORECASE)
# What a rank reports when a peer refused its input in an agreement: that peer's own error is the cause.
_PEER_SUMMARY = re.compile(r"rejected (their|its) input \((their errors say|its own error says) why")
# How long, after the first failure, the other ranks' reports are awaited (each usually comes within
# milliseconds: ranks that meet in one agreement raise together); longer while only summaries are in.
_SETTLE_S = 3.0
_SETTLE_FOR_OWN_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for ``init_method="tcp://..."``)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CollectiveCounter(TorchDispatchMode):
    """Records the c10d collectives issued inside the ``with`` block: ``calls``, their names in call
    order, and ``bytes``, what this rank handed the backend to send.

    Every ``torch.distributed`` collective and point-to-point call (gloo's, NCCL's, any backend's)
    reaches the dispatcher as a ``c10d::`` operator, so a dispatch mode sees it whoever issued it; a
    name here is that operator's without the namespace and underscores (``all_gather_into_tensor`` is
    ``"allgather_base"``, ``all_gather`` ``"allgather"``, ``all_to_all_single`` ``"alltoall_base"``,
    ``send`` / ``isend`` ``"send"``, ``recv`` / ``irecv`` ``"recv"``). Barriers are not recorded, nor is
    any operator outside c10d's. ``bytes`` sums the tensors each call hands the backend to send from
    this rank: the input of an all-gather, gather, reduce-scatter or all-to-all, the tensors of an
    all-reduce, reduce or ``send``, a broadcast's or a scatter's on its root only, nothing for a ``recv``.

    Example (inside a rank)::

        with CollectiveCounter() as comm:
            gather(local, plan, group)
        assert comm.calls == ["allgather_base"]

    A plain ``TorchDispatchMode``: it looks at nothing but each operation's namespace until a c10d one
    comes, and neither it nor this module imports the DTensor stack or ``torch._dynamo``. Against the
    ``CommDebugMode`` subclass it replaces (``benchmarks/collective_counter.py``, 2 CPU cores), a
    fresh rank's import and first counted operation take milliseconds instead of about two seconds,
    and a tensor operation's overhead in the block is about a third (20 us instead of 54); modules
    run in the block as often as they like (``CommDebugMode``'s module tracker raised ``IndexError``
    at a module's second forward in one block).
    """

    supports_higher_order_operators = True  # passed through like any operator that is not c10d's
    _hidden_from_compile = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable (so that torch.compile never
        # traces it), which imports torch._dynamo, and with it torch.distributed.tensor, at the first
        # operation: two seconds. Only the class made when torch._dynamo is loaded already gets that
        # wrapper (__new__); before it is loaded nothing can be compiling.
        return cls._hidden_from_compile

    def __new__(cls, *args: Any, **kwargs: Any) -> CollectiveCounter:
        if cls is CollectiveCounter and "torch._dynamo" in sys.modules:
            cls = _compile_safe_counter()
        return super().__new__(cls)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if any(t is not torch.Tensor for t in types):
            return NotImplemented  # a tensor subclass (DTensor) runs first; its c10d calls come back here
        if func.namespace == "c10d":
            self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen = _collective(func, args, kwargs)
        if seen is not None:
            self.calls.append(seen[0])
            self.bytes += seen[1]


@functools.cache
def _compile_safe_counter() -> type[CollectiveCounter]:
    """``CollectiveCounter`` with torch's default for modes: ``__torch_dispatch__`` hidden from torch.compile."""

    class CompileSafeCollectiveCounter(CollectiveCounter):
        _hidden_from_compile = True
        __torch_dispatch__ = CollectiveCounter.__torch_dispatch__  # wrapped by TorchDispatchMode.__init_subclass__

    return CompileSafeCollectiveCounter


# c10d operators that move no data between ranks' tensors, or only to synchronize
_NOT_COUNTED = {"barrier", "monitored_barrier", "check_for_nan"}


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an operator argument: a tensor, a list of them or a list of such lists."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _rank_in(group: Any) -> int:
    """This rank's rank in a c10d operator's process group (the dispatcher hands it over boxed)."""
    import torch.distributed as dist
    if not isinstance(group, dist.ProcessGroup):
        group = dist.ProcessGroup.unbox(group)
    return int(group.rank())


@functools.cache
def _parameters(func: Any) -> tuple[str, ...]:
    return tuple(a.name for a in func._schema.arguments)


def _collective(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[str, int] | None:
    """``(name, bytes sent by this rank)`` for a ``c10d::`` operator call; ``None`` for one not counted."""
    name = func._schema.name[len("c10d::"):].strip("_")
    if name in _NOT_COUNTED:
        return None
    params = _parameters(func)
    given = dict(zip(params, args)) | kwargs
    if name.startswith("recv"):
        return name, 0
    if name == "broadcast" and given["root_rank"] != _rank_in(given["process_group"]):
        return name, 0  # the others hand the backend a buffer to fill
    # what is sent: the input of (output, input, ...) operators, else the tensors (all-reduce, send, ...)
    sent = next((given[p] for p in params if p.startswith("input")), given.get("tensors"))
    return name, sum(t.numel() * t.element_size() for t in _tensors(sent))


def _portable(value: Any) -> Any:
    """``value`` with every tensor detached and on the CPU (what can leave a process)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_portable(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        return {k: _portable(v) for k, v in value.items()}
    return value


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class _ResultPickler(pickle.Pickler):
    """Pickles a strided tensor as its bytes, dtype and shape, rebuilt by this module alone.

    torch pickles a tensor's storage through ``torch.storage._load_from_bytes``, by reference; a
    library the rank imported may have replaced that function (megatron-core does, with its own in
    ``megatron.core.safe_globals``), and the parent would then have to import that library to read
    the result (on a CPU machine Megatron's import needs Triton). Bytes need nothing."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.layout is torch.strided and not obj.is_quantized:
            flat = obj.resolve_conj().resolve_neg().contiguous().reshape(-1)
            return _tensor_from_bytes, (flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"",
                                        obj.dtype, tuple(obj.shape))
        return NotImplemented


def _dumps(value: Any) -> bytes:
    import io
    buffer = io.BytesIO()
    _ResultPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def world_group() -> Any:
    """The group of every rank a launcher started (``torch.distributed.group.WORLD``): the CP group of
    a job that is one CP group, as :func:`run_ranks`' functions and ``cpshard verify`` run."""
    import torch.distributed as dist
    return dist.group.WORLD


@contextlib.contextmanager
def joined_group(backend: str,
                 timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> Iterator[tuple[int, Any]]:
    """Join the process group a launcher (``torchrun``) describes in the environment, and leave it on
    exit: ``(rank, the world group)``. For the CLI's ``verify`` under torchrun; a process started by
    :func:`run_ranks` has joined its group already."""
    import torch.distributed as dist
    dist.init_process_group(backend, init_method="env://", timeout=timeout)
    try:
        yield dist.get_rank(), dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            results: Any, collective_timeout: float) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        # gloo's init can return on one rank while a peer is still connecting to it: a rank whose fn makes
        # no collective would then exit and close the connection under that peer ("Connection closed by
        # peer" in connectFullMesh, seen under load). One barrier holds every rank until all are connected.
        dist.barrier()
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        try:  # pickle here, so that an unpicklable result is reported, not lost in the queue's thread
            payload = _dumps(_portable(value))
        except Exception as exc:  # noqa: BLE001 - any pickling failure is reported the same way
            results.put((rank, False, time.time(), f"rank {rank} returned a value that cannot leave its process "
                         f"({type(value).__name__}): {exc!r}. Fix: return tensors, numbers, strings or "
                         "containers of them."))
            return
        results.put((rank, True, time.time(), payload))
    except BaseException:  # report everything, KeyboardInterrupt included
        results.put((rank, False, time.time(), traceback.format_exc()))


def _tier(text: str) -> int:
    """How near a rank's report is to the root cause: 0 its own error (or its death without a report), 1 a
    summary of a peer's refusal (the agreement's "ranks [1] ... rejected their input"), 2 a peer's
    disappearance ("connection closed")."""
    if _PEER_SUMMARY.search(text):
        return 1
    return 2 if _PEER_GONE.search(text) else 0


def _root_cause(failures: dict[int, tuple[float, str]]) -> int:
    """The failing rank to report: the first whose error is its own, then the first that only reports a
    peer's refusal, then the first that only saw a peer go. Reports arrive in any order (the ranks that
    meet in one agreement raise at once), so the kind decides, and the time only within a kind."""
    return min(failures, key=lambda r: (_tier(failures[r][1]), failures[r][0], r))


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else "(no message)"
    return line if len(line) <= 300 else line[:280] + " ..."


def _start_context(start_method: str) -> Any:
    """The ``torch.multiprocessing`` context of ``start_method``, or a ``ValueError`` naming the choices."""
    methods = mp.get_all_start_methods()
    if not isinstance(start_method, str) or start_method not in methods:
        raise ValueError(f"start_method={start_method!r} is not a start method of torch.multiprocessing on this "
                         f"platform. Fix: pass one of {methods} (default 'spawn')")
    return mp.get_context(start_method)


def set_default_context(context: Any) -> Any:
    """Make ``context`` what :func:`run_ranks` starts ranks with when it is given no ``start_method``,
    and return the one it replaces (to put back). At first it is ``torch.multiprocessing``'s ``spawn``.

    ``context`` is a start method's name (``"spawn"``, ``"forkserver"``, ``"fork"``: one of
    ``torch.multiprocessing.get_all_start_methods()``) or a context object: a multiprocessing context,
    or anything with ``Queue()`` and ``Process(target=..., args=..., daemon=...)`` that behave as
    theirs, such as a test suite's fork server that imported torch once (cpshard's ``tests/forked.py``).

    A default for the process rather than an argument because ``run_ranks`` is also called from
    inside cpshard (``cpshard.verify``) and from helpers built on it: a test harness switches them all
    in one place, and the call sites stay as users write them. A call's own ``start_method`` wins.
    """
    global _default_context
    if isinstance(context, str):
        context = _start_context(context)
    elif not (callable(getattr(context, "Queue", None)) and callable(getattr(context, "Process", None))):
        raise TypeError(f"set_default_context({context!r}): expected a start method's name or an object with "
                        "Queue() and Process(target=, args=, daemon=), such as torch.multiprocessing.get_context()")
    previous, _default_context = _default_context, context
    return previous


def _unguarded_main_line() -> tuple[str, int] | None:
    """``(script, line)`` where the main script's top-level code calls this, outside an
    ``if __name__ == "__main__":`` block; ``None`` when the call is guarded, or not made by a script's
    top level (a function, a test runner, an interactive session)."""
    import ast

    main = sys.modules.get("__main__")
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and main is not None
                                     and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return None
    path, line = frame.f_code.co_filename, frame.f_lineno
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None  # no file to read back (python -c, a notebook): nothing to re-import either
    for node in tree.body:
        if _main_guard(node) and node.lineno <= line <= (node.end_lineno or node.lineno):
            return None
    return path, line


def _check_main_guard(ctx: Any) -> None:
    """Under ``spawn`` and ``forkserver`` every rank imports the main script again; a script whose top level
    calls ``run_ranks`` unguarded would start ranks from every rank (Python's "bootstrapping phase" error in
    each, and ranks that exit without reporting). Named here, before any process starts."""
    method = getattr(ctx, "get_start_method", lambda: None)()
    if method not in ("spawn", "forkserver"):
        return
    where = _unguarded_main_line()
    if where is not None:
        raise RuntimeError(
            f"run_ranks was called by the top-level code of {where[0]} (line {where[1]}), outside an "
            f"`if __name__ == \"__main__\":` block. Under the {method!r} start method every rank imports that "
            "script again, runs its top level and would start ranks of its own (Python's \"bootstrapping "
            "phase\" error). Fix: put the call under `if __name__ == \"__main__\":` (and keep the rank "
            "function at module level, so that the ranks can import it)")


def _main_guard(node: Any) -> bool:
    """Whether the statement ``node`` is an ``if __name__ == "__main__":`` block (any spelling of the test)."""
    import ast

    if not isinstance(node, ast.If):
        return False
    test = ast.unparse(node.test)
    return "__name__" in test and "__main__" in test


def _bindings(nodes: list[Any], guarded: bool = False) -> Iterator[tuple[str, int, bool]]:
    """``(name, line, under the main guard)`` for each name the module-level statements ``nodes`` bind
    (def, class, assignment, import), into ``if`` / ``try`` / ``with`` / loop blocks, not into functions."""
    import ast

    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno, guarded
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                yield (alias.asname or alias.name).split(".")[0], node.lineno, guarded
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        yield leaf.id, node.lineno, guarded
        inner = guarded or _main_guard(node)
        yield from _bindings(getattr(node, "body", []), inner)
        yield from _bindings(getattr(node, "orelse", []), guarded)
        yield from _bindings(getattr(node, "finalbody", []), guarded)
        for handler in getattr(node, "handlers", []):
            yield from _bindings(handler.body, guarded)


def _check_importable(fn: Any, ctx: Any) -> None:
    """Under ``spawn`` and ``forkserver`` a rank finds ``fn`` by importing its module (the main script again,
    as ``__mp_main__``) and looking its name up there. A lambda or a nested function has no such name
    (pickle's "Can't pickle <function <lambda>>"), and a function defined only under the script's ``if
    __name__ == "__main__":`` block does not exist there (each rank would die unpickling it: "exited with
    code 1 without reporting"). Named here, before any process starts."""
    import ast

    method = getattr(ctx, "get_start_method", lambda: None)()
    if method not in ("spawn", "forkserver"):
        return
    qualname = getattr(fn, "__qualname__", "")
    if isinstance(fn, types.FunctionType) and "<" in qualname:  # pickled by name, and it has none to import
        raise ValueError(
            f"fn={qualname}: a lambda or a function defined inside another cannot be found by name in a rank, "
            f"which imports {fn.__module__} to find it (the {method!r} start method). Fix: define the rank function "
            "with def at the top level of a module (or of the script, above its `if __name__ == \"__main__\":` "
            "block), and pass what it needs as run_ranks' *args")
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) != "__main__" or main is None:
        return
    name = qualname.split(".")[0]
    path = getattr(main, "__file__", None)
    if not name or path is None:
        return  # no file to read back (python -c, a notebook)
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError):
        return
    lines = {guarded: line for bound, line, guarded in reversed(list(_bindings(tree.body))) if bound == name}
    if False in lines or True not in lines:
        return  # bound at the top level (importable), or some other way (exec, globals()): not ours to guess
    raise ValueError(
        f"fn={fn.__qualname__}: defined under the `if __name__ == \"__main__\":` block of {path} (line "
        f"{lines[True]}). Under the {method!r} start method every rank imports that script again as "
        f"__mp_main__, where the block does not run, so no rank could find {fn.__qualname__}. Fix: define "
        f"{name} at the script's top level, above the `if __name__ == \"__main__\":` block, and keep only the "
        "run_ranks call under it")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              collective_timeout: float = 60.0, start_method: str | None = None) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each in its own process.

    Tensors in the results come back detached and on the CPU. When ranks fail, the error raised
    here is the root cause: the failing rank's own exception, not the "connection closed" its peers
    report once it is gone, nor their summary of its refusal ("ranks [1] ... rejected their input"),
    whichever arrives first (those ranks are listed after it, each with its last line). A rank whose
    process ends without a report is named with its exit code as soon as it is gone. A ``fn`` defined
    under the main script's ``if __name__ == "__main__":`` block is a ``ValueError`` before any process
    starts (the ranks could not find it).

    ``start_method`` is how the ranks start: one of ``torch.multiprocessing.get_all_start_methods()``
    (a ``ValueError`` before any process starts otherwise). ``None`` takes the default,
    ``"spawn"`` unless :func:`set_default_context` changed it. ``"spawn"`` gives fresh interpreters that
    inherit nothing; ``"forkserver"`` forks each rank from a server process started once; ``"fork"``
    starts fastest but copies this process's state (unsafe once it runs threads).
    """
    ctx = _default_context if start_method is None else _start_context(start_method)
    _check_main_guard(ctx)
    _check_importable(fn, ctx)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, collective_timeout),
                          daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    failures: dict[int, tuple[float, str]] = {}
    deadline = time.monotonic() + timeout
    first_failure: float | None = None  # then the other ranks' reports are awaited a short while (_SETTLE_S)
    try:
        while len(out) + len(failures) < world_size:
            now = time.monotonic()
            if first_failure is not None and now >= first_failure + _settle(failures):
                break
            if now >= deadline:
                if failures:
                    break
                missing = sorted(set(range(world_size)) - set(out))
                done = sorted(out)
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s"
                    + (f" (ranks {done} returned)" if done else "")
                    + ": they were killed. A rank that waits in a collective its peers never make (different "
                    "calls, plans or check settings per rank) hangs until the backend's collective_timeout "
                    f"({collective_timeout:.0f}s here). Fix: make every rank issue the same collectives, or "
                    "raise timeout= if the work is only slow")
            # the ranks gone before this wait: whatever they reported was in the queue before they exited
            # (a process flushes its queue at exit), so one not heard of by the end of an empty wait never reported
            gone = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode is not None}
            try:
                rank, ok, when, value = results.get(timeout=max(min(deadline - now, 0.5), 0.01))
            except queue.Empty:
                for r, code in gone.items():
                    if r not in out and r not in failures:
                        failures[r] = (time.time(), _no_report(r, world_size, code))
                        first_failure = first_failure or time.monotonic()
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                failures[rank] = (when, value)
                first_failure = first_failure or time.monotonic()
        if failures:
            first = _root_cause(failures)
            others = sorted(set(failures) - {first})
            also = (f"\n(ranks {others} failed after it)" + "".join(f"\n  rank {r}: {_last_line(failures[r][1])}"
                                                                    for r in others)) if others else ""
            raise RuntimeError(f"rank {first} of {world_size} failed:\n{failures[first][1]}{also}")
    finally:
        grace = time.monotonic() + 5.0  # in all: ranks blocked on a failed peer are killed, not awaited
        for p in procs:
            p.join(timeout=max(grace - time.monotonic(), 0.0))
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [out[r] for r in range(world_size)]


def _settle(failures: dict[int, tuple[float, str]]) -> float:
    """How long after the first failure the other ranks' reports are awaited: longer while no rank's own
    error is in (a peer's summary came first, and the refusing rank's report is on its way)."""
    own = any(_tier(text) == 0 for _, text in failures.values())
    return _SETTLE_S if own else _SETTLE_FOR_OWN_S


def _no_report(rank: int, world_size: int, code: int) -> str:
    """What is known of a rank whose process ended without a report."""
    if code == 0:
        return (f"rank {rank} exited with code 0 without reporting: its process ended before the function "
                "returned (os._exit(), or a library that ends the interpreter), so it returned nothing. Fix: "
                "return from the function (or raise) instead of ending the process")
    return (f"rank {rank} exited with code {code} without reporting (its own error, if any, is on stderr above; "
            "under 'spawn' a rank that cannot import the calling script, or the module of its function, dies so)")
