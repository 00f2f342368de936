"""Across context-parallel ranks: gather outputs, shift sharded tensors, check that plans agree.

The only module of cpshard that uses ``torch.distributed``. Every function takes the CP process
group as its third argument, with no default: in a real job the world is DP x CP x TP, and a
same-size wrong group would mix replicas' data without an error (pass
``torch.distributed.group.WORLD`` where the whole job is one CP group). A Megatron CP sub-group or a
per-micro-batch dynamic group of ``local_cp_size`` ranks works the same way. The caller's CP rank is
its rank in the group. Every check (group membership and size, row counts, argument values) runs
before the first collective. Without checks, a check that fails on one rank only raises there while
the others wait in their collective; ``check=True`` costs one small extra collective that shares
every rank's verdict and plan fingerprint first, so that bad input on any rank, or ranks that built
different plans, raise on every rank and nothing hangs. ``check=None`` (the default) follows the
process-wide switch: :func:`set_checks`, or the environment variable ``CPSHARD_CHECK=1``.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, Union

import torch
import torch.distributed as dist

from cpshard._dtypes import movable, wire
from cpshard._errors import check_tensor, fail
from cpshard._exchange import Exchange
from cpshard.bshd import BshdPlan
from cpshard.ops import as_nested, check_plan_type, check_shift, pad_and_fill, token_rows
from cpshard.plan import ShardPlan, shift_exchange

__all__ = ["check_plan", "checks_enabled", "gather", "gather_tokens", "plan_fingerprint", "set_checks",
           "shift_sharded"]

Plan = Union[ShardPlan, BshdPlan]
Scalar = Union[int, float, bool]
_T = TypeVar("_T")


# -- the process-wide check switch -----------------------------------------------------------

_CHECKS = [os.environ.get("CPSHARD_CHECK", "").strip().lower() in ("1", "true", "yes", "on")]


def set_checks(enabled: bool) -> bool:
    """Turn the agreement checks of ``check=True`` on or off for every call that passes ``check=None``.

    For debugging runs (the environment variable ``CPSHARD_CHECK=1`` does the same at import).
    Returns the previous setting, so that a test or a debugging block can restore it.
    """
    if not isinstance(enabled, bool):
        fail("enabled", repr(enabled), "must be a bool", "pass True or False", kind=TypeError)
    previous, _CHECKS[0] = _CHECKS[0], enabled
    return previous


def checks_enabled() -> bool:
    """Whether calls with ``check=None`` run the agreement checks (see :func:`set_checks`)."""
    return _CHECKS[0]


def _resolve_check(check: Any) -> bool:
    if check is None:
        return _CHECKS[0]
    if not isinstance(check, bool):
        fail("check", repr(check), "must be True, False or None (the process-wide default)",
             "pass check=True", kind=TypeError)
    return check


# -- checks ----------------------------------------------------------------------------------


def _require_group(group: Any) -> None:
    """The group is initialized and holds this process. No communication."""
    if not (dist.is_available() and dist.is_initialized()):
        fail("group", repr(group), "needs an initialized torch.distributed process group",
             "call torch.distributed.init_process_group first, or use cpshard.unshard in one process")
    if group is None:
        fail("group", "None", "must be the context-parallel process group (there is no default: in a "
             "DP x CP x TP job the world group would mix replicas' rows)",
             "pass your CP group, or torch.distributed.group.WORLD if the whole job is one CP group", kind=TypeError)
    if dist.get_rank(group) < 0:
        fail("group", f"a group of ranks {_group_ranks(group)}", f"does not contain this process (global rank "
             f"{dist.get_rank()})", "pass the context-parallel group this rank belongs to")


def _group_ranks(group: Any) -> Any:
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - only for the message
        return "(unknown)"


def _group_rank(plan: Plan, group: Any) -> int:
    """This process's rank in ``group``, after checking the group matches ``plan``. No communication."""
    check_plan_type(plan)
    _require_group(group)
    size = dist.get_world_size(group)
    if size != plan.cp_size:
        fail("group", f"a group of {size} ranks", f"must have plan.cp_size = {plan.cp_size} ranks",
             "pass the context-parallel group the plan was built for (or build the plan with "
             f"cp_size={size})")
    return dist.get_rank(group)


