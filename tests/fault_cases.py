"""Rank bodies for tests/test_faults.py: ranks that disagree about one call, checks off unless named.
Each returns what its rank saw: ``("ok", result)`` or ``("raised", type name, message, seconds)``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cpshard import ShardPlan, shard
from cpshard.distributed import gather, relayout, shift_sharded, shift_sharded_multi


def _world() -> Any:
    return dist.group.WORLD


def _seen(call: Callable[[], Any]) -> tuple[Any, ...]:
    start = time.monotonic()
    try:
        out = call()
    except (ValueError, TypeError) as exc:
        return ("raised", type(exc).__name__, str(exc), time.monotonic() - start)
    return ("ok", out)


def plans_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Plans of the same local length (12 tokens either way: 6 rows per rank), checks off."""
    plan = ShardPlan.build([6, 2] if rank == 0 else [2, 6], cp_size=world)
    local = shard(torch.arange(8.0), plan, rank)
    return [_seen(lambda: gather(local, plan, _world(), check=False).values()),
            _seen(lambda: shift_sharded(local, plan, _world(), shift=1, check=False))]


def dtypes_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """float32 on rank 0, int32 (the same width) elsewhere."""
    plan = ShardPlan.build([5, 3], cp_size=world)
    local = shard(torch.arange(8.0), plan, rank)
    local = local if rank == 0 else local.int()
    return [_seen(lambda: gather(local, plan, _world(), check=False).values()),
            _seen(lambda: shift_sharded(local, plan, _world(), shift=1, check=False)),
            _seen(lambda: shift_sharded_multi([local], plan, _world(), shifts=[1, 2], check=False))]


def shifts_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Another fill value on rank 1; then shift 1 on rank 0 and -1 on rank 1 (one contiguous sequence:
    each rank sends the other only a header, where it expects a row more)."""
    plan = ShardPlan.build([9, 7], cp_size=world)
    local = shard(torch.arange(16.0), plan, rank)
    one = ShardPlan.build([8], cp_size=world, layout="contiguous")
    mine = shard(torch.arange(8.0), one, rank)
    return [_seen(lambda: shift_sharded(local, plan, _world(), shift=1, fill=-1 if rank == 1 else 0, check=False)),
            _seen(lambda: shift_sharded(mine, one, _world(), shift=-1 if rank == 1 else 1, check=False)),
            _seen(lambda: shift_sharded_multi([local], plan, _world(), shifts=[1, 2], fills=[-1 if rank == 1 else 0],
                                              check=False))]


def checks_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """check=True on rank 0 only; the gather's message is as long as the check's (272 bytes)."""
    plan = ShardPlan.build([48, 56], cp_size=world, layout="contiguous")  # 52 float32 rows per rank: 208 bytes
    assert plan.local_len == 52
    local = shard(torch.arange(104.0), plan, rank)
    return [_seen(lambda: gather(local, plan, _world(), check=rank == 0).values())]


def relayout_plans_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """The twins of two plans of the same local length ([12, 4] and [4, 12]), zigzag to contiguous."""
    from cpshard import twin_plan
    plan = ShardPlan.build([12, 4] if rank == 0 else [4, 12], cp_size=world)
    local = shard(torch.arange(16.0), plan, rank)
    return [_seen(lambda: relayout(local, plan, twin_plan(plan, "contiguous"), _world(), check=False))]


def checks_differ_sizes(rank: int, world: int) -> list[tuple[Any, ...]]:
    """check=True on rank 0 only, a gather of another size than the check: measured, not asserted."""
    plan = ShardPlan.build([500, 300], cp_size=world)
    local = shard(torch.arange(800.0), plan, rank)
    return [_seen(lambda: gather(local, plan, _world(), check=rank == 0).values())]


# -- every other collective: losses, sums, the scan's state gather, the attention's key/value gather ----


def _loss_inputs(plan: Any, rank: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    n = plan.local_len if rows is None else rows
    return torch.arange(n, dtype=torch.float64) + 1, plan.token_mask(rank)[:n] if rows is None else torch.ones(n)


def loss_plans_differ(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Checks off: plans of one local length ([5, 3] and [8, 4]: 6 rows a rank), zigzag against
    contiguous, another plan of as many sequences, another grad_reduction: no rank returns a share."""
    from cpshard.distributed import sum_over_group
    from cpshard.loss import sequence_mean, token_mean

    group = _world()
    plan = ShardPlan.build([5, 3] if rank == 0 else [8, 4], cp_size=world)
    v, m = _loss_inputs(plan, rank)
    layout = ShardPlan.build([5, 3], cp_size=world, layout="zigzag" if rank == 0 else "contiguous")
    lv, lm = _loss_inputs(layout, rank)
    same = ShardPlan.build([5, 3], cp_size=world)
    sv, sm = _loss_inputs(same, rank)
    return [_seen(lambda: token_mean(v, m, plan, group, check=False)),
            _seen(lambda: token_mean(lv, lm, layout, group, check=False)),
            _seen(lambda: sequence_mean(v, m, plan, group, check=False)),
            _seen(lambda: token_mean(sv, sm, same, group, grad_reduction="mean" if rank == 0 else "sum", check=False)),
            _seen(lambda: sum_over_group(torch.ones(3), plan, group, check=False))]


