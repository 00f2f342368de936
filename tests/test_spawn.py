"""cpshard.spawn: run_ranks hands back what the ranks return, whatever the ranks imported, and starts
them the way it is asked to (ranks started by ``spawn``, as users get them; the rest of the suite forks
them from a server, tests/forked.py); CollectiveCounter names and sizes every kind of c10d call.
"""

from __future__ import annotations

import pickle
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist

from cpshard import spawn
from cpshard.spawn import CollectiveCounter, run_ranks


def _values(rank):
    """Tensors of every kind a rank may return (built the same way in the parent to compare)."""
    g = torch.Generator().manual_seed(rank)
    base = torch.randn(4, 6, generator=g)
    return {
        "float64 view": base.double()[:, ::2],          # not contiguous
        "bfloat16": base.bfloat16(),
        "float8": base.to(torch.float8_e4m3fn),
        "bool": base > 0,
        "int64 0-d": torch.tensor(rank),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
        "complex conj": torch.complex(base, -base).conj(),
        "nested list": [torch.arange(3) + rank, (torch.ones(2, dtype=torch.uint8),)],
    }


def _import_megatron_then_return(rank, world):
    from cpshard.megatron import import_megatron

    import_megatron("transformer.multi_token_prediction")  # replaces torch.storage._load_from_bytes
    assert "megatron.core.safe_globals" in sys.modules
    return _values(rank)


def _bits(t):
    return t.resolve_conj().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b):
    """The same structure, and every tensor the same dtype, shape and bytes (NaN payloads, -0.0)."""
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)


@pytest.mark.usefixtures("spawned")  # the default start method (tests/conftest.py)
def test_tensors_come_back_after_a_rank_imported_megatron():
    """megatron-core replaces torch.storage._load_from_bytes when it is imported; a tensor pickled
    the usual way would then make the parent import Megatron (and Triton) to read it."""
    from cpshard.megatron import import_megatron
    try:
        import_megatron("transformer.multi_token_prediction")
    except ImportError as exc:
        pytest.skip(f"megatron-core cannot be imported ({exc}); scripts/setup.sh installs it")
    got = run_ranks(_import_megatron_then_return, 2, timeout=120)
    for rank, values in enumerate(got):
        _same(_values(rank), values)
    # what a rank sends names nothing of Megatron's, so a parent that never imported it reads it too
    # (this process may have imported Megatron already, so the bytes are what is checked)
    assert torch.storage._load_from_bytes.__module__ == "megatron.core.safe_globals"
    assert b"megatron" not in spawn._dumps(_values(0))
    assert b"megatron" in pickle.dumps(_values(0))  # the default pickling would have named it


def _counted(body):
    with CollectiveCounter() as comm:
        result = body()
    return comm.calls, comm.bytes, result


def _each_kind(rank, world):
    """``{kind: (calls, bytes, what the call produced)}``, each kind counted on its own (3 ranks)."""
    peers = range(world)
    seen = {}

    out = torch.empty(3 * world)
    seen["all_gather_into_tensor"] = _counted(
        lambda: dist.all_gather_into_tensor(out, torch.arange(3.0) + rank) or out.tolist())
    outs = [torch.empty(2, dtype=torch.int64) for _ in peers]
    seen["all_gather"] = _counted(
        lambda: dist.all_gather(outs, torch.full((2,), rank)) or [t.tolist() for t in outs])
    # rank r sends r + 1 values to each peer q (10 r + q): 24 (r + 1) bytes of float64 in, 6 values out
    sent = torch.tensor([10.0 * rank + q for q in peers for _ in range(rank + 1)], dtype=torch.float64)
    got = torch.empty(sum(p + 1 for p in peers), dtype=torch.float64)
    seen["all_to_all_single"] = _counted(
        lambda: dist.all_to_all_single(got, sent, [p + 1 for p in peers], [rank + 1] * world) or got.tolist())
    summed = torch.full((5,), rank + 1.0, dtype=torch.float64)
    seen["all_reduce"] = _counted(lambda: dist.all_reduce(summed) or summed.tolist())
    cast = torch.full((4,), rank, dtype=torch.int32)
    seen["broadcast"] = _counted(lambda: dist.broadcast(cast, src=1) or cast.tolist())

    def send_recv():
        if rank == 0:
            dist.send(torch.arange(7, dtype=torch.uint8), dst=1)
        elif rank == 1:
            into = torch.empty(7, dtype=torch.uint8)
            dist.recv(into, src=0)
            return into.tolist()
        return None
    seen["send/recv"] = _counted(send_recv)

    def isend_irecv():
        if rank == 2:
            dist.isend(torch.ones(3, dtype=torch.float16), dst=0).wait()
        elif rank == 0:
            into = torch.empty(3, dtype=torch.float16)
            dist.irecv(into, src=2).wait()
            return into.tolist()
        return None
    seen["isend/irecv"] = _counted(isend_irecv)
    seen["barrier"] = _counted(lambda: dist.barrier())

    def in_order():
        dist.all_reduce(torch.ones(1, dtype=torch.int64))
        dist.barrier()
        dist.all_gather_into_tensor(torch.empty(world), torch.ones(1))
        dist.broadcast(torch.ones(2), src=0)
    seen["in order"] = _counted(in_order)

    def no_collective():
        w = torch.randn(4, 3, requires_grad=True)
        layer = torch.nn.Linear(3, 3)
        loss = layer(layer(torch.ones(2, 4) @ w)).relu().sum()  # a module twice (CommDebugMode raised)
        loss.backward()
        return [dist.get_rank(), dist.get_world_size(), w.grad.shape[0]]
    seen["no collective"] = _counted(no_collective)
    return seen


