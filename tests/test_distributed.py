"""gather / shift_sharded / check_plan across real gloo processes (cpshard.spawn.run_ranks).

Each spawned group runs many sub-cases and asserts inside every rank; the parent asserts on what the
ranks report. Collectives are counted by wrapping the ``torch.distributed`` functions in each rank.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from cpshard import BshdPlan, Layout, ShardPlan, shard, shift_exchange, unshard
from cpshard.distributed import check_plan, gather, gather_tokens, shift_sharded, shift_sharded_multi
from cpshard.spawn import CollectiveCounter, run_ranks
from rank_suites import run_suite

GATHER, ALL_TO_ALL = "allgather_base", "alltoall_base"  # the c10d ops behind all_gather_single, all_to_all_single


def _data(lens, trailing, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n, *trailing), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(n, *trailing, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n, *trailing), generator=g).to(dtype)


def _batches(cp):
    a = 2 * cp
    return [
        [0, 1, 3 * a + 1, 0, a - 1, a, a + 1],
        [1],
        [0],
        [700, 5, 0, 333],
        [4000, 1, 3000],  # contiguous: long runs, restored by copying runs (plan.token_runs), not an index
    ]


def _fill_for(dtype):
    return (True, False) if dtype == torch.bool else (-7, -1)


_DTYPES = ((torch.float32, ()), (torch.int64, (3,)), (torch.bool, ()), (torch.bfloat16, (2,)))


def _gather_and_shift_cases(world):
    """Every sub-case of ``_gather_and_shift``, named, so that the parent can check none was skipped."""
    for layout in Layout:
        for tp in (1, 2):
            for i, lens in enumerate(_batches(world)):
                for dtype, trailing in _DTYPES:
                    name = f"{layout.value}/tp{tp}/batch{i}/{dtype}{list(trailing)}"
                    yield name, layout, tp, i, lens, dtype, trailing, "aligned"
    for tp in (1, 2):  # zigzag without padding: chunks one row apart (SPEC, "Zigzag without padding")
        for i, lens in enumerate(_batches(world)):
            for dtype, trailing in _DTYPES[:2]:
                yield f"zigzag-none/tp{tp}/batch{i}/{dtype}{list(trailing)}", Layout.ZIGZAG, tp, i, lens, dtype, \
                    trailing, "none"


SHIFTS = (1, 2, 3, -1, -3)  # negative: a look-back (SPEC, Shifts)


def _gather_and_shift(rank, world):
    """gather == unshard and shift_sharded == shard(shift) on every rank; one collective each."""
    checked = []
    for name, layout, tp, i, lens, dtype, trailing, padding in _gather_and_shift_cases(world):
        plan = ShardPlan.build(lens, cp_size=world, tp_size=tp, layout=layout, padding=padding)
        x = _data(lens, trailing, dtype, seed=100 * i + tp)
        parts = [shard(x, plan, r) for r in range(world)]
        with CollectiveCounter() as counter:
            got = gather(parts[rank], plan, dist.group.WORLD)
        assert counter.calls == [GATHER], counter.calls
        want = unshard(parts, plan)
        assert torch.equal(got.values(), want.values()) and torch.equal(got.offsets(), want.offsets())
        assert torch.equal(gather_tokens(parts[rank], plan, dist.group.WORLD), x)
        fill, pad = _fill_for(dtype)
        for k in SHIFTS:
            for pad_value in (pad, None):  # None: SPEC's default, fill on a shifted tensor's pad rows
                with CollectiveCounter() as counter:
                    out = shift_sharded(parts[rank], plan, dist.group.WORLD, shift=k, fill=fill, pad_value=pad_value)
                expected = shard(x, plan, rank, shift=k, fill=fill, pad_value=pad_value)
                assert out.dtype == dtype and torch.equal(out, expected), (name, k, out, expected)
                crossing = shift_exchange(plan, rank, k).total_remote
                assert counter.calls == ([ALL_TO_ALL] if crossing else []), counter.calls
            checked.append(f"{name}/shift{k}")
        # every shift at once, k = 0 too: SPEC's default pad value is fill when shifted and 0 for k = 0,
        # as shard and shift_sharded give (the k = 0 entry padded with fill before)
        multi = shift_sharded_multi([parts[rank]], plan, dist.group.WORLD, shifts=(0, *SHIFTS), fills=[fill])[0]
        for s, k in enumerate((0, *SHIFTS)):
            assert torch.equal(multi[s], shard(x, plan, rank, shift=k, fill=fill)), (name, k)
    return checked


def _bshd_gather(rank, world):
    for layout in Layout:
        lens = [0, 5, 2 * world + 1, 1]
        plan = BshdPlan.build(lens, cp_size=world, layout=layout)
        x = _data(lens, (2,), torch.float32, seed=7)
        parts = [shard(list(x.split(lens)), plan, r) for r in range(world)]
        got = gather(parts[rank], plan, dist.group.WORLD, check=True)
        assert torch.equal(got.values(), x)
        assert torch.equal(got.values(), unshard(parts, plan).values())
        # backward through the BSHD gather (view, movedim, reshape) equals the single-process one
        w = _data(lens, (2,), torch.float64, seed=8)
        leaves = [p.double().requires_grad_() for p in parts]
        (unshard(leaves, plan).values() * w).sum().backward()
        local = parts[rank].double().requires_grad_()
        (gather(local, plan, dist.group.WORLD).values() * w).sum().backward()
        assert torch.equal(local.grad, leaves[rank].grad)
        # shift_sharded takes BSHD plans too: each row of the padded batch is one sequence
        for k in (1, 2):
            out = shift_sharded(parts[rank], plan, dist.group.WORLD, shift=k, fill=-7.0, check=True)
            assert out.shape == parts[rank].shape
            assert torch.equal(out, shard(list(x.split(lens)), plan, rank, shift=k, fill=-7.0))
    return True


def _near_ranks_only(rank, world):
    """Many short sequences (one-row zigzag chunks): each rank's shift and halo exchanges read its
    own segments and its neighbours' only, never every rank's, and still give shard(shift(x, k))
    on every rank, with a collective exactly where a row crosses ranks (the group's closed-form count)."""
    lens = [1 + (5 * i) % (2 * world) for i in range(40)]
    reached = {}
    for layout in Layout:
        plan = ShardPlan.build(lens, cp_size=world, layout=layout)
        x = _data(lens, (2,), torch.int64, seed=11)
        local = shard(x, plan, rank)
        for k in (1, -1, 2):
            with CollectiveCounter() as counter:
                out = shift_sharded(local, plan, dist.group.WORLD, shift=k, fill=-7)
            assert torch.equal(out, shard(x, plan, rank, shift=k, fill=-7)), (layout, k)
            crossing = shift_exchange(plan, rank, k).total_remote
            assert crossing > 0 and counter.calls == [ALL_TO_ALL], (crossing, counter.calls)
        shifts = (1, 2, -1)
        outs = shift_sharded_multi([local], plan, dist.group.WORLD, shifts=shifts, fills=[-7])
        for s, k in enumerate(shifts):
            assert torch.equal(outs[0][s], shard(x, plan, rank, shift=k, fill=-7)), (layout, k)
        kept = plan.indices().kept()
        assert "every" not in kept, kept
        reached[layout.value] = kept["segments"]
    return reached


def _odd_dtypes(rank, world):
    """fp8 (no index_fill_ or gloo support: moved as bytes), float16, int8, complex and uintN rows."""
    lens = [7, 0, 2 * world + 3]
    for layout in Layout:
        plan = ShardPlan.build(lens, cp_size=world, layout=layout)
        for dtype in (torch.float8_e4m3fn, torch.float16, torch.int8, torch.complex64, torch.uint16, torch.uint32,
                      torch.uint64):
            base = torch.arange(sum(lens), dtype=torch.float32) / 4
            x = base.to(dtype) if dtype.is_floating_point or dtype.is_complex else \
                torch.arange(sum(lens), dtype=torch.int64).to(dtype)
            local = shard(x, plan, rank)
            got = gather(local, plan, dist.group.WORLD, check=True).values()
            assert got.dtype == dtype and torch.equal(got.view(torch.uint8), x.view(torch.uint8))
            out = shift_sharded(local, plan, dist.group.WORLD, shift=2, fill=1, pad_value=0, check=True)
            want = shard(x, plan, rank, shift=2, fill=1, pad_value=0)
            assert out.dtype == dtype and torch.equal(out.view(torch.uint8), want.view(torch.uint8))
            multi = shift_sharded_multi([local], plan, dist.group.WORLD, shifts=[-2, 1, 2], fills=[1],
                                        pad_values=[0])[0]
            for s, k in enumerate((-2, 1, 2)):  # a look-back halo in the same collective
                want = shard(x, plan, rank, shift=k, fill=1, pad_value=0)
                assert multi.dtype == dtype and torch.equal(multi[s].view(torch.uint8), want.view(torch.uint8))
            if dtype.is_complex:  # a conjugate view: its values travel, not its bytes
                got = gather(local.conj(), plan, dist.group.WORLD, check=True).values()
                assert torch.equal(got, x.conj())
                out = shift_sharded(local.conj(), plan, dist.group.WORLD, shift=2, fill=1, pad_value=0)
                assert torch.equal(out, want.conj())
    return True


def _autograd(rank, world):
    """Gradients through gather and shift_sharded equal the single-process ones for this rank's rows."""
    for layout, lens in [(layout, lens) for layout in Layout for lens in ([9, 0, 4 * world + 3, 2], [2500, 3, 1800])]:
        plan = ShardPlan.build(lens, cp_size=world, layout=layout)
        h = _data(lens, (3,), torch.float64, seed=3)
        w = _data(lens, (3,), torch.float64, seed=4)

        # single process: every rank's shard is a leaf; the loss sees all of them through unshard
        leaves = [shard(h, plan, r).requires_grad_() for r in range(world)]
        (unshard(leaves, plan).values() * w).sum().backward()
        local = shard(h, plan, rank).requires_grad_()
        (gather(local, plan, dist.group.WORLD).values() * w).sum().backward()
        assert torch.equal(local.grad, leaves[rank].grad)

        # shift: each rank's loss uses its own shifted rows; gradients travel back to the source rank
        for k in (1, 2):
            weights = [shard(w, plan, r) for r in range(world)]
            leaves = [shard(h, plan, r).requires_grad_() for r in range(world)]
            hh = unshard(leaves, plan).values()
            sum((shard(hh, plan, r, shift=k) * weights[r]).sum() for r in range(world)).backward()
            local = shard(h, plan, rank).requires_grad_()
            (shift_sharded(local, plan, dist.group.WORLD, shift=k) * weights[rank]).sum().backward()
            assert torch.equal(local.grad, leaves[rank].grad), (layout, k)
    return True


def _costs(rank, world):
    """Collective count does not grow with the batch; a shift moves a small fraction of the rows."""
    calls, fractions = {}, {}
    for b in (4, 256):
        g = torch.Generator().manual_seed(b)
        lens = (torch.randint(1, 40, (b,), generator=g)).tolist()
        plan = ShardPlan.build(lens, cp_size=world)
        local = shard(torch.arange(sum(lens)), plan, rank)
        with CollectiveCounter() as counter:
            gather(local, plan, dist.group.WORLD)
            shift_sharded(local, plan, dist.group.WORLD, shift=1)
        calls[b] = list(counter.calls)
    lens = [3000, 2000, 1500]
    plan = ShardPlan.build(lens, cp_size=world)
    local = shard(torch.randn(sum(lens), 16), plan, rank)
    with CollectiveCounter() as counter:
        shift_sharded(local, plan, dist.group.WORLD, shift=1)
    fractions["long"] = counter.bytes / (local.numel() * local.element_size())
    return calls, fractions


def _mismatch(rank, world):
    """One rank builds a different plan: every rank raises, naming the odd rank, within seconds."""
    lens = [5, 3] if rank != 2 else [5, 4]
    plan = ShardPlan.build(lens, cp_size=world)
    start = time.monotonic()
    errors = []
    world_group = dist.group.WORLD
    for call in (lambda: check_plan(plan, world_group),
                 lambda: gather(shard(torch.arange(plan.num_tokens), plan, rank), plan, world_group, check=True),
                 lambda: shift_sharded(torch.zeros(plan.local_len), plan, dist.group.WORLD, check=True)):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    # with check=True, bad input on one rank, or one rank's plan sized for another group, makes every
    # rank raise (after the small check collective) instead of leaving the others waiting
    good = ShardPlan.build([5, 3], cp_size=world)
    local = shard(torch.arange(8), good, rank)
    for call in (lambda: gather(local[:-1] if rank == 2 else local, good, dist.group.WORLD, check=True),
                 lambda: shift_sharded(local, ShardPlan.build([5, 3], cp_size=2) if rank == 1 else good,
                                       dist.group.WORLD, check=True)):
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    # ... and so do different arguments for one step (dtype, row shape, shift), or a non-plan
    for call in (lambda: gather(local.double() if rank == 1 else local.float(), good, dist.group.WORLD, check=True),
                 lambda: shift_sharded(local, good, dist.group.WORLD, shift=3 if rank == 1 else 1, check=True),
                 lambda: gather(local, "not a plan" if rank == 3 else good, dist.group.WORLD, check=True)):
        try:
            call()
        except (ValueError, TypeError) as exc:
            errors.append(str(exc))
    # check_plan itself: the same plan on every rank, but sized for another group, raises everywhere
    try:
        check_plan(ShardPlan.build([5, 3], cp_size=world // 2), dist.group.WORLD)
    except ValueError as exc:
        errors.append(str(exc))
    # a plan for the wrong group size fails before any communication
    with CollectiveCounter() as counter:
        wrong = ShardPlan.build([5, 3], cp_size=world // 2)
        try:
            gather(torch.zeros(wrong.local_len), wrong, dist.group.WORLD)
        except ValueError as exc:
            errors.append(str(exc))
    return errors, counter.calls, time.monotonic() - start


def _subgroups(rank, world):
    """Megatron-style CP sub-groups (two groups of world/2 ranks): functions use the group's rank."""
    half = world // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
    group = groups[rank // half]
    cp_rank = rank % half
    lens = [7, 0, 13] if rank < half else [2, 21]  # each CP group has its own micro-batch
    plan = ShardPlan.build(lens, cp_size=half, layout="contiguous")
    x = torch.arange(sum(lens)) + 1000 * (rank // half)
    local = shard(x, plan, cp_rank)
    got = gather(local, plan, group, check=True)
    assert torch.equal(got.values(), x)
    out = shift_sharded(local, plan, group, shift=2, fill=-1, check=True)
    assert torch.equal(out, shard(x, plan, cp_rank, shift=2, fill=-1))

    # verl's dynamic CP: a group of local_cp_size ranks built for each micro-batch
    for local_cp_size in (world, half, 1):
        groups = [dist.new_group(list(range(s, s + local_cp_size))) for s in range(0, world, local_cp_size)]
        group = groups[rank // local_cp_size]
        lens = [3 * local_cp_size + 1, 0, 5 + rank // local_cp_size]
        plan = ShardPlan.build(lens, cp_size=local_cp_size)
        x = torch.arange(sum(lens), dtype=torch.float32)
        local = shard(x, plan, rank % local_cp_size)
        assert torch.equal(gather(local, plan, group, check=True).values(), x)
        assert torch.equal(shift_sharded(local, plan, group, shift=1, fill=-1),
                           shard(x, plan, rank % local_cp_size, shift=1, fill=-1))
    return True


def _switch_and_groups(rank, world):
    """The process-wide check switch, fill values compared after conversion, and group errors."""
    from cpshard.distributed import checks_enabled, set_checks

    plan = ShardPlan.build([5, 3] if rank != 1 else [4, 4], cp_size=world)
    local = torch.zeros(plan.local_len)
    previous = set_checks(True)
    try:
        assert checks_enabled()
        with pytest.raises(ValueError, match="built different plans"):
            gather(local, plan, dist.group.WORLD)  # check=None follows the switch: every rank raises
    finally:
        set_checks(previous)
    good = ShardPlan.build([5, 3], cp_size=world)
    x = torch.arange(8, dtype=torch.float32)
    # fill=0 on one rank and fill=0.0 on another are the same value in a float tensor
    out = shift_sharded(shard(x, good, rank), good, dist.group.WORLD, fill=0 if rank else 0.0, check=True)
    assert torch.equal(out, shard(x, good, rank, shift=1))
    # a reordered (balanced) plan: gather returns the caller's order, shift_sharded follows the buffer
    lens = [900, 3, 0, 400, 17, 1200]
    xb = torch.arange(sum(lens))
    plan_b = ShardPlan.build(lens, cp_size=world, layout="contiguous", reorder="balanced")
    local_b = shard(xb, plan_b, rank)
    assert torch.equal(gather(local_b, plan_b, dist.group.WORLD, check=True).values(), xb)
    assert torch.equal(shift_sharded(local_b, plan_b, dist.group.WORLD, shift=2, fill=-1),
                       shard(xb, plan_b, rank, shift=2, fill=-1))
    with torch.inference_mode():  # log-prob and value passes run there
        inf = gather(shard(x, good, rank), good, dist.group.WORLD, check=True)
        assert torch.equal(inf.values(), x)
    with pytest.raises(TypeError, match="group=None: must be the context-parallel process group"):
        gather(local, good, None)
    other = dist.new_group([0])  # every rank creates it; only rank 0 belongs to it
    if rank != 0:
        with pytest.raises(ValueError, match=r"group=a group of ranks \[0\]: does not contain this process"):
            gather(torch.zeros(8), ShardPlan.build([5, 3], cp_size=1), other)
    return True


# One spawned group per world size runs every sub-case planned for it (starting processes is the
# expensive part on a small machine); each test then asserts on its sub-case's results.
_PLAN = {
    2: ("_gather_and_shift", "_bshd_gather", "_autograd", "_odd_dtypes"),
    3: ("_gather_and_shift", "_bshd_gather", "_odd_dtypes", "_switch_and_groups"),
    4: ("_gather_and_shift", "_autograd", "_costs", "_mismatch", "_subgroups"),
    8: ("_gather_and_shift", "_near_ranks_only"),
}


@pytest.fixture(scope="module")
def suites():
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_suite(__name__, _PLAN[world], world, timeout=400, collective_timeout=60)
        return cache[world]
    return get


def _results(suites, world, name):
    return [ranks[name] for ranks in suites(world)]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_gather_and_shift_sharded(suites, world):
    cases = [f"{c[0]}/shift{k}" for c in _gather_and_shift_cases(world) for k in SHIFTS]
    assert _results(suites, world, "_gather_and_shift") == [cases] * world


def test_exchanges_read_near_ranks_only(suites):
    """At cp = 8 with one-row zigzag chunks, shifts of 1 and 2 and the halo of (1, 2, -1) reach the ranks
    within two chunks of a rank's two (5 of 8 ranks' segments); contiguous, the rank and its two neighbours."""
    got = _results(suites, 8, "_near_ranks_only")
    assert all(r["zigzag"] <= 5 and r["contiguous"] <= 3 for r in got), got


@pytest.mark.parametrize("world", [2, 3])
def test_bshd_gather(suites, world):
    assert _results(suites, world, "_bshd_gather") == [True] * world


@pytest.mark.parametrize("world", [2, 3])
def test_odd_dtypes(suites, world):
    assert _results(suites, world, "_odd_dtypes") == [True] * world


@pytest.mark.parametrize("world", [2, 4])
def test_autograd_matches_single_process(suites, world):
    assert _results(suites, world, "_autograd") == [True] * world


def test_collective_counts_and_volume(suites):
    for calls, fractions in _results(suites, 4, "_costs"):
        assert calls[4] == calls[256] == [GATHER, ALL_TO_ALL]
        assert fractions["long"] < 0.01, fractions


def test_mismatched_plans_raise_everywhere(suites):
    for rank, (errors, calls, elapsed) in enumerate(_results(suites, 4, "_mismatch")):
        assert len(errors) == 10, errors
        for msg in errors[:3]:
            assert "built different plans" in msg and "ranks [2]" in msg and "ranks [0, 1, 3]" in msg, msg
        if rank == 2:
            assert "local=tensor of shape (3,)" in errors[3], errors[3]
        else:
            assert "ranks [2] of the context-parallel group rejected their input" in errors[3], errors[3]
        assert "ranks [1] built ShardPlan(cp_size=2" in errors[4], errors[4]
        for msg, argument in zip(errors[5:7], ("dtype", "shift")):  # each names the argument that differs
            assert f"called with different arguments in {argument}: ranks [0, 2, 3] vs [1]" in msg, msg
        assert "dtype=torch.float" in errors[5] and "shift=" in errors[6]
        assert "ranks [3] built no plan (see that rank's own error)" in errors[7], errors[7]
        for msg in errors[8:10]:
            assert "group=a group of 4 ranks" in msg and "cp_size = 2" in msg, msg
        assert calls == []
        assert elapsed < 45  # far below the collective timeout (60 s here, 30 min by default)


def test_check_switch_and_group_errors(suites):
    assert _results(suites, 3, "_switch_and_groups") == [True] * 3


def test_sub_groups(suites):
    assert _results(suites, 4, "_subgroups") == [True] * 4


def test_harness_reports_rank_failures_and_timeouts():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed"):
        run_ranks(_fail_on_rank_one, 2, timeout=60)
    # the root cause, not the peer's "connection closed", and never a timeout for a pickling error
    with pytest.raises(RuntimeError, match=r"(?s)rank 2 of 3 failed:.*ValueError: boom in a collective"):
        run_ranks(_fail_in_collective, 3, timeout=60)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot leave its process"):
        run_ranks(_unpicklable, 2, timeout=100)
    assert time.monotonic() - start < 60
    # (rank 0 returns at once, unless a loaded machine takes 4 s to start it)
    with pytest.raises(TimeoutError, match=r"^ranks \[(0, )?1\] of 2 did not finish within 4s( \(ranks \[0\] "
                                           r"returned\))?: "
                                           r"they were killed\. A rank that waits in a collective .*"
                                           r"collective_timeout \(60s here\)\. Fix: "):
        run_ranks(_hang_on_rank_one, 2, timeout=4, collective_timeout=60)


def _killed_before_a_collective(rank, world):
    if rank == 1:
        time.sleep(0.3)
        os._exit(3)  # no traceback, no report: as a rank killed by the OOM killer
    dist.all_reduce(torch.ones(1))
    return rank


def _wrong_length_on_rank_one(rank, world):
    plan = ShardPlan.build([5, 3], cp_size=world)
    local = shard(torch.arange(8.0), plan, rank)
    return gather(local[:-1] if rank == 1 else local, plan, dist.group.WORLD, check=False).values()


def test_faults_are_reported_by_rank_well_before_the_collective_timeout():
    """A rank that dies without a word, and a rank whose tensor has the wrong length (refused on that
    rank before its collective, checks off): the caller hears which rank and why, and the peers
    waiting in the collective are listed after it, long before the 60 s collective timeout."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)^rank 1 of 2 failed:\nrank 1 exited with code 3 without "
                                           r"reporting.*\(ranks \[0\] failed after it\)"):
        run_ranks(_killed_before_a_collective, 2, timeout=100, collective_timeout=60)
    with pytest.raises(RuntimeError, match=r"(?s)^rank 1 of 2 failed:.*ValueError: local=tensor of shape \(5,\): "
                                           r"must lead with the plan's local_shape = \(6,\).*failed after it"):
        run_ranks(_wrong_length_on_rank_one, 2, timeout=100, collective_timeout=60)
    assert time.monotonic() - start < 50


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom")
    return rank


def _fail_in_collective(rank, world):
    """Rank 2 raises while the others wait in a collective (and then see the connection close)."""
    if rank == 2:
        time.sleep(0.5)
        raise ValueError("boom in a collective")
    dist.all_reduce(torch.ones(1))
    return rank


def _unpicklable(rank, world):
    return (lambda: rank) if rank == 1 else rank


def test_harness_returns_detached_cpu_tensors():
    out = run_ranks(_grad_tensor, 2, timeout=60)
    assert all(isinstance(t, torch.Tensor) and not t.requires_grad for t in out)
    assert [t.tolist() for t in out] == [[0.0, 2.0], [1.0, 3.0]]


def _grad_tensor(rank, world):
    return {"t": (torch.tensor([0.0, 2.0]) + rank).requires_grad_()}["t"] * 1


def _hang_on_rank_one(rank, world):
    if rank == 1:
        time.sleep(60)
    return rank


def test_no_process_group_is_a_clear_error():
    plan = ShardPlan.build([3], cp_size=2)
    with pytest.raises(ValueError, match="init_process_group"):
        gather(torch.zeros(plan.local_len), plan, dist.group.WORLD)


def test_one_rank_needs_no_group():
    """group=None at cp_size == 1, for every function (distributed._solo): what unshard gives, no
    torch.distributed needed."""
    from cpshard.distributed import all_gather_rows, shift_sharded, shift_sharded_multi, sum_over_group

    plan = ShardPlan.build([3, 2], cp_size=1, tp_size=2)
    x = torch.arange(plan.local_len, dtype=torch.float32)
    assert not dist.is_initialized()
    assert torch.equal(gather(x, plan, None, check=True).values(), unshard([x], plan).values())
    assert torch.equal(shift_sharded(x, plan, None, fill=-1), shard(unshard([x], plan), plan, 0, shift=1,
                                                                             fill=-1))
    multi = shift_sharded_multi([x], plan, None, shifts=[1, 2], fills=[-1])[0]
    assert torch.equal(multi[1], shard(unshard([x], plan), plan, 0, shift=2, fill=-1))
    assert torch.equal(sum_over_group(x, plan, None), x) and all_gather_rows(x, plan, None) is x