def loss_checks_on(rank: int, world: int) -> list[tuple[Any, ...]]:
    """set_checks(True): other plans (also of another number of sequences, whose count sums differ in
    size), bad input on rank 1, a loss without a collective of its own: every rank raises at once."""
    from cpshard.distributed import set_checks
    from cpshard.loss import sequence_mean, token_mean, token_sum

    group = _world()
    previous = set_checks(True)
    try:
        plan = ShardPlan.build([5, 3] if rank == 0 else [8, 4], cp_size=world)
        v, m = _loss_inputs(plan, rank)
        seqs = ShardPlan.build([5, 3] if rank == 0 else [4, 4, 4], cp_size=world)
        qv, qm = _loss_inputs(seqs, rank)
        same = ShardPlan.build([5, 3], cp_size=world)
        sv, sm = _loss_inputs(same, rank)
        bad = sv[:-1] if rank == 1 else sv
        return [_seen(lambda: token_mean(v, m, plan, group)),
                _seen(lambda: sequence_mean(qv, qm, seqs, group)),
                _seen(lambda: token_mean(bad, sm, same, group)),
                _seen(lambda: sequence_mean(bad, sm, same, group, dp_group=None)),
                _seen(lambda: token_sum(v, m, plan, group))]
    finally:
        set_checks(previous)


def loss_unchecked(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Checks off: rank 1's num_tokens is negative (no collective: it raises alone, rank 0 returns);
    then the group is usable."""
    from cpshard.loss import token_mean

    group = _world()
    plan = ShardPlan.build([5, 3], cp_size=world)
    v, m = _loss_inputs(plan, rank)
    return [_seen(lambda: token_mean(v, m, plan, group, num_tokens=torch.tensor(-5.0) if rank == 1 else 7.0,
                                     check=False)),
            _seen(lambda: float(token_mean(v, m, plan, group, check=False)))]


def loss_dp(rank: int, world: int) -> list[tuple[Any, ...]]:
    """cp = 1 on every rank, the world as the DP group: with checks on, rank 1's bad input reaches rank
    0 through the DP count; different losses over one DP group (token_mean against sequence_mean)
    raise on both, checks off."""
    from cpshard.loss import sequence_mean, token_mean

    dp = _world()
    plan = ShardPlan.build([5, 3] if rank == 0 else [2, 6, 1], cp_size=1)
    v, m = _loss_inputs(plan, 0)
    bad = v[:-1] if rank == 1 else v
    other = token_mean if rank == 0 else sequence_mean
    return [_seen(lambda: token_mean(bad, m, plan, None, dp_group=dp, check=True)),
            _seen(lambda: other(v, m, plan, None, dp_group=dp)),
            _seen(lambda: float(token_mean(v, m, plan, None, dp_group=dp)))]


def scan_checked(rank: int, world: int) -> list[tuple[Any, ...]]:
    """linear_scan with checks on: another dtype (float32 / float64) or trailing shape on rank 1, or
    rank 1's rows the wrong length: every rank raises before the state gather (gloo aborted before)."""
    from cpshard.distributed import set_checks
    from cpshard.scan import linear_scan

    group = _world()
    plan = ShardPlan.build([9, 5], cp_size=world, layout="contiguous")
    a = torch.full((plan.local_len, 2), 0.5, dtype=torch.float64)
    previous = set_checks(True)
    try:
        return [_seen(lambda: linear_scan(a.float() if rank == 1 else a, a.float() if rank == 1 else a, plan, group)),
                _seen(lambda: linear_scan(a[:, :1] if rank == 1 else a, a[:, :1] if rank == 1 else a, plan, group)),
                _seen(lambda: linear_scan(a[1:] if rank == 1 else a, a[1:] if rank == 1 else a, plan, group)),
                _seen(lambda: linear_scan(a, a, plan, group).shape)]
    finally:
        set_checks(previous)


def pad_rank_backward(rank: int, world: int) -> list[tuple[Any, ...]]:
    """The attention's backward where rank 1's rows are all pad rows (lengths [1]): every rank joins
    the key/value-gradient all_reduce (rank 1 skipped it before, and rank 0 waited); then the scan."""
    from cpshard.attention import attention

    group = _world()
    plan = ShardPlan.build([1], cp_size=world)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(plan.local_len, 2, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))

    def step() -> tuple[float, float]:
        out = attention(q, k, v, plan, group)
        (out + q).sum().backward()
        return float(k.grad.abs().sum()), float(v.grad.abs().sum())
    return [_seen(step)]