def test_the_counter_names_and_sizes_each_kind_of_collective():
    got = run_ranks(_each_kind, 3, timeout=120)
    order = ["allreduce", "allgather_base", "broadcast"]
    expected = {  # kind: per rank (calls, bytes sent by that rank, what the call produced there)
        "all_gather_into_tensor": [(["allgather_base"], 12, [0.0, 1, 2, 1, 2, 3, 2, 3, 4])] * 3,
        "all_gather": [(["allgather"], 16, [[0, 0], [1, 1], [2, 2]])] * 3,
        "all_to_all_single": [(["alltoall_base"], 24 * (r + 1), [10.0 * p + r for p in range(3) for _ in range(p + 1)])
                              for r in range(3)],
        "all_reduce": [(["allreduce"], 40, [6.0] * 5)] * 3,
        "broadcast": [(["broadcast"], 16 if r == 1 else 0, [1] * 4) for r in range(3)],
        "send/recv": [(["send"], 7, None), (["recv"], 0, list(range(7))), ([], 0, None)],
        "isend/irecv": [(["recv"], 0, [1.0] * 3), ([], 0, None), (["send"], 6, None)],
        "barrier": [([], 0, None)] * 3,
        "in order": [(order, 8 + 4 + 8, None)] + [(order, 8 + 4, None)] * 2,  # the broadcast's root sends
        "no collective": [([], 0, [r, 3, 4]) for r in range(3)],
    }
    for kind, per_rank in expected.items():
        assert [seen[kind] for seen in got] == per_rank, kind


def _spawned_rank(rank, world):
    with CollectiveCounter() as comm:
        total = torch.tensor([rank + 1])
        dist.all_reduce(total)
        (total * 2).tolist()
    # a fresh interpreter (the fork server preloads tests/forked.py), and the counter never loaded DTensor
    return comm.calls, int(total), "forked" in sys.modules, "torch.distributed.tensor" in sys.modules


def test_start_method_spawn_starts_fresh_interpreters_and_the_counter_stays_light():
    """``start_method="spawn"`` overrides the suite's default (its fork server); in a fresh rank the
    counter works without importing torch.distributed.tensor (the DTensor stack, seconds of import)."""
    assert run_ranks(_spawned_rank, 2, start_method="spawn") == [(["allreduce"], 3, False, False)] * 2


def _never_runs(rank, world):
    raise AssertionError("a rank started")


def test_a_bad_start_method_raises_before_any_process_starts(monkeypatch):
    def no_port():
        raise AssertionError("run_ranks went on to start ranks")
    monkeypatch.setattr(spawn, "free_port", no_port)
    for bad in ("threads", "Spawn", "", 1):
        with pytest.raises(ValueError, match=r"start_method=.* is not a start method of torch\.multiprocessing "
                                             r"on this platform\. Fix: pass one of \[.*'spawn'"):
            run_ranks(_never_runs, 2, start_method=bad)
    with pytest.raises(ValueError, match="start_method='threads'"):
        spawn.set_default_context("threads")
    with pytest.raises(TypeError, match="expected a start method's name or an object with Queue"):
        spawn.set_default_context(object())


def test_set_default_context_returns_the_one_it_replaces():
    forked = spawn.set_default_context("spawn")
    try:
        assert forked.get_start_method() == "forkserver"  # the suite's server (tests/conftest.py)
        assert spawn.set_default_context(forked).get_start_method() == "spawn"
    finally:
        spawn.set_default_context(forked)


def test_the_counter_under_torch_compile():
    """Once torch._dynamo is loaded the counter is the variant torch hides from torch.compile (as it hides
    every dispatch mode); before, the plain class, which never imports it."""
    import torch._dynamo  # noqa: F401 - what torch.compile loads

    counter = CollectiveCounter()
    assert isinstance(counter, CollectiveCounter) and type(counter) is not CollectiveCounter
    assert hasattr(type(counter).__dict__["__torch_dispatch__"], "__wrapped__")
    double = torch.compile(lambda x: x * 2 + 1, backend="eager")
    with counter:
        assert double(torch.ones(3)).tolist() == [3.0] * 3
    assert (counter.calls, counter.bytes) == ([], 0)
    assert not hasattr(CollectiveCounter.__dict__["__torch_dispatch__"], "__wrapped__")


