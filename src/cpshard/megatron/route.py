"""Megatron-LM dev's ``PackedSeqParams.cp_partition_route`` filled from a cpshard plan pair.

Megatron-LM ``dev`` converts THD hidden states between its zigzag and contiguous CP layouts
(``cp_partition_mode``) in one all-to-all driven by a per-micro-batch ``ThdCpRoute``
(``megatron.core.context_parallel_layout``): for each layout, the rank's local rows in send order
(``*_index``, None where that order is the identity) and the rows exchanged with every rank, this
rank included (``*_split_sizes``). Zigzag to contiguous sends ``x[zigzag_index]`` with
``zigzag_split_sizes``, receives ``contiguous_split_sizes`` and scatters the received rows to
``contiguous_index``; the reverse uses the same four fields the other way round.

Megatron builds it from ``cu_seqlens_q_padded`` with a device-to-host copy, and a Python loop over
rows, when the route is not prebuilt. Here it comes from the plan and its twin
(Note [Twin plans and their route] in ``cpshard/_relayout.py``): no host sync (the plan holds
every offset as Python ints), vectorized, the index tensors copied to the device once
(non-blocking). Megatron's route moves a rank's own rows through the all-to-all too; cpshard's own
``relayout`` copies them locally and skips the collective when nothing crosses ranks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from cpshard.base.errors import check_rank, fail
from cpshard.base.layout import Layout, require_equal_chunks
from cpshard.index.segments import to_device
from cpshard.plan.twins import twin
from cpshard.plan.values import ShardPlan

__all__ = ["cp_partition_route", "route_class"]


def route_class() -> Any:
    """Megatron-LM dev's ``ThdCpRoute``, the class :func:`cp_partition_route` builds by default (a test
    hook: a test without Megatron-LM dev patches this function to return a stand-in)."""
    from cpshard.megatron._import import import_megatron
    try:
        return import_megatron("megatron.core.context_parallel_layout").ThdCpRoute
    except (ImportError, AttributeError):
        fail("route_type", "None", "Megatron's ThdCpRoute exists on Megatron-LM dev only "
             "(megatron.core.context_parallel_layout), not in this megatron-core", "install Megatron-LM dev, or "
             "pass route_type= a class taking (zigzag_index, zigzag_split_sizes, contiguous_index, "
             "contiguous_split_sizes)", kind=TypeError)


def cp_partition_route(plan: ShardPlan, cp_rank: int, device: torch.device | str | None = None, *,
                       route_type: Any = None) -> Any:
    """``cp_rank``'s ``ThdCpRoute`` for converting between ``plan``'s layout and its twin's.

    ``plan``: a THD plan, zigzag or contiguous, without a reorder (Megatron converts within one
    buffer order; its ``cu_seqlens_q_padded`` is ``plan.cu_seqlens_padded``); the zigzag side needs
    every padded length to divide by ``2 * cp`` (a zigzag-padded plan, as Megatron requires).
    ``device``: where the index tensors go (default CPU). ``route_type``: the class to build
    (default Megatron-LM dev's ``ThdCpRoute``). Pure: callable for every rank in one process.
    """
    if not isinstance(plan, ShardPlan):
        fail("plan", type(plan).__name__, "must be a ShardPlan (Megatron's route is for THD batches)",
             "build one with ShardPlan.build", kind=TypeError)
    if plan.order is not None:
        fail("plan", repr(plan), "must keep the caller's order (Megatron's conversion keeps one buffer order)",
             "build the plan without reorder='balanced'")
    cp_rank = check_rank(cp_rank, plan.cp_size)
    zigzag = plan if plan.layout is Layout.ZIGZAG else twin(plan, Layout.ZIGZAG)
    require_equal_chunks(zigzag, "Megatron's ThdCpRoute")
    contiguous = twin(zigzag, Layout.CONTIGUOUS)
    cls = route_type if route_type is not None else route_class()
    rows, cp = math.prod(plan.local_shape), plan.cp_size
    tgt, inv, _ = zigzag.indices().permutation(contiguous)  # zigzag (s, j) -> contiguous (d, l), flat s * R + j
    span = max(rows, 1)
    sent = tgt[cp_rank * rows:(cp_rank + 1) * rows]  # where each zigzag-local row goes
    came = inv[cp_rank * rows:(cp_rank + 1) * rows]  # where each contiguous-local row comes from
    zz_index = np.argsort(sent, kind="stable")  # by (contiguous rank, its local row)
    cont_index = np.argsort(came // span, kind="stable")  # by (zigzag rank, this rank's local row)
    dev = torch.device("cpu") if device is None else torch.device(device)

    def index(order: np.ndarray) -> torch.Tensor | None:
        if np.array_equal(order, np.arange(order.size)):
            return None  # Megatron's convention: no gather where the order is the identity
        return to_device(torch.from_numpy(order.astype(np.int64)), dev)

    return cls(zigzag_index=index(zz_index), zigzag_split_sizes=np.bincount(sent // span, minlength=cp).tolist(),
               contiguous_index=index(cont_index),
               contiguous_split_sizes=np.bincount(came // span, minlength=cp).tolist())