def sequence_counts_differ_sizes(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Checks off, sequence_mean over 2 sequences on rank 0 and 3 on rank 1: count sums of different
    sizes (measured, not designed: gloo aborts a rank; with checks on, loss_checks_on)."""
    from cpshard.loss import sequence_mean

    plan = ShardPlan.build([5, 3] if rank == 0 else [4, 4, 4], cp_size=world)
    v, m = _loss_inputs(plan, rank)
    return [_seen(lambda: sequence_mean(v, m, plan, _world(), check=False))]


# -- every argument of every public collective, flipped on rank 1 (docs/guarantees.md, "Every argument") --


def _flip(rank: int, here: Any, there: Any) -> Any:
    return there if rank == 1 else here


def _mtp_call(plan: Any, rank: int, *, labels: str = "sharded", check: bool | None = None, **kw: Any) -> Any:
    """mtp_loss of 2 depths over lengths [9, 7] (the labels sharded, or the whole batch): the depth losses."""
    import torch.nn.functional as F

    from cpshard.mtp import mtp_loss

    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(plan.local_len, 3, generator=g, dtype=torch.float64) for _ in range(3)]
    w = torch.randn(5, 3, generator=g, dtype=torch.float64)
    whole = [torch.arange(9) % 5, torch.arange(7) % 3]
    source = whole if labels == "whole" else shard(whole, plan, rank)
    mask = None if labels == "whole" else shard([torch.ones(9), torch.ones(7)], plan, rank)
    out = mtp_loss(chunks, source, mask, plan, _world(), output_layer=lambda x: x @ w.T,
                   loss_fn=lambda y, z: F.cross_entropy(z, y.reshape(-1), reduction="none"), check=check, **kw)
    return out.losses


def _drop_in(plan: Any, rank: int, *, scaling: float = 0.1, per_token: bool = False) -> Any:
    """Megatron's process_mtp_loss drop-in, BSHD [1, 8] rows a rank at cp = 2 (its config read)."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from cpshard.megatron import process_mtp_loss

    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=g, dtype=torch.float64)
    hidden = torch.randn(3 * 8, 1, 3, generator=g, dtype=torch.float64)
    labels = (torch.arange(8) + rank).remainder(5)[None]
    config = SimpleNamespace(mtp_num_layers=2, mtp_loss_scaling_factor=scaling, calculate_per_token_loss=per_token)
    return process_mtp_loss(hidden, labels, torch.ones(1, 8), lambda x, **_: (x @ w.T, None), None, None, False,
                            lambda y, z: F.cross_entropy(z.transpose(0, 1).reshape(-1, 5), y.reshape(-1),
                                                         reduction="none").view(1, 8),
                            config, cp_group=_world())