def _check_local(local: Any, plan: Plan) -> torch.Tensor:
    check_plan_type(plan)
    local = check_tensor("local", local)
    lead = plan.local_shape
    if local.dim() < len(lead) or tuple(local.shape[:len(lead)]) != lead:
        fail("local", f"tensor of shape {tuple(local.shape)}", f"must lead with the plan's local_shape = {lead}",
             "pass this rank's whole local output for the plan (pad rows included)")
    return local


def plan_fingerprint(plan: Plan) -> torch.Tensor:
    """``(8,)`` int64 summary of a plan; equal plans give equal fingerprints. No communication.

    What :func:`check_plan` exchanges, with one more word: whether the rank's input passed its checks.

    ``[kind, cp_size, tp_size, layout, num_seqs, total_len or seq_len, hash, hash]``; the two hash
    words are a BLAKE2b digest of every length, so plans that differ anywhere differ here.
    """
    def make() -> torch.Tensor:  # once per plan: hashing 100k lengths is ~40 ms
        key = repr(plan._key()).encode()
        digest = hashlib.blake2b(key, digest_size=16).digest()
        h1, h2 = (int.from_bytes(digest[i:i + 8], "little") >> 1 for i in (0, 8))
        layout = 0 if plan.layout.value == "zigzag" else 1
        return torch.tensor([int(isinstance(plan, BshdPlan)), plan.cp_size, plan.tp_size, layout, plan.num_seqs,
                             plan.total_len, h1, h2], dtype=torch.int64)
    return plan._cache.get("fingerprint", make).clone()  # a copy: callers write the verdict word into it


def _describe(fp: Sequence[int]) -> str:
    if fp[1] == 0:  # the zero fingerprint of a rank that passed no plan at all
        return "no plan (see that rank's TypeError)"
    kind = "BshdPlan" if fp[0] else "ShardPlan"
    layout = "zigzag" if fp[3] == 0 else "contiguous"
    return (f"{kind}(cp_size={fp[1]}, tp_size={fp[2]}, layout={layout!r}, num_seqs={fp[4]}, total_len={fp[5]}, "
            f"digest={fp[6]:x})")


def _collective_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_plan(plan: Plan, group: Any) -> None:
    """Raise on every rank of ``group`` unless all of them built the same plan, sized for the group.

    One all-gather (``all_gather_single``) of a small int64 fingerprint (:func:`plan_fingerprint`). It
    cannot hang while every rank calls it: every rank sends the same size whatever its plan, and
    the group-size check comes after the exchange, so a rank whose plan has the wrong ``cp_size``
    makes every rank raise instead of leaving the others waiting. The error names which ranks built
    which plan.
    """
    _agree(plan, group, None, {})


def _checked(plan: Any, group: Any, check: bool | None,
             validate: Callable[[], tuple[_T, dict[str, Any]]]) -> tuple[_T, int]:
    """Run ``validate()`` (local checks) and return its result with this rank's group rank.

    ``validate`` returns ``(result, call)`` where ``call`` names the arguments every rank must
    pass alike (dtype, row shape, shift, fill values). ``check=False``: a failing check raises at
    once, before any collective. ``check=True``: the verdict, the plan's fingerprint and a digest of
    ``call`` are shared with the other ranks first, so that a failure on any rank, different plans
    or different arguments raise on every rank instead of one rank raising while the others wait
    (or the collective mixing data of different dtypes).
    """
    if not _resolve_check(check):
        result, _ = validate()
        return result, _group_rank(plan, group)
    try:
        result, call = validate()
    except (ValueError, TypeError) as exc:
        _agree(plan, group, exc, {})
        raise  # _agree re-raises it; kept for the type checker
    _agree(plan, group, None, call)
    return result, _group_rank(plan, group)


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


