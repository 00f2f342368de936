"""Stamped reductions: every ``all_reduce`` cpshard makes carries a trailer reduced in the same
collective -- a failure word and the call's digest -- so that ranks that disagree (plan, layout,
reduction kind, gradient convention) raise on every rank instead of returning different results,
checks on or off (Note [Stamped reductions] in ``distributed/header.py``).

:func:`sum_over_group` (token counts over the CP group), :func:`sum_over` and :func:`max_over` (any
group), and :func:`reduce_over` for the losses of layer 5, which stamp their own call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from cpshard.base.errors import check_real, check_tensor, fail
from cpshard.distributed import header as _header
from cpshard.distributed.checks import checked_call
from cpshard.distributed.groups import collective_device, require_group, solo
from cpshard.distributed.stamp import Stamp
from cpshard.plan.values import Plan

__all__ = ["max_over", "reduce_over", "sum_over", "sum_over_group"]


@functools.lru_cache(maxsize=256)
def _trailers(word: int, dtype: torch.dtype, ranks: int, reduce: str,
              failed: bool) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """This rank's trailer (Note [Stamped reductions]) as ints and as a CPU tensor, and what the
    reduced trailer is when every rank contributed the same (read-only: each call copies them)."""
    mine = _header.trailer(word, dtype, ranks, reduce, failed)
    scale = ranks if reduce == "sum" else 1
    return mine, torch.tensor(mine, dtype=dtype), torch.tensor([0] + [scale * m for m in mine[1:]], dtype=dtype)


def reduce_over(values: torch.Tensor, group: Any, *, op: str, plans: Sequence[Plan] = (),
                call: dict[str, Any] | None = None, checked: bool = False, failed: bool = False,
                reduce: str = "sum") -> torch.Tensor:
    """``values`` reduced (``"sum"`` or ``"max"``) over ``group`` in one stamped ``all_reduce`` (Note
    [Stamped reductions] in ``distributed/header.py``), for a call of layer 5 named ``op`` with ``plans`` and
    ``call`` (what every rank must pass alike). ``failed``: this rank rejected its input and joins
    only so that its peers raise too (``values`` then only give the size). Raises ``ValueError`` on
    every rank that sees a failure word or another call's digest. No gradient flows."""
    require_group(group)
    if failed:  # only the size counts; on the group's device (CUDA under NCCL)
        values = torch.zeros(values.shape, dtype=values.dtype, device=collective_device(group))
    stamp = Stamp(op, dist.get_rank(group), checked, tuple(plans), dict(call or {}))
    return reduce_stamped(values, group, stamp, reduce, failed)


def reduce_stamped(values: torch.Tensor, group: Any, stamp: Stamp, reduce: str = "sum",
                    failed: bool = False) -> torch.Tensor:
    """One ``all_reduce`` of ``values`` led by the trailer of ``stamp`` (Note [Stamped reductions])."""
    wide = values.detach().reshape(-1).to(_header.reduction_dtype(values.dtype))
    real = torch.view_as_real(wide).reshape(-1) if wide.is_complex() else wide
    ranks = dist.get_world_size(group)
    mine, trailer, expected = _trailers(stamp.reduction_word(real.numel(), reduce), real.dtype, ranks, reduce, failed)
    buf = torch.cat([trailer.to(real.device, non_blocking=True), real])
    dist.all_reduce(buf, op=dist.ReduceOp.SUM if reduce == "sum" else dist.ReduceOp.MAX, group=group)
    head, body = buf[:len(mine)], buf[len(mine):]
    if head.device.type == "cpu":
        if not torch.equal(head, expected):
            verdict = _header.trailer_mismatch(head.tolist(), mine, ranks, reduce) or "differs"
            raise ValueError(_reduction_error(stamp, verdict))
    else:  # on the device, no host sync: a device-side assertion, as the headers' (verify_headers)
        torch._assert_async((head == expected.to(head.device, non_blocking=True)).all())
    if wide.is_complex():  # a copy: after an odd-length trailer the pairs' storage offset is odd
        body = torch.view_as_complex(body.reshape(-1, 2).clone())
    return body.view(values.shape).to(values.dtype)