def _every_argument_calls(rank: int, world: int) -> list[tuple[str, Callable[[], Any]]]:
    """(argument, call) for each result-changing argument of each public collective, rank 1's another."""
    from cpshard import twin_plan
    from cpshard.attention import attention, naive_attention
    from cpshard.distributed import all_gather_rows, gather_states, gather_tokens, sum_over_group
    from cpshard.loss import sequence_mean, token_mean, token_sum
    from cpshard.mtp import mtp_targets
    from cpshard.scan import linear_scan

    group = _world()
    plan = ShardPlan.build([9, 7], cp_size=world)
    x = shard(torch.arange(16.0), plan, rank)
    v, m = _loss_inputs(plan, rank)
    qkv = torch.randn(plan.local_len, 2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    whole = [torch.arange(9), torch.arange(7)]
    labels = shard(whole, plan, rank)
    singles = [dist.new_group([r]) for r in range(world)]  # a DP group of one rank each, created by every rank
    contiguous = twin_plan(plan, "contiguous")
    a = torch.full((contiguous.local_len, 2), 0.5, dtype=torch.float64)
    return [
        ("dtype", lambda: gather(_flip(rank, x, x.double()), plan, group)),
        ("row shape", lambda: gather_tokens(_flip(rank, x[:, None], x[:, None].expand(-1, 2)), plan, group)),
        ("shift", lambda: shift_sharded(x, plan, group, shift=_flip(rank, 1, 2))),
        ("pad_value", lambda: shift_sharded(x, plan, group, pad_value=_flip(rank, 0, -1))),
        ("fill", lambda: shift_sharded(x, plan, group, fill=_flip(rank, 0.0, -0.0))),  # exact bits
        ("shifts", lambda: shift_sharded_multi([x], plan, group, shifts=_flip(rank, [1, 2], [1, 3]))),
        ("fills", lambda: shift_sharded_multi([x], plan, group, shifts=[1], fills=[_flip(rank, 0, 7)])),
        ("dst_plan", lambda: relayout(x, plan, twin_plan(plan, _flip(rank, "contiguous", "zigzag")), group)),
        ("row shape", lambda: all_gather_rows(_flip(rank, x[:, None], x[:, None].expand(-1, 2)), plan, group)),
        ("dtype", lambda: gather_states(_flip(rank, x[:2], x[:2].double()), plan, group)),
        ("row shape", lambda: sum_over_group(_flip(rank, torch.ones(2), torch.ones(3)), plan, group)),
        ("grad_reduction", lambda: token_mean(v, m, plan, group, grad_reduction=_flip(rank, "mean", "sum"))),
        ("num_tokens", lambda: token_mean(v, m, plan, group, num_tokens=_flip(rank, 10, 10.5))),
        ("num_tokens", lambda: token_mean(v, m, plan, group, num_tokens=_flip(rank, None, 10))),
        ("token_reduction", lambda: sequence_mean(v, m, plan, group, token_reduction=_flip(rank, "mean", "sum"))),
        ("num_seqs", lambda: sequence_mean(v, m, plan, group, num_seqs=_flip(rank, 2, torch.tensor(3.0)))),
        ("grad_reduction", lambda: token_sum(v, m, plan, group, grad_reduction=_flip(rank, "mean", "sum"))),
        ("num_depths", lambda: mtp_targets(labels, None, plan, group, num_depths=_flip(rank, 2, 3))),
        ("label_fill", lambda: mtp_targets(whole, None, plan, group, num_depths=2, label_fill=_flip(rank, 0, -1))),
        ("labels", lambda: mtp_targets(_flip(rank, whole, labels), None, plan, group, num_depths=2)),
        ("scaling_factor", lambda: _mtp_call(plan, rank, scaling_factor=_flip(rank, 0.1, 0.1 + 2**-50))),
        ("normalization", lambda: _mtp_call(plan, rank, normalization=_flip(rank, "mean", "per_token"))),
        ("counts", lambda: _mtp_call(plan, rank, labels="whole", counts=_flip(rank, "global", "local"))),
        ("grad_reduction", lambda: _mtp_call(plan, rank, labels="whole", grad_reduction=_flip(rank, "mean", "sum"))),
        ("scale", lambda: attention(qkv, qkv, qkv, plan, group, scale=_flip(rank, None, 0.3))),
        ("naive", lambda: _flip(rank, attention, naive_attention)(qkv, qkv, qkv, plan, group)),
        ("dtype", lambda: relayout(_flip(rank, x, x.double()), plan, twin_plan(plan, "contiguous"), group)),
        ("pad_values", lambda: shift_sharded_multi([x], plan, group, shifts=[1], pad_values=[_flip(rank, None, 3)])),
        ("grad_reduction", lambda: sequence_mean(v, m, plan, group, grad_reduction=_flip(rank, "mean", "sum"))),
        ("dp_group", lambda: token_mean(v, m, plan, group, dp_group=_flip(rank, None, singles[rank]))),
        (_flip(rank, "labels", "input_ids"),
         lambda: mtp_targets(*_flip(rank, (labels, None), (None, labels)), plan, group, num_depths=2,
                             input_ids=labels)),
        ("loss_mask", lambda: mtp_targets(labels, _flip(rank, None, labels.float()), plan, group, num_depths=2)),
        ("scaling_factor", lambda: _drop_in(plan, rank, scaling=_flip(rank, 0.1, 0.3))),
        ("dtype", lambda: linear_scan(_flip(rank, a, a.float()), _flip(rank, a, a.float()), contiguous, group)),
    ]


def every_argument_checked(rank: int, world: int) -> list[tuple[Any, ...]]:
    """set_checks(True): every flip raises on every rank, in the agreement, naming the argument."""
    from cpshard.distributed import set_checks

    previous = set_checks(True)
    try:
        return [(argument, _seen(call)) for argument, call in _every_argument_calls(rank, world)]
    finally:
        set_checks(previous)


def every_argument_unchecked(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Checks off: the flips whose collective carries the argument (the header or the trailer) raise
    on every rank; a count given to a call that makes no collective is each rank's own."""
    from cpshard.attention import attention, naive_attention
    from cpshard.loss import sequence_mean, token_mean

    group = _world()
    plan = ShardPlan.build([9, 7], cp_size=world)
    v, m = _loss_inputs(plan, rank)
    qkv = torch.randn(plan.local_len, 2, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    calls = [
        ("scale", lambda: attention(qkv, qkv, qkv, plan, group, scale=_flip(rank, 0.5, 0.3), check=False)),
        ("naive", lambda: _flip(rank, attention, naive_attention)(qkv, qkv, qkv, plan, group, check=False)),
        ("scaling_factor", lambda: _mtp_call(plan, rank, scaling_factor=_flip(rank, 0.1, 0.2), check=False)),
        ("normalization", lambda: _mtp_call(plan, rank, normalization=_flip(rank, "mean", "per_token"), check=False)),
        ("counts", lambda: _mtp_call(plan, rank, counts=_flip(rank, "global", "local"), check=False)),
        ("grad_reduction", lambda: _mtp_call(plan, rank, grad_reduction=_flip(rank, "mean", "sum"), check=False)),
        ("scaling_factor", lambda: _mtp_call(plan, rank, labels="whole", scaling_factor=_flip(rank, 0.1, 0.2),
                                             check=False)),
        ("num_tokens", lambda: float(token_mean(v, m, plan, group, num_tokens=_flip(rank, 10, 12), check=False))),
        ("num_seqs", lambda: float(sequence_mean(v, m, plan, group, num_seqs=_flip(rank, 2, 3), check=False))),
        ("normalization", lambda: _drop_in(plan, rank, per_token=_flip(rank, False, True))),
    ]
    return [(argument, _seen(call)) for argument, call in calls]


# -- refusals inside the agreement: a rank that refuses its own input, checks on ---------------------


def _mtp_case(plan: Any, rank: int, **bad: Any) -> Callable[[], Any]:
    """mtp_loss on this rank's rows (two depths, labels sharded), with rank 1's ``bad`` arguments."""
    import torch.nn.functional as F

    from cpshard.mtp import mtp_loss

    g = torch.Generator().manual_seed(rank)
    kw: dict[str, Any] = {"hidden_states": torch.randn(3 * plan.local_len, 4, generator=g, dtype=torch.float64),
                          "labels": shard(torch.arange(8) % 5, plan, rank), "num_depths": 2, "check": True}
    if rank == 1:
        kw.update(bad)
    weight = torch.randn(5, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    return lambda: float(mtp_loss(kw.pop("hidden_states"), kw.pop("labels"), None, plan, _world(),
                                  output_layer=lambda h: h @ weight.T,
                                  loss_fn=lambda y, z: F.cross_entropy(z, y, reduction="none"), **kw).losses.sum())


def refusals_checked(rank: int, world: int) -> list[tuple[Any, ...]]:
    """check=True, rank 1 refuses its own input where it used to raise before the agreement (its peers
    then waited): the scan of a zigzag plan (rank 0's is contiguous), gather_states of None and of a
    nested tensor, mtp_loss with chunks that do not split, label rows of another length, a
    scaling_factor that is no number; mtp_targets with label rows of another length."""
    from cpshard.distributed import gather_states
    from cpshard.mtp import mtp_targets
    from cpshard.scan import linear_scan

    group = _world()
    plan = ShardPlan.build([5, 3], cp_size=world)
    scan_plan = ShardPlan.build([9, 5], cp_size=world, layout="zigzag" if rank == 1 else "contiguous")
    a = torch.full((scan_plan.local_len, 2), 0.5, dtype=torch.float64)
    states = torch.ones(2, 3)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    labels = shard(torch.arange(8) % 5, plan, rank)
    hidden = torch.zeros(3 * plan.local_len, 4, dtype=torch.float64)
    return [_seen(lambda: linear_scan(a, a, scan_plan, group, check=True)),
            _seen(lambda: gather_states(None if rank == 1 else states, plan, group, check=True).shape),
            _seen(lambda: gather_states(nested if rank == 1 else states, plan, group, check=True).shape),
            _seen(_mtp_case(plan, rank, hidden_states=hidden[1:])),
            _seen(_mtp_case(plan, rank, labels=labels[1:])),
            _seen(_mtp_case(plan, rank, scaling_factor="0.1")),
            _seen(lambda: mtp_targets(labels[1:] if rank == 1 else labels, None, plan, group, num_depths=2,
                                      check=True)[0].shape),
            _seen(_mtp_case(plan, rank))]


def meta_checked(rank: int, world: int) -> list[tuple[Any, ...]]:
    """check=True, rank 1's tensors on the meta device (torch's collectives return on them without
    communicating: rank 1 returned a meta "result" and rank 0 waited): every collective, the losses,
    the scan and the attention refuse them inside the agreement."""
    from cpshard.attention import attention
    from cpshard.distributed import all_gather_rows, sum_over_group
    from cpshard.loss import token_mean
    from cpshard.scan import linear_scan

    group = _world()
    plan = ShardPlan.build([5, 3], cp_size=world)
    cont = ShardPlan.build([5, 3], cp_size=world, layout="contiguous")

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to("meta") if rank == 1 else t

    local = shard(torch.arange(8.0), plan, rank)
    qkv = torch.ones(plan.local_len, 2, 4, dtype=torch.float64)
    rows = torch.ones(plan.local_len, 2)
    scan_rows = torch.ones(cont.local_len, 2, dtype=torch.float64)
    return [_seen(lambda: gather(on(local), plan, group, check=True).values()),
            _seen(lambda: shift_sharded(on(local), plan, group, shift=1, check=True)),
            _seen(lambda: shift_sharded_multi([on(local)], plan, group, shifts=[1, 2], check=True)),
            _seen(lambda: all_gather_rows(on(rows), plan, group, check=True)),
            _seen(lambda: sum_over_group(on(torch.ones(2)), plan, group, check=True)),
            _seen(lambda: token_mean(on(rows[:, 0].double()), plan.token_mask(rank), plan, group, check=True)),
            _seen(lambda: linear_scan(on(scan_rows), on(scan_rows), cont, group, check=True)),
            _seen(lambda: attention(on(qkv), on(qkv), on(qkv), plan, group, check=True)),
            _seen(lambda: float(token_mean(rows[:, 0].double(), plan.token_mask(rank), plan, group, check=True)))]


def counts_refused(rank: int, world: int) -> list[tuple[Any, ...]]:
    """num_tokens below the tokens a rank holds (it returned the plain sum before): with checks on,
    rank 1's refusal reaches rank 0 through the agreement; checks off, every rank given 0 raises its
    own (no collective follows a given count)."""
    from cpshard.loss import token_mean

    group = _world()
    plan = ShardPlan.build([5, 3], cp_size=world)
    v, m = _loss_inputs(plan, rank)
    return [_seen(lambda: token_mean(v, m, plan, group, num_tokens=0 if rank == 1 else 8, check=True)),
            _seen(lambda: token_mean(v, m, plan, group, num_tokens=0, check=False)),
            _seen(lambda: float(token_mean(v, m, plan, group, num_tokens=8, check=True)))]


def megatron_refusal(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Checks on, Megatron's process_mtp_loss drop-in where rank 1's labels describe no plan (an odd
    local length under cp = 2): it raised before any agreement and rank 0 waited in mtp_loss's."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from cpshard.distributed import set_checks
    from cpshard.megatron import process_mtp_loss

    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    config = SimpleNamespace(mtp_num_layers=2, mtp_loss_scaling_factor=0.1, calculate_per_token_loss=False)

    def call(s: int) -> Any:
        hidden = torch.randn(3 * s, 1, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        labels = (torch.arange(s) + rank).remainder(5)[None]
        out = process_mtp_loss(hidden, labels, torch.ones(1, s), lambda x, **_: (x @ w.T, None), None, None, False,
                               lambda y, z: F.cross_entropy(z.transpose(0, 1).reshape(-1, 5), y.reshape(-1),
                                                            reduction="none").view(1, s), config, cp_group=_world())
        return tuple(out.shape)

    def caused() -> Any:  # the refusing rank's own error, chained under the verdict
        try:
            return call(7 if rank == 1 else 8)
        except ValueError as exc:
            cause = exc.__cause__
            raise ValueError(f"{exc} | cause: {cause}") from None

    previous = set_checks(True)
    try:
        return [_seen(caused), _seen(lambda: call(8))]
    finally:
        set_checks(previous)


# -- a fresh adversarial pass (issue 38): new cases, each failing before its fix -----------------------


def _backward(out: torch.Tensor) -> float:
    """The call's result summed, after ``backward()`` where autograd recorded it (its collective then runs)."""
    if out.requires_grad:
        out.sum().backward()
    return float(out.detach().sum())


def adversary_grad(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Rank 1's tensors require no gradient (or it runs under no_grad) while rank 0's do: rank 1 returned
    and rank 0 waited in the backward collective rank 1 never made (attention, the scan, shift_sharded,
    relayout, all_gather_rows). Now ``requires_grad`` is agreed on (checks on) and carried by the
    forward's header (checks off): every rank raises in forward."""
    from cpshard import twin_plan
    from cpshard.attention import attention
    from cpshard.distributed import all_gather_rows
    from cpshard.scan import linear_scan

    group = _world()
    plan = ShardPlan.build([9, 7], cp_size=world)
    cont = twin_plan(plan, "contiguous")
    grad = rank == 0

    def q() -> torch.Tensor:
        return torch.randn(plan.local_len, 2, 4, generator=torch.Generator().manual_seed(rank),
                           dtype=torch.float64).requires_grad_(grad)

    def x(rows: int = plan.local_len) -> torch.Tensor:
        return torch.full((rows, 2), 0.5, dtype=torch.float64).requires_grad_(grad)

    def no_grad_on_1(call: Callable[[], Any]) -> Any:
        with torch.set_grad_enabled(rank == 0):
            return call()

    return [_seen(lambda: _backward(attention(q(), q(), q(), plan, group, check=False))),
            _seen(lambda: _backward(shift_sharded(x(), plan, group, shift=1, check=False))),
            _seen(lambda: _backward(relayout(x(), plan, cont, group, check=True))),
            _seen(lambda: _backward(all_gather_rows(x(), plan, group, check=False))),
            _seen(lambda: _backward(no_grad_on_1(lambda: linear_scan(x(cont.local_len).detach().requires_grad_(),
                                                                     x(cont.local_len).detach(), cont, group,
                                                                     check=True)))),
            _seen(lambda: _backward(attention(q().detach().requires_grad_(), q(), q(), plan, group, check=True)))]


def adversary_inputs(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Checks on, rank 1's whole-batch labels or mask of another length or count, and a label_fill that
    only rank 0's integer labels cannot take: sharded after the agreement, they raised on that rank
    alone while its peer waited in the count sum (or returned). Then counts: an infinite num_tokens
    returned 0 on every rank; a NaN weight in rank 1's mask made rank 0 return its plain sum; and
    ``grad_reduction="mean"`` against ``"MEAN"`` (one convention), and ``label_fill`` 0 against
    ``np.int64(0)``, refused."""
    import numpy as np

    from cpshard import GradReduction
    from cpshard.loss import sequence_mean, token_mean
    from cpshard.mtp import mtp_targets

    group = _world()
    plan = ShardPlan.build([9, 7], cp_size=world)
    whole = [torch.arange(9) % 5, torch.arange(7) % 5]
    v = torch.ones(plan.local_len, dtype=torch.float64)
    nan_mask = plan.token_mask(rank).double()
    nan_mask[0] = float("nan") if rank == 1 else nan_mask[0]
    return [_seen(lambda: _mtp_whole(plan, _flip(rank, whole, [whole[0], whole[1][:6]]))),
            _seen(lambda: _mtp_whole(plan, whole + ([torch.arange(3)] if rank == 1 else []))),
            _seen(lambda: mtp_targets(_flip(rank, whole, [t.float() for t in whole]), None, plan, group, num_depths=2,
                                      label_fill=0.5, check=True)[0].shape),
            _seen(lambda: token_mean(v, plan.token_mask(rank), plan, group, num_tokens=float("inf"), check=False)),
            _seen(lambda: float(token_mean(v, nan_mask, plan, group, check=False))),
            _seen(lambda: float(sequence_mean(v, nan_mask, plan, group, check=False))),
            _seen(lambda: float(token_mean(v, plan.token_mask(rank), plan, group, check=True))),
            # one convention spelled two ways: it refused before ("disagree about this reduction")
            _seen(lambda: float(token_mean(v, plan.token_mask(rank), plan, group, check=False,
                                           grad_reduction=_flip(rank, "mean", "MEAN")))),
            _seen(lambda: float(sequence_mean(v, plan.token_mask(rank), plan, group, check=True,
                                              grad_reduction=_flip(rank, GradReduction.SUM, "Sum")))),
            # label_fill 0 against NumPy's 0 (one value): refused before, checks on and off
            *[_seen(lambda check=check: mtp_targets(shard(whole, plan, rank), None, plan, group, num_depths=2,
                                                    label_fill=_flip(rank, 0, np.int64(0)), check=check)[0].shape)
              for check in (True, False)]]


def _mtp_whole(plan: Any, labels: list[torch.Tensor]) -> Any:
    """mtp_targets of whole-batch labels, checks on: the labels of every depth."""
    from cpshard.mtp import mtp_targets

    return mtp_targets(labels, None, plan, _world(), num_depths=2, check=True)[0].shape


def adversary_check_values(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Rank 1 passes a ``check`` that is no bool while rank 0 passes ``check=True``: rank 1 raised its
    TypeError before any collective, and rank 0's agreement paired with rank 1's next call (its first
    gather returned, its loss and MTP loss then failed inside gloo). Now the bad value joins the
    agreement as rank 1's refusal: every rank raises. Last, two functions whose arguments read alike:
    the operation is agreed on too."""
    from cpshard.distributed import gather_tokens, sum_over_group
    from cpshard.loss import token_mean

    group = _world()
    plan = ShardPlan.build([9, 7], cp_size=world)
    x = shard(torch.arange(16.0), plan, rank)
    v, m = _loss_inputs(plan, rank)
    others = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    return [_seen(lambda: gather(x, plan, group, check=_flip(rank, True, "yes")).values()),
            _seen(lambda: token_mean(v, m, plan, group, check=_flip(rank, True, 1))),
            _seen(lambda: _mtp_call(plan, rank, check=_flip(rank, True, "on"))),
            _seen(lambda: gather(x, plan, group, check=True).values().shape),
            # checks on, another function whose arguments read alike (rows (L,) and one 0-d value: dtype
            # float32, row shape ()): the agreement passed and the ranks waited in an all-gather and an all-reduce
            _seen(lambda: gather_tokens(x, plan, group, check=True) if rank == 0 else
                  sum_over_group(torch.ones(()), plan, group, check=True)),
            # a dp_group this rank is not in: refused inside the agreement, its fix naming the DP group
            _seen(lambda: token_mean(v, m, plan, group, dp_group=others[1 - rank], check=True))]


def adversary_sums(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Complex sums: ``sum_over_group`` and ``sum_over`` of complex64 crashed on every rank inside torch
    ("Tensor must have a storage_offset divisible by 2": the pairs after an odd-length trailer);
    ``max_over`` of complex values has no meaning and is refused by name."""
    from cpshard.distributed import max_over, sum_over, sum_over_group

    plan = ShardPlan.build([9, 7], cp_size=world)
    z = torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64) * (rank + 1)
    return [_seen(lambda: sum_over_group(z, plan, _world())), _seen(lambda: sum_over(z.to(torch.complex128), _world())),
            _seen(lambda: max_over(z, _world()))]