def _agree(plan: Any, group: Any, error: Exception | None, call: dict[str, Any]) -> None:
    """The small collective behind ``check_plan`` and ``check=True``; raises on every rank or none."""
    _require_group(group)
    if isinstance(plan, (ShardPlan, BshdPlan)):
        fingerprint = plan_fingerprint(plan)
    else:  # still take part in the exchange, so that the other ranks raise too
        fingerprint = torch.zeros(8, dtype=torch.int64)
        if error is None:
            error = TypeError(f"plan={type(plan).__name__}: must be a ShardPlan or BshdPlan. "
                              "Fix: build one with ShardPlan.build.")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = _collective_device(group)
    extra = torch.tensor([_digest(sorted(call.items())) if error is None else 0, int(error is not None)])
    mine = torch.cat([fingerprint, extra]).to(device)
    every = torch.empty(size * mine.numel(), dtype=mine.dtype, device=device)
    _all_gather_flat(every, mine, group)
    rows = [tuple(r) for r in every.view(size, -1).tolist()]

    def ranks_by(key: Callable[[tuple[int, ...]], Any]) -> dict[Any, list[int]]:
        groups: dict[Any, list[int]] = {}
        for r, row in enumerate(rows):
            groups.setdefault(key(row), []).append(r)
        return groups

    by_plan = ranks_by(lambda row: row[:8])
    if len(by_plan) > 1:  # the root cause of most other errors: report it first, on every rank
        listing = "; ".join(f"ranks {ranks} built {_describe(fp)}" for fp, ranks in by_plan.items())
        raise ValueError(
            f"plan: the ranks of the context-parallel group built different plans (this is rank {rank}): {listing}. "
            "Fix: build every rank's plan from the same batch lengths, sizes and layout (e.g. broadcast the "
            "lengths from one rank), so that no rank mixes rows of different layouts.") from error
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[9]]
    if failed:
        raise ValueError(
            f"ranks {failed} of the context-parallel group rejected their input (their errors say why; this is "
            f"rank {rank}). Fix: correct the input on those ranks; every rank stopped before communicating data.")
    by_call = ranks_by(lambda row: row[8])
    if len(by_call) > 1:
        mine_desc = ", ".join(f"{k}={v}" for k, v in call.items())
        raise ValueError(
            f"the ranks of the context-parallel group called with different arguments: ranks "
            f"{' vs '.join(str(r) for r in by_call.values())} (this is rank {rank}, which passed {mine_desc}). "
            "Fix: pass every rank the same dtype, row shape, shift and fill values for one step.")
    _group_rank(plan, group)  # the same plan everywhere: a size mismatch now raises on every rank


# -- gather ----------------------------------------------------------------------------------


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    """Concatenate every rank's ``inp`` into ``out`` along dim 0.

    ``all_gather_single`` where torch has it (2.13 deprecates ``all_gather_into_tensor``, which
    older releases, back to the 2.4 that cpshard supports, only have). Looked up at call time so
    that wrappers installed on ``torch.distributed`` (collective counters) see the call.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


class _AllGatherOwnGrad(torch.autograd.Function):
    """All-gather along dim 0; the gradient is the slice of the caller's own rows, not reduced."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        local = local.contiguous()
        ctx.rows, ctx.rank = local.shape[0], rank
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        _all_gather_flat(wire(out), wire(local), group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        own = grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]
        return own, None, None, None


def _gathered_buffer(local: torch.Tensor, plan: Plan, group: Any, check: bool | None) -> torch.Tensor:
    """Every rank's flattened local rows, concatenated in rank order (what ``token_rows`` reads)."""
    def validate() -> tuple[torch.Tensor, dict[str, Any]]:
        checked = _check_local(local, plan)
        return checked, {"dtype": checked.dtype, "row shape": tuple(checked.shape[len(plan.local_shape):])}

    local, rank = _checked(plan, group, check, validate)
    flat = local.reshape(math.prod(plan.local_shape), *local.shape[len(plan.local_shape):])
    return _AllGatherOwnGrad.apply(flat, group, rank, plan.cp_size)


