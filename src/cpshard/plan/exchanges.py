"""The pure exchanges behind :mod:`cpshard.distributed`'s sharded shifts, public so that a user (or a
test) can see or check a whole exchange in one process: :func:`shift_exchange` (one shift) and
:func:`halo_exchange` (several shifts, one exchange). Both check their arguments and ask the plan's
index service, which builds and keeps them (``plan.indices()``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpshard.base.errors import check_rank
from cpshard.index.halo import HaloExchange
from cpshard.index.shift import ShiftExchange
from cpshard.plan.args import check_shift
from cpshard.plan.values import Plan, check_plan_type

__all__ = ["halo_exchange", "shift_exchange"]


def shift_exchange(plan: Plan, cp_rank: int, shift: int, device: torch.device | str | None = None) -> ShiftExchange:
    """What ``cp_rank`` sends, receives and copies locally to shift a sharded tensor by ``shift``.

    Pure index math, the same on every rank (Note [Sharded shift exchange] in ``index/shift.py``):
    call it for every rank in one process to see or test a whole exchange
    (``ShiftExchange.apply`` and ``cpshard.index.shift.all_to_all_in_process`` run it there). CPU unless ``device``.
    """
    check_plan_type(plan)
    cp_rank = check_rank(cp_rank, plan.cp_size)
    shift = check_shift(shift)
    return plan.indices().shift_exchange(cp_rank, shift, torch.device("cpu" if device is None else device))


def halo_exchange(plan: Plan, cp_rank: int, shifts: Sequence[int],
                  device: torch.device | str | None = None) -> HaloExchange:
    """What ``cp_rank`` sends, receives and gathers to shift sharded tensors by every shift in ``shifts``.

    One exchange of each segment's halo serves every shift and tensor (Note [Halo exchange for
    several shifts] in ``index/halo.py``; ``cpshard.distributed.shift_sharded_multi`` runs it). Pure index
    math, the same on every rank: callable for every rank in one process. CPU unless ``device``.
    """
    check_plan_type(plan)
    cp_rank = check_rank(cp_rank, plan.cp_size)
    ks = tuple(check_shift(k, "shifts") for k in shifts)
    return plan.indices().halo(cp_rank, ks, torch.device("cpu" if device is None else device))