def _reduction_error(stamp: Stamp, verdict: str) -> str:
    if verdict == "failed":
        return (f"{stamp.op}: a rank of the group rejected its input (its own error says why; this is rank "
                f"{stamp.rank}). Fix: correct the input on that rank; it joined this sum with a failure word so "
                "that no rank of the group waits for it.")
    passed = ", ".join(f"{k}={v}" for k, v in stamp.call.items())
    passed = f" This rank passed {passed}." if passed else ""
    return (f"{stamp.op}: the ranks of the group disagree about this reduction (this is rank {stamp.rank}): "
            "another rank folded another call's digest into the sum (its plan, the number or dtype of the "
            "values, the operation or its arguments, or the check setting differ, or it runs another collective "
            f"here).{passed} Its result would be wrong, so no rank returns it. Fix: call it on every rank with the "
            "same plan and arguments; check=True (or set_checks(True)) on every rank names the ranks and their plans.")


def sum_over_group(values: torch.Tensor, plan: Plan, group: Any, *, check: bool | None = None) -> torch.Tensor:
    """``values`` summed over the ranks of ``group`` (one ``all_reduce``), as a new tensor.

    For token counts; the group's size must be ``plan.cp_size``. No gradient flows. The sum carries
    a trailer of the call (plan, dtype, shape; Note [Stamped reductions] in ``cpshard/distributed/header.py``): ranks
    that sum something else raise a ``ValueError`` instead of returning. ``check``: as in
    :func:`gather` (the agreement first, which names the ranks and plans).
    """
    def validate() -> tuple[torch.Tensor, dict[str, Any]]:
        checked = check_real("values", check_tensor("values", values))
        return checked, {"dtype": checked.dtype, "row shape": tuple(checked.shape)}

    values, rank, call, ran_check = checked_call(plan, group, check, validate, "sum_over_group")
    if solo(plan, group):
        return values.detach().clone()
    return reduce_stamped(values, group, Stamp("sum_over_group", rank, ran_check, (plan,), call))


def sum_over(values: torch.Tensor, group: Any) -> torch.Tensor:
    """``values`` summed over the ranks of any ``group`` (one ``all_reduce``), as a new tensor.

    For totals over the data-parallel group (``cpshard.loss``'s ``dp_group``). No gradient flows.
    Stamped with the dtype and shape (Note [Stamped reductions]; no plan: DP ranks hold other batches).
    """
    values = check_real("values", check_tensor("values", values))
    require_group(group)
    call = {"dtype": values.dtype, "row shape": tuple(values.shape)}
    stamp = Stamp("sum_over", dist.get_rank(group), False, (), call)
    return reduce_stamped(values, group, stamp)


def max_over(values: torch.Tensor, group: Any) -> torch.Tensor:
    """``values``' elementwise maximum over the ranks of ``group`` (one ``all_reduce``, on the group's
    device: CUDA under NCCL), as a new tensor on ``values``' device: the slowest rank's time, or the
    largest micro-batch count of a DP group. No gradient flows. Stamped as :func:`sum_over`."""
    values = check_real("values", check_tensor("values", values))
    if values.is_complex():
        fail("values", f"a {values.dtype} tensor", "has no order, so no maximum (the real and imaginary parts "
             "would be maximised apart)", "pass values.abs(), or the real and imaginary parts as two tensors",
             kind=TypeError)
    require_group(group)
    device = collective_device(group)
    call = {"dtype": values.dtype, "row shape": tuple(values.shape)}
    stamp = Stamp("max_over", dist.get_rank(group), False, (), call)
    return reduce_stamped(values.to(device), group, stamp, "max").to(values.device)