def gather(local: torch.Tensor, plan: Plan, group: Any, *, check: bool | None = None) -> torch.Tensor:
    """Every rank's local outputs, restored per sequence, on every rank: ``unshard`` across processes.

    Args:
        local: this rank's output, ``plan.local_shape + trailing``: ``(L, ...)`` (THD) or
            ``(B, M / cp, ...)`` (BSHD): log-probs ``(L,)``, entropy, values, hidden rows ``(L, h)``,
            any dtype.
        plan: the plan every rank of ``group`` sharded this micro-batch with.
        group: the context-parallel process group (required); its size must be ``plan.cp_size``
            and this process's rank in it is its CP rank.
        check: first share every rank's input verdict and plan fingerprint (one small extra
            collective, as :func:`check_plan`), so that bad input on any rank raises on all;
            ``None`` follows :func:`set_checks`.

    Returns:
        A jagged nested tensor ``(B, j, ...)``, equal on every rank to ``unshard`` of all ranks'
        ``local``. One all-gather (``all_gather_single``), then one copy of the token rows (runs
        of them under the contiguous layout, one ``index_select`` otherwise).

    Autograd:
        The gradient reaches the calling rank's own ``local`` rows exactly once, from the positions
        they occupy in the result; the other ranks' rows are constants on this rank (their
        gradients are not sent back). If every rank computes the same loss from the gathered
        result, each rank's local gradient equals that of the single-process computation; sum
        ``local``-gradients across ranks yourself only if each rank computed a different part.
    """
    return as_nested(token_rows(_gathered_buffer(local, plan, group, check), plan), plan)


def gather_tokens(local: torch.Tensor, plan: Plan, group: Any, *, check: bool | None = None) -> torch.Tensor:
    """Like :func:`gather`, as one flat ``(num_tokens, ...)`` tensor (the nested result's ``values()``).

    For callers that reduce over tokens and need no per-sequence view. Same autograd contract.
    """
    return token_rows(_gathered_buffer(local, plan, group, check), plan)


# -- sharded shift ---------------------------------------------------------------------------


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
                group: Any) -> None:
    dist.all_to_all_single(wire(out), wire(inp.contiguous()), list(out_splits), list(in_splits), group=group)