_SCRIPT = '''
import torch.distributed as dist
from cpshard.spawn import run_ranks


def body(rank, world_size):
    return rank
{call}
'''


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_without_the_main_guard_is_named_before_any_rank_starts(tmp_path, guarded):
    """A script that calls run_ranks at its top level: Python's own error is about a "bootstrapping phase"
    in every rank; run_ranks names the guard and the line instead, and starts nothing. Guarded, it runs."""
    import subprocess

    call = 'if __name__ == "__main__":\n    print(run_ranks(body, 2))' if guarded else "print(run_ranks(body, 2))"
    script = tmp_path / "ranks.py"
    script.write_text(_SCRIPT.format(call=call))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    if guarded:
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "[0, 1]"
    else:
        assert done.returncode == 1
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith(f"RuntimeError: run_ranks was called by the top-level code of {script} (line 8)")
        assert 'Fix: put the call under `if __name__ == "__main__":`' in last
        assert "bootstrapping" in last and "rank 0" not in done.stderr  # no rank started


def test_a_call_from_a_function_of_the_main_script_is_not_refused(monkeypatch):
    """Only the main script's top level is looked at: a call from a test (or any function) is not refused."""
    assert spawn._unguarded_main_line() is None


_SCRIPT_GUARDED_FUNCTION = '''
from cpshard.spawn import run_ranks

if __name__ == "__main__":
    def body(rank, world_size):
        return rank

    print(run_ranks(body, 2))
'''


def test_a_function_defined_under_the_main_guard_is_named_before_any_rank_starts(tmp_path):
    """The ranks import the script again as __mp_main__, where the guarded block does not run: each would
    die unpickling the function ("exited with code 1 without reporting"). run_ranks names the function,
    its line and the fix instead, and starts nothing."""
    import subprocess

    script = tmp_path / "ranks.py"
    script.write_text(_SCRIPT_GUARDED_FUNCTION)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f'ValueError: fn=body: defined under the `if __name__ == "__main__":` block of {script} '
                           "(line 5)"), last
    assert "Fix: define body at the script's top level" in last and "without reporting" not in done.stderr


def _own_error_reported_last(rank, world):
    from cpshard import ShardPlan
    from cpshard.loss import token_mean

    plan = ShardPlan.build([5, 7], cp_size=world)
    mask = torch.ones(3) if rank == 1 else torch.ones(plan.local_shape)  # rank 1: a mask of the wrong shape
    try:
        return float(token_mean(torch.ones(plan.local_shape), mask, plan, dist.group.WORLD, check=True))
    except ValueError:
        if rank == 1:
            time.sleep(1.0)  # its own report arrives after rank 0's summary of it
        raise


def test_the_refusing_rank_s_own_error_is_raised_whichever_report_comes_first():
    """With checks on, rank 1 refuses its mask and rank 0 raises "ranks [1] ... rejected their input"
    at the same moment; the error run_ranks raises is rank 1's own (the mask's shape), with rank 0's
    summary after it, even when rank 0's report arrives first (before: the first report won)."""
    with pytest.raises(RuntimeError) as raised:
        run_ranks(_own_error_reported_last, 2, timeout=100)
    text = str(raised.value)
    assert text.startswith("rank 1 of 2 failed:\n"), text
    assert "ValueError: loss_mask=tensor of shape (3,)" in text, text
    tail = text.split("\n(ranks [0] failed after it)\n", 1)[1]
    assert tail.startswith("  rank 0: ValueError: ranks [1] of the context-parallel group rejected their input"), text


def _leaves_by_os_exit(rank, world):
    import os
    if rank == 1:
        os._exit(0)  # no exception, no report, exit status 0
    return rank


def test_a_rank_that_exits_without_reporting_is_named_at_once():
    """A rank whose process ends with status 0 and no report: named with its exit code as soon as it is
    gone, not a TimeoutError ("did not finish") after the whole timeout."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^rank 1 of 2 failed:\nrank 1 exited with code 0 without reporting: its "
                                           r"process ended before the function returned \(os\._exit\(\)"):
        run_ranks(_leaves_by_os_exit, 2, timeout=300)
    assert time.monotonic() - start < 150  # far below the timeout it used to wait out


def test_a_lambda_or_a_nested_function_is_named_before_any_rank_starts(monkeypatch):
    """A rank finds its function by name in its module: a lambda or a function defined inside another has
    none (before: pickle's "Can't pickle <function <lambda>>", from inside multiprocessing)."""
    def no_port():
        raise AssertionError("run_ranks went on to start ranks")

    def nested(rank, world):
        return rank

    monkeypatch.setattr(spawn, "free_port", no_port)
    here = "test_a_lambda_or_a_nested_function_is_named_before_any_rank_starts.<locals>"
    for fn, name in ((lambda rank, world: rank, f"{here}.<lambda>"), (nested, f"{here}.nested")):
        with pytest.raises(ValueError, match=rf"^fn={re.escape(name)}: a lambda or a function defined inside another "
                                             r"cannot be found by name in a rank.*Fix: define the rank function with "
                                             r"def at the top level of a module"):
            run_ranks(fn, 2, start_method="spawn")
