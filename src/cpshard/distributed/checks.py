"""The checks before a collective: local checks of the arguments and, with ``check=True``, the
agreement that shares every rank's verdict and plan fingerprint first (its rules are pure, in
``distributed/agree.py``), so that bad input on any rank, or ranks that built different plans, raise
on every rank and nothing hangs.

:func:`checked_call` is the one entry every collective of ``cpshard.distributed`` goes through;
:func:`validated` and :func:`agree` hand it on to the calls of layer 5 (the losses, the scan, the
reference attention).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from cpshard.base.errors import check_real, check_tensor, fail
from cpshard.distributed import agree as _protocol
from cpshard.distributed import header as _header
from cpshard.distributed.groups import collective_device, group_rank, require_group, solo
from cpshard.distributed.stamp import all_gather_flat, raise_on_mismatch
from cpshard.ops.sharding import check_plan_type
from cpshard.plan.values import Plan

__all__ = ["agree", "check_local", "check_plan", "checked_call", "checks_on", "device_types", "plan_fingerprint",
           "validated"]

_T = TypeVar("_T")


def check_local(local: Any, plan: Plan) -> torch.Tensor:
    check_plan_type(plan)
    local = check_real("local", check_tensor("local", local))
    lead = plan.local_shape
    if local.dim() < len(lead) or tuple(local.shape[:len(lead)]) != lead:
        fail("local", f"tensor of shape {tuple(local.shape)}", f"must lead with the plan's local_shape = {lead}",
             "pass this rank's whole local output for the plan (pad rows included)")
    return local


def plan_fingerprint(plan: Plan) -> torch.Tensor:
    """``(8,)`` int64 summary of a plan; equal plans give equal fingerprints. No communication.

    What :func:`check_plan` exchanges, with two more words (a digest of the call's arguments and
    whether the rank's input passed its checks; ``distributed/agree.py``).

    ``[kind, cp_size, tp_size, layout, num_seqs, total_len or seq_len, hash, hash]``; the two hash
    words are a BLAKE2b digest of the plan's value, so plans that differ anywhere differ here.
    Hashed once per plan (its index service keeps it).
    """
    check_plan_type(plan)
    return plan.indices().fingerprint().clone()  # a copy: the caller may write into it


def check_plan(plan: Plan, group: Any) -> None:
    """Raise on every rank of ``group`` unless all of them built the same plan, sized for the group.

    One all-gather (``all_gather_single``) of a small int64 fingerprint (:func:`plan_fingerprint`). It
    cannot hang while every rank calls it: every rank sends the same size whatever its plan, and
    the group-size check comes after the exchange, so a rank whose plan has the wrong ``cp_size``
    makes every rank raise instead of leaving the others waiting. The error names which ranks built
    which plan.
    """
    agree(plan, group, None, {})


def checked_call(plan: Any, group: Any, check: bool | None, validate: Callable[[], tuple[_T, dict[str, Any]]],
                 op: str) -> tuple[_T, int, dict[str, Any], bool]:
    """Run ``validate()`` (local checks) and return its result with this rank's group rank.

    ``validate`` returns ``(result, call)`` where ``call`` names the arguments every rank must
    pass alike (dtype, row shape, shift, fill values). ``check=False``: a failing check raises at
    once, before any collective. ``check=True``: the verdict, the plan's fingerprint and a digest of
    ``call`` are shared with the other ranks first, so that a failure on any rank, different plans
    or different arguments raise on every rank instead of one rank raising while the others wait
    (or the collective mixing data of different dtypes); ``op`` (the public function's name) is agreed
    on with them. Also returns ``call`` and whether the
    agreement ran: the data collective's header carries both (Note [Call headers] in ``distributed/header.py``).
    """
    if not checks_on(check, plan, group) or (isinstance(plan, Plan) and solo(plan, group)):
        result, call = validate()
        device_types(result)
        return result, group_rank(plan, group), call, False
    try:
        result, call = validate()
        devices = device_types(result)
    except (ValueError, TypeError) as exc:
        agree(plan, group, exc, {})
        raise  # agree re-raises it; kept for the type checker
    # the agreement only (headers stay as they were); the operation too: two functions whose arguments
    # read alike (a gather of (L,) rows, a sum of one 0-d value) would pass it, then wait in different collectives
    agree(plan, group, None, {**call, "device": devices, "operation": op})
    return result, group_rank(plan, group), call, True


def checks_on(check: Any, plan: Any, group: Any) -> bool:
    """Whether a call runs the agreement (``check``, or the process-wide switch when it is None). A ``check``
    that is no bool (``"yes"``, ``1``) is this rank's refusal: it joins the agreement with it, as for any
    bad input, so that peers with checks on raise with it instead of pairing their agreement with this
    rank's next call (peers with checks off name the check setting in their data collective's header)."""
    try:
        return _protocol.resolve_check(check)
    except TypeError as exc:
        if group is not None and not (isinstance(plan, Plan) and solo(plan, group)):
            agree(plan, group, exc, {})
        raise


def device_types(value: Any) -> tuple[str, ...]:
    """The device types of the tensors in ``value`` (a tensor, or tuples and lists of them), in order
    of first appearance: what :func:`checked_call` adds to the agreement (every rank passes its
    tensors on one kind of device: SPEC.md, "Errors"). ``ValueError`` for a tensor on the ``meta``
    device (no values: torch's collectives return on it without communicating, and its peers wait)."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            check_real("input", item)
            if item.device.type not in found:
                found.append(item.device.type)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return tuple(found)


def agree(plan: Any, group: Any, error: Exception | None, call: dict[str, Any]) -> None:
    """The agreement of ``check=True`` (and of :func:`check_plan`): raises on every rank of ``group`` or
    none (``error``: this rank's own, raised on it after the exchange; ``call``: the arguments every
    rank must pass alike). One small all-gather (``distributed/agree.py``); the losses of layer 5 call
    it directly."""
    require_group(group)
    words, error = _protocol.contribution(plan, error, call)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = collective_device(group)
    # led by a CHECK header: a peer that runs a data collective here instead (checks off there) is
    # named, not read as fingerprint words (Note [Call headers])
    stamp = _header.make(_header.CHECK, "check", rank, True, (), {})
    mine = torch.cat([torch.tensor(stamp, dtype=torch.int64), words]).to(device)
    every = torch.empty((size, mine.numel()), dtype=mine.dtype, device=device)
    every[:, :_header.HEADER_WORDS].zero_()
    all_gather_flat(every.view(-1), mine, group)
    rows = every.tolist()
    raise_on_mismatch("check=True agreement", rank, [r[:_header.HEADER_WORDS] for r in rows], stamp, range(size))
    _protocol.judge([tuple(r[_header.HEADER_WORDS:]) for r in rows], rank, error, call)
    group_rank(plan, group)  # the same plan everywhere: a size mismatch now raises on every rank


def validated(plan: Any, group: Any, check: bool | None, validate: Callable[[], tuple[_T, dict[str, Any]]],
              op: str) -> tuple[_T, int, bool]:
    """For a call of layer 5 (the scan, the attention): ``validate()``'s result, this rank's group
    rank, and whether the agreement ran. With checks on (``check``, or :func:`set_checks`), a
    failure of ``validate`` on any rank, different plans or different ``call`` values (dtype, shape)
    raise on every rank, before any data collective; with checks off ``validate`` raises here."""
    result, rank, _, ran = checked_call(plan, group, check, validate, op)
    return result, rank, ran