class _ShiftSharded(torch.autograd.Function):
    """Forward: local gather + one all-to-all of boundary rows. Backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ex: Exchange, group: Any, pad_value: Scalar,
                fill: Scalar) -> torch.Tensor:
        ctx.ex, ctx.group = ex, group
        out = local.index_select(0, ex.local_src)
        if ex.total_remote:
            recv = local.new_empty((sum(ex.recv_splits), *local.shape[1:]))
            _all_to_all(recv, local.index_select(0, ex.send_rows), ex.recv_splits, ex.send_splits, group)
            out.index_copy_(0, ex.recv_rows, recv)
        if ex.pad_rows.numel():
            out.index_fill_(0, ex.pad_rows, pad_value)
        if ex.fill_rows.numel():
            out.index_fill_(0, ex.fill_rows, fill)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ex = ctx.ex
        kept = grad.clone()
        for rows in (ex.pad_rows, ex.fill_rows, ex.recv_rows):
            if rows.numel():
                kept.index_fill_(0, rows, 0)
        grad_local = torch.zeros_like(grad).index_add_(0, ex.local_src, kept)
        if ex.total_remote:
            back = grad.new_empty((sum(ex.send_splits), *grad.shape[1:]))
            _all_to_all(back, grad.index_select(0, ex.recv_rows), ex.send_splits, ex.recv_splits, ctx.group)
            grad_local.index_add_(0, ex.send_rows, back)
        return grad_local, None, None, None, None


def shift_sharded(local: torch.Tensor, plan: Plan, group: Any, *, shift: int = 1, pad_value: Scalar | None = None,
                  fill: Scalar = 0, check: bool | None = None) -> torch.Tensor:
    """Shift a tensor that exists only sharded: exactly ``shard(shift(x, k), plan, cp_rank)``.

    For labels and loss masks that Megatron's multi-token prediction rolls after sharding. Works for
    every layout, THD and BSHD plans, and every ``k >= 0``, with one ``all_to_all_single`` per call
    whatever the batch size, moving only rows whose shifted source lives on another rank (under
    zigzag, about ``k`` rows per sequence and chunk boundary; see Note [Sharded shift exchange] in
    ``_exchange.py``). With ``cp_size == 1``, or when no row crosses ranks, there is no collective.

    Args:
        local: this rank's rows, ``plan.local_shape + trailing``, any dtype (bool travels as uint8).
        plan: the plan shared by every rank of ``group``.
        group: the context-parallel group (required); its size must be ``plan.cp_size``.
        shift: ``k >= 0``.
        pad_value: value of pad rows; default ``fill`` when ``k >= 1`` (as :func:`cpshard.shard`).
        fill: value of token rows whose source ``p + k`` lies past the sequence's end.
        check: as in :func:`gather`.

    Autograd: differentiable; the gradient of a row flows back to the rank and row it was read
    from (a second all-to-all in backward). Pad and fill rows pass no gradient.
    """
    def validate() -> tuple[tuple[torch.Tensor, int, Any, Any], dict[str, Any]]:
        checked = _check_local(local, plan)
        k = check_shift(shift)
        pad, fil = pad_and_fill(pad_value, fill, k, checked.dtype)
        call = {"dtype": checked.dtype, "row shape": tuple(checked.shape[len(plan.local_shape):]), "shift": k,
                "pad_value": pad, "fill": fil}
        return (checked, k, pad, fil), call

    (local, k, pad, fil), rank = _checked(plan, group, check, validate)
    ex = shift_exchange(plan, rank, k, local.device)
    lead = len(plan.local_shape)
    flat = local.reshape(math.prod(plan.local_shape), *local.shape[lead:])
    moved = movable(flat, pad, fil)
    if moved is not None:  # fp8 / uintN rows move as their carrier; nothing to differentiate
        carried, pad_bits, fill_bits = moved
        out = _ShiftSharded.apply(carried, ex, group, pad_bits, fill_bits).view(local.dtype)
    else:
        out = _ShiftSharded.apply(flat, ex, group, pad, fil)
    return out.view(local.shape)


# -- several shifts in one exchange; sums over the group (cpshard.mtp) -------------------------

__all__ += ["group_rank", "group_size", "shift_sharded_multi", "sum_over", "sum_over_group"]


def shift_sharded_multi(tensors: Sequence[torch.Tensor], plan: Plan, group: Any, *, shifts: Sequence[int],
                        pad_values: Sequence[Scalar | None] | None = None, fills: Sequence[Scalar] | None = None,
                        check: bool | None = None) -> list[torch.Tensor]:
    """Shift several sharded tensors by several shifts with one collective: ``shard(shift(x, k))`` for each.

    For the labels and loss mask of every multi-token-prediction depth. Each segment's *halo* (the
    ``max(shifts)`` positions after it) is exchanged once for all tensors and shifts, in one
    ``all_to_all_single`` of the tensors' rows packed side by side as bytes; see Note [Halo exchange
    for several shifts] in ``_halo.py``. No collective when no halo row lies on another rank.

    Args:
        tensors: this rank's rows, each ``plan.local_shape + trailing`` (``(L,)`` THD, ``(B, M /
            cp)`` BSHD), any dtypes and trailing shapes.
        plan: the plan shared by every rank of ``group``.
        group: the context-parallel group (required); its size must be ``plan.cp_size``.
        shifts: the shifts ``k >= 0``.
        pad_values: per tensor, the value of pad rows (``None``: as :func:`cpshard.shard`, ``fill``
            for a shifted tensor); default all ``None``.
        fills: per tensor, the value of token rows shifted past the sequence's end; default 0.
        check: as in :func:`gather`.

    Returns:
        Per tensor, ``(len(shifts), *local_shape, *trailing)``: entry ``s`` is the tensor shifted by
        ``shifts[s]``; pad rows take their pad value for every shift. No gradient flows (labels and
        masks); the inputs are read detached.
    """
    from cpshard import _halo  # here, not at the top: this section stays apart from the rest
    from cpshard._dtypes import check_fill
    from cpshard._errors import check_int
    from cpshard.plan import halo_exchange

    def validate() -> tuple[tuple[list[torch.Tensor], tuple[int, ...], list[Any], list[Any]], dict[str, Any]]:
        checked = [_check_local(t, plan) for t in tensors]
        pads = list(pad_values) if pad_values is not None else [None] * len(checked)
        fils = list(fills) if fills is not None else [0] * len(checked)
        if not checked or len(pads) != len(checked) or len(fils) != len(checked):
            fail("tensors", f"{len(checked)} tensors, {len(pads)} pad_values and {len(fils)} fills",
                 "must be at least one tensor, with one pad value and one fill each", "pass matching lists")
        ks = tuple(check_int("shifts", k, minimum=0) for k in shifts)
        if not ks:
            fail("shifts", list(shifts), "must hold at least one shift", "pass e.g. shifts=[1, 2]")
        fils = [check_fill("fills", v, t.dtype) for v, t in zip(fils, checked)]
        pads = [f if v is None else check_fill("pad_values", v, t.dtype) for v, f, t in zip(pads, fils, checked)]
        call = {"dtypes": [t.dtype for t in checked],
                "row shapes": [tuple(t.shape[len(plan.local_shape):]) for t in checked],
                "shifts": ks, "pad_values": pads, "fills": fils}
        return (checked, ks, pads, fils), call

    (checked, ks, pads, fils), rank = _checked(plan, group, check, validate)
    lead = len(plan.local_shape)
    rows = [t.detach().reshape(-1, *t.shape[lead:]) for t in checked]
    ms = halo_exchange(plan, rank, ks, rows[0].device)
    received: list[torch.Tensor | None] = [None] * len(rows)
    if ms.total_remote:
        packed = _halo.pack_rows(rows)
        recv = packed.new_empty((sum(ms.recv_splits), packed.shape[1]))
        _all_to_all(recv, packed.index_select(0, ms.send_rows), ms.recv_splits, ms.send_splits, group)
        received = list(_halo.unpack_rows(recv, rows))
    return [_halo.apply_multi_shift(ms, r, got, pad, fil).view(len(ks), *t.shape)
            for r, got, pad, fil, t in zip(rows, received, pads, fils, checked)]


def sum_over_group(values: torch.Tensor, plan: Plan, group: Any) -> torch.Tensor:
    """``values`` summed over the ranks of ``group`` (one ``all_reduce``), as a new tensor.

    For token counts; the group's size must be ``plan.cp_size``. No gradient flows.
    """
    values = check_tensor("values", values)
    _group_rank(plan, group)
    return _summed(values, group)


def sum_over(values: torch.Tensor, group: Any) -> torch.Tensor:
    """``values`` summed over the ranks of any ``group`` (one ``all_reduce``), as a new tensor.

    For totals over the data-parallel group (``cpshard.loss``'s ``dp_group``). No gradient flows.
    """
    values = check_tensor("values", values)
    _require_group(group)
    return _summed(values, group)


def _summed(values: torch.Tensor, group: Any) -> torch.Tensor:
    out = values.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def group_size(group: Any, name: str = "group") -> int:
    """The number of ranks in ``group``, after checking it holds this process. No communication."""
    try:
        _require_group(group)
    except (TypeError, ValueError) as exc:  # name the caller's argument, keep the rest of the message
        raise type(exc)(str(exc).replace("group=", f"{name}=", 1)) from None
    return dist.get_world_size(group)


def group_rank(plan: Plan, group: Any) -> int:
    """This process's rank in ``group`` (its CP rank), after checking the group fits ``plan``. No communication."""
    return _group_rank(plan, group)


# -- changing layout inside a model; states across ranks (cpshard.scan) --------------------------

__all__ += ["gather_states", "relayout"]


def _run_relayout(flat: torch.Tensor, route: Any, group: Any) -> torch.Tensor:
    """``flat``'s rows moved by ``route`` (``cpshard._relayout.Route``): one all-to-all, or none when no
    row of the group changes rank."""
    from cpshard._relayout import run_route

    received = None
    if route.total_remote:
        received = flat.new_empty((sum(route.recv_splits), *flat.shape[1:]))
        _all_to_all(received, flat.index_select(0, route.send_rows), route.recv_splits, route.send_splits, group)
    return run_route(flat, route, received)


class _Relayout(torch.autograd.Function):
    """Forward: the route from src to dst. Backward: the reverse route (dst to src), one all-to-all."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, forward_route: Any, backward_route: Any, group: Any) -> torch.Tensor:
        ctx.route, ctx.group = backward_route, group
        return _run_relayout(flat.contiguous(), forward_route, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _run_relayout(grad.contiguous(), ctx.route, ctx.group), None, None, None


def relayout(local: torch.Tensor, src_plan: Plan, dst_plan: Plan, group: Any, *,
             check: bool | None = None) -> torch.Tensor:
    """This rank's rows under ``dst_plan`` from its rows under ``src_plan``, its twin: exactly
    ``shard(x, dst_plan, cp_rank)`` when ``local == shard(x, src_plan, cp_rank)``.

    For hybrid models whose attention layers run on a zigzag plan and whose linear-attention or
    state-space layers run on its contiguous twin (``cpshard.twin_plan(plan, "contiguous")``; SPEC.md,
    "Changing layout inside a model"). One ``all_to_all_single`` per call that moves only the rows
    whose rank changes; rows that stay are copied locally; no collective at all when no row of the
    group changes rank (``cp_size == 1``, equal plans). Every rank derives the route from the two
    plans (Note [Twin plans and their route] in ``_relayout.py``): no metadata message, split sizes
    as Python ints, so no host sync on CUDA (the route's indices are copied to the device once per
    plan pair, rank and device).

    Args:
        local: this rank's rows, ``src_plan.local_shape + trailing``, any dtype (bytes on the wire).
        src_plan: the plan ``local`` is sharded with.
        dst_plan: its twin (same sequences, same padded lengths; another layout or order).
        group: the context-parallel group (required); its size must be ``src_plan.cp_size``.
        check: as in :func:`gather` (the agreement covers both plans).

    Returns:
        ``dst_plan.local_shape + trailing``, ``local``'s dtype.

    Autograd: differentiable; the gradient is the reverse relayout of the output's gradient (one
    more all-to-all in backward), so every row's gradient returns to the rank and row it came from.
    """
    from cpshard._dtypes import carrier
    from cpshard._relayout import check_twins, relayout_route

    def validate() -> tuple[tuple[torch.Tensor, Plan], dict[str, Any]]:
        _, dst = check_twins(src_plan, dst_plan)
        checked = _check_local(local, src_plan)
        return (checked, dst), {"dtype": checked.dtype, "row shape": tuple(checked.shape[len(src_plan.local_shape):]),
                                "dst_plan": plan_fingerprint(dst).tolist()}

    (checked, dst), rank = _checked(src_plan, group, check, validate)
    lead = len(src_plan.local_shape)
    trailing = checked.shape[lead:]
    flat = checked.reshape(math.prod(src_plan.local_shape), *trailing)
    over = carrier(flat.dtype)
    if over is not None:  # fp8 / uintN move as their same-width carrier (no index_select there)
        flat = flat.view(over)
    device = flat.device
    forward_route = relayout_route(src_plan, dst, rank, device)
    backward_route = relayout_route(dst, src_plan, rank, device)
    out = _Relayout.apply(flat, forward_route, backward_route, group)
    if over is not None:  # only then: view(dtype), even to the same dtype, leaves the autograd graph
        out = out.view(checked.dtype)
    return out.view(*dst.local_shape, *trailing)


class _GatherSumGrad(torch.autograd.Function):
    """All-gather of one small tensor per rank, stacked; backward: the gradient summed over the group
    (``all_reduce``), of which each rank keeps its own slice."""

    @staticmethod
    def forward(ctx: Any, states: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        states = states.contiguous()
        ctx.rank, ctx.group = rank, group
        out = states.new_empty((size * states.numel(),))
        _all_gather_flat(wire(out), wire(states.reshape(-1)), group)
        return out.view(size, *states.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # summed in at least float32: gloo reduces half precision poorly or not at all
        wide = grad.to(torch.promote_types(grad.dtype, torch.float32)).contiguous()
        dist.all_reduce(wide, group=ctx.group)
        return wide[ctx.rank].to(grad.dtype), None, None, None


def gather_states(states: torch.Tensor, plan: Plan, group: Any) -> torch.Tensor:
    """``(cp, *states.shape)``: every rank's ``states`` (one shape and dtype on every rank), in rank order.

    What a recurrence needs from the ranks before it: each rank's segment end states and decay
    products (``cpshard.scan``), or the last rows a causal convolution looks back at. One
    ``all_gather_single``; the group's size must be ``plan.cp_size``.

    Autograd: every rank's result feeds every rank's later computation, so the gradient of a rank's
    ``states`` is the sum over the group of the gradients of its slice (one ``all_reduce`` in
    backward): if the ranks' losses add up to the batch's, it is the single-process gradient. That
    backward is a collective: every rank's loss must depend on its result (a rank that reads no
    carry attaches it anyway, as ``cpshard.scan`` does), or the ranks that skip it leave the
    others waiting.
    """
    states = check_tensor("states", states)
    rank = _group_rank(plan, group)
    return _GatherSumGrad.apply(states, group, rank, plan.cp_size)
