"""Across context-parallel ranks: gather outputs, shift sharded tensors, check that plans agree.

The only module of cpshard that communicates (``cpshard.spawn`` starts the processes; the agreement
protocol's rules are pure, in ``distributed/agree.py``). Every function takes the CP process
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

Checks on or off, every all-gather and all-to-all carries a 64-byte header that identifies the call
(plan, dtype, row shape, shifts and fills, check setting), compared on arrival, and every
``all_reduce`` a trailer with the same call's digest folded into the reduction: ranks that disagree
raise instead of returning a wrong result (Notes [Call headers] and [Stamped reductions] in
``distributed/header.py``; what every rank sees: docs/guarantees.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from cpshard.base.dtypes import movable, wire
from cpshard.base.errors import check_tensor, fail
from cpshard.base.types import Group, Scalar
from cpshard.distributed import agree as _protocol
from cpshard.distributed import header as _header
from cpshard.distributed.agree import checks_enabled, set_checks
from cpshard.index.shift import ShiftExchange
from cpshard.ops.sharding import as_nested, check_plan_type, pad_and_fill, token_rows
from cpshard.plan.args import check_shift
from cpshard.plan.values import Plan

__all__ = ["check_plan", "checks_enabled", "gather", "gather_tokens", "plan_fingerprint", "set_checks",
           "shift_sharded"]

_T = TypeVar("_T")


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


def _solo(plan: Plan, group: Group) -> bool:
    """One rank and no group: every function here then runs without ``torch.distributed`` (the one
    place that rule is written)."""
    return group is None and plan.cp_size == 1


def _group_rank(plan: Plan, group: Any) -> int:
    """This process's rank in ``group``, after checking the group matches ``plan``. No communication.
    ``group=None`` is accepted where ``plan.cp_size == 1`` (rank 0, nothing to communicate)."""
    check_plan_type(plan)
    if _solo(plan, group):
        return 0
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

    What :func:`check_plan` exchanges, with two more words (a digest of the call's arguments and
    whether the rank's input passed its checks; ``distributed/agree.py``).

    ``[kind, cp_size, tp_size, layout, num_seqs, total_len or seq_len, hash, hash]``; the two hash
    words are a BLAKE2b digest of the plan's value, so plans that differ anywhere differ here.
    Hashed once per plan (its index service keeps it).
    """
    check_plan_type(plan)
    return plan.indices().fingerprint().clone()  # a copy: the caller may write into it


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
             validate: Callable[[], tuple[_T, dict[str, Any]]]) -> tuple[_T, int, dict[str, Any], bool]:
    """Run ``validate()`` (local checks) and return its result with this rank's group rank.

    ``validate`` returns ``(result, call)`` where ``call`` names the arguments every rank must
    pass alike (dtype, row shape, shift, fill values). ``check=False``: a failing check raises at
    once, before any collective. ``check=True``: the verdict, the plan's fingerprint and a digest of
    ``call`` are shared with the other ranks first, so that a failure on any rank, different plans
    or different arguments raise on every rank instead of one rank raising while the others wait
    (or the collective mixing data of different dtypes). Also returns ``call`` and whether the
    agreement ran: the data collective's header carries both (Note [Call headers] in ``distributed/header.py``).
    """
    if not _protocol.resolve_check(check) or (isinstance(plan, Plan) and _solo(plan, group)):
        result, call = validate()
        return result, _group_rank(plan, group), call, False
    try:
        result, call = validate()
    except (ValueError, TypeError) as exc:
        _agree(plan, group, exc, {})
        raise  # _agree re-raises it; kept for the type checker
    _agree(plan, group, None, call)
    return result, _group_rank(plan, group), call, True


def _agree(plan: Any, group: Any, error: Exception | None, call: dict[str, Any]) -> None:
    """The small collective behind ``check_plan`` and ``check=True`` (``distributed/agree.py``); raises on every
    rank or none."""
    _require_group(group)
    words, error = _protocol.contribution(plan, error, call)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = _collective_device(group)
    # led by a CHECK header: a peer that runs a data collective here instead (checks off there) is
    # named, not read as fingerprint words (Note [Call headers])
    stamp = _header.make(_header.CHECK, "check", rank, True, (), {})
    mine = torch.cat([torch.tensor(stamp, dtype=torch.int64), words]).to(device)
    every = torch.empty((size, mine.numel()), dtype=mine.dtype, device=device)
    every[:, :_header.HEADER_WORDS].zero_()
    _all_gather_flat(every.view(-1), mine, group)
    rows = every.tolist()
    _raise_on_mismatch("check=True agreement", rank, [r[:_header.HEADER_WORDS] for r in rows], stamp, range(size))
    _protocol.judge([tuple(r[_header.HEADER_WORDS:]) for r in rows], rank, error, call)
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


# -- call headers (Note [Call headers] in distributed/header.py) ------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Stamp:
    """One call's identity, carried by its data collectives: the operation, this rank, whether an
    agreement preceded, the plan(s) and the arguments every rank must pass alike."""

    op: str
    rank: int
    checked: bool
    plans: tuple[Plan, ...]
    call: dict[str, Any]

    @functools.cached_property
    def words(self) -> list[int]:
        """This rank's header (built only when a collective runs)."""
        plan_words = [w for p in self.plans for w in p.indices().fingerprint().tolist()]
        return _header.make(_header.DATA, self.op, self.rank, self.checked, plan_words, self.call)

    def reduction_word(self, size: int, reduce: str) -> int:
        """The digest a reduction of ``size`` values folds into its trailer (Note [Stamped
        reductions]): the header's words but the sender's rank, the operation by name, the size."""
        call = tuple(sorted((k, repr(v)) for k, v in self.call.items()))
        return _reduction_word(self.op, self.checked, self.plans, call, size, reduce)

    def backward(self, op: str) -> _Stamp:
        """The stamp of the reverse exchange in backward (another operation, the same call)."""
        return dataclasses.replace(self, op=op)

    def bytes_on(self, device: torch.device) -> torch.Tensor:
        """The header as ``HEADER_BYTES`` uint8 on ``device`` (a non-blocking copy: no host sync)."""
        host = torch.tensor(self.words, dtype=torch.int64).view(torch.uint8)
        return host if device.type == "cpu" else host.to(device, non_blocking=True)


@functools.lru_cache(maxsize=256)
def _reduction_word(op: str, checked: bool, plans: tuple[Plan, ...], call: tuple[tuple[str, str], ...], size: int,
                    reduce: str) -> int:
    """:meth:`_Stamp.reduction_word`, kept per call (plans are values: a step's calls repeat)."""
    plan_words = tuple(w for p in plans for w in p.indices().fingerprint().tolist())
    return _header.digest((op, checked, plan_words, list(call), size, reduce))


@functools.lru_cache(maxsize=256)
def _trailers(word: int, dtype: torch.dtype, ranks: int, reduce: str,
              failed: bool) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """This rank's trailer (Note [Stamped reductions]) as ints and as a CPU tensor, and what the
    reduced trailer is when every rank contributed the same (read-only: each call copies them)."""
    mine = _header.trailer(word, dtype, ranks, reduce, failed)
    scale = ranks if reduce == "sum" else 1
    return mine, torch.tensor(mine, dtype=dtype), torch.tensor([0] + [scale * m for m in mine[1:]], dtype=dtype)


def _raise_on_mismatch(op: str, rank: int, got: Sequence[Sequence[int]], mine: Sequence[int],
                       senders: Sequence[int]) -> None:
    bad = {}
    for sender, words in zip(senders, got):
        fields = _header.mismatch(words, mine, sender)
        if fields:
            bad[sender] = (fields, words)
    if bad:
        raise ValueError(_header.describe_mismatch(op, rank, bad, mine))


def _verify(stamp: _Stamp, headers: torch.Tensor, senders: Sequence[int]) -> None:
    """Compare the ``(n, HEADER_BYTES)`` uint8 headers received from ``senders`` with this rank's.

    On the host (gloo, CPU tensors) a mismatch raises ValueError naming the ranks and fields; on a
    device the comparison stays there (``torch._assert_async``: no host sync; a mismatch is a
    device-side assertion, fatal to the process, as NCCL mismatches are)."""
    words = headers.reshape(-1).view(torch.int64).view(-1, _header.HEADER_WORDS)  # a copy unless one row
    if words.device.type == "cpu":
        _raise_on_mismatch(stamp.op, stamp.rank, words.tolist(), stamp.words, senders)
        return
    expected = torch.tensor([[w if i != 2 else s for i, w in enumerate(stamp.words)] for s in senders],
                            dtype=torch.int64).to(words.device, non_blocking=True)
    message = (f"cpshard {stamp.op}: the ranks of the context-parallel group disagree about this call "
               f"(rank {stamp.rank} received another header); rerun with check=True to name them")
    try:
        torch._assert_async((words == expected).all(), message)
    except TypeError:  # torch without the message overload
        torch._assert_async((words == expected).all())


def _all_gather_stamped(local: torch.Tensor, group: Any, size: int, stamp: _Stamp) -> torch.Tensor:
    """``(size, *local.shape)``: every rank's ``local`` (contiguous), each sent after this call's header
    and checked against it (a strided view of the received buffer, no copy)."""
    data = wire(local).reshape(-1)
    h = _header.HEADER_BYTES
    send = torch.empty(h + data.numel(), dtype=torch.uint8, device=local.device)
    send[:h].copy_(stamp.bytes_on(local.device), non_blocking=True)
    send[h:].copy_(data)
    out = torch.empty((size, send.numel()), dtype=torch.uint8, device=local.device)
    out[:, :h].zero_()  # a shorter message from a peer leaves "no header", not a stale one
    _all_gather_flat(out.view(-1), send, group)
    _verify(stamp, out[:, :h], range(size))
    body = out[:, h:]
    if local.dtype != torch.uint8:
        body = body.view(local.dtype)
    return body.view(size, *local.shape)


class _AllGatherOwnGrad(torch.autograd.Function):
    """All-gather along dim 0 into ``(size, rows, ...)``; the gradient is the caller's own slice, not
    reduced (the header is no data: only the rows' view takes part)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, rank: int, size: int, stamp: _Stamp) -> torch.Tensor:
        ctx.rank = rank
        return _all_gather_stamped(local.contiguous(), group, size, stamp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad[ctx.rank], None, None, None, None


def _gathered_buffer(local: torch.Tensor, plan: Plan, group: Any,
                     check: bool | None) -> torch.Tensor | list[torch.Tensor]:
    """Every rank's flattened local rows ``(R, ...)`` in rank order, views of the received buffer
    (whose headers lie between the ranks' rows), or the rows themselves at ``cp = 1`` with no group:
    what ``token_rows`` reads."""
    def validate() -> tuple[torch.Tensor, dict[str, Any]]:
        checked = _check_local(local, plan)
        return checked, {"dtype": checked.dtype, "row shape": tuple(checked.shape[len(plan.local_shape):])}

    local, rank, call, checked = _checked(plan, group, check, validate)
    flat = local.reshape(math.prod(plan.local_shape), *local.shape[len(plan.local_shape):])
    if _solo(plan, group):
        return flat
    stamp = _Stamp("gather", rank, checked, (plan,), call)
    return list(_AllGatherOwnGrad.apply(flat, group, rank, plan.cp_size, stamp).unbind(0))


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


def _all_to_all(rows: torch.Tensor, recv_splits: Sequence[int], send_splits: Sequence[int], group: Any,
                stamp: _Stamp) -> torch.Tensor:
    """One ``all_to_all_single`` of ``rows`` (grouped by destination, ``send_splits[d]`` for rank ``d``):
    the rows received, ``(sum(recv_splits), ...)`` in source order. Each destination's chunk is led by
    this call's header, even an empty one, and every source's header is checked (Note [Call headers]);
    the bytes travel as uint8, split in bytes."""
    rows = rows.contiguous()
    trailing = rows.shape[1:]
    row_bytes = rows.element_size() * math.prod(trailing)
    h = _header.HEADER_BYTES
    header = stamp.bytes_on(rows.device)
    pieces = wire(rows).reshape(-1).split([n * row_bytes for n in send_splits])
    send = torch.cat([part for piece in pieces for part in (header, piece)])
    recv = torch.empty(sum(recv_splits) * row_bytes + h * len(recv_splits), dtype=torch.uint8, device=rows.device)
    parts = recv.split([part for n in recv_splits for part in (h, n * row_bytes)])
    headers, bodies = parts[0::2], parts[1::2]
    torch._foreach_zero_(list(headers))  # a shorter message leaves "no header", not a stale one
    dist.all_to_all_single(recv, send, [h + n * row_bytes for n in recv_splits],
                           [h + n * row_bytes for n in send_splits], group=group)
    _verify(stamp, torch.stack(list(headers)), range(len(recv_splits)))
    body = torch.cat(list(bodies))
    if rows.dtype != torch.uint8:
        body = body.view(rows.dtype)
    return body.view(sum(recv_splits), *trailing)


class _ShiftSharded(torch.autograd.Function):
    """Forward: local gather + one all-to-all of boundary rows. Backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ex: ShiftExchange, group: Any, pad_value: Scalar,
                fill: Scalar, stamp: _Stamp) -> torch.Tensor:
        ctx.ex, ctx.group, ctx.stamp = ex, group, stamp
        recv = None
        if ex.total_remote:
            recv = _all_to_all(local.index_select(0, ex.send_rows), ex.recv_splits, ex.send_splits, group, stamp)
        return ex.apply(local, recv, pad_value, fill)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ex = ctx.ex
        kept = grad.clone()
        for rows in (ex.pad_rows, ex.fill_rows, ex.recv_rows):
            if rows.numel():
                kept.index_fill_(0, rows, 0)
        grad_local = torch.zeros_like(grad).index_add_(0, ex.source, kept)
        if ex.total_remote:
            back = _all_to_all(grad.index_select(0, ex.recv_rows), ex.send_splits, ex.recv_splits, ctx.group,
                               ctx.stamp.backward("shift_sharded backward"))
            grad_local.index_add_(0, ex.send_rows, back)
        return grad_local, None, None, None, None, None


def shift_sharded(local: torch.Tensor, plan: Plan, group: Any, *, shift: int = 1, pad_value: Scalar | None = None,
                  fill: Scalar = 0, check: bool | None = None) -> torch.Tensor:
    """Shift a tensor that exists only sharded: exactly ``shard(shift(x, k), plan, cp_rank)``.

    For labels and loss masks that Megatron's multi-token prediction rolls after sharding, and (``k <
    0``) the look-back of a causal convolution. Works for every layout, THD and BSHD plans, and every
    ``k``, with one ``all_to_all_single`` per call
    whatever the batch size, moving only rows whose shifted source lives on another rank (under
    zigzag, about ``k`` rows per sequence and chunk boundary; see Note [Sharded shift exchange] in
    ``index/shift.py``). With ``cp_size == 1``, or when no row crosses ranks, there is no collective.

    Args:
        local: this rank's rows, ``plan.local_shape + trailing``, any dtype (bool travels as uint8).
        plan: the plan shared by every rank of ``group``.
        group: the context-parallel group (required); its size must be ``plan.cp_size``.
        shift: ``k``: row ``p`` receives position ``p + k`` of its sequence (``k < 0`` looks back).
        pad_value: value of pad rows; default ``fill`` when ``k != 0`` (as :func:`cpshard.shard`).
        fill: value of token rows whose source ``p + k`` lies outside the sequence.
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

    (local, k, pad, fil), rank, call, checked = _checked(plan, group, check, validate)
    ex = plan.indices().shift_exchange(rank, k, local.device)
    stamp = _Stamp("shift_sharded", rank, checked, (plan,), call)
    lead = len(plan.local_shape)
    flat = local.reshape(math.prod(plan.local_shape), *local.shape[lead:])
    moved = movable(flat, pad, fil)
    if moved is not None:  # fp8 / uintN rows move as their carrier; nothing to differentiate
        carried, pad_bits, fill_bits = moved
        out = _ShiftSharded.apply(carried, ex, group, pad_bits, fill_bits, stamp).view(local.dtype)
    else:
        out = _ShiftSharded.apply(flat, ex, group, pad, fil, stamp)
    return out.view(local.shape)


# -- several shifts in one exchange; sums over the group (cpshard.mtp) -------------------------

__all__ += ["group_rank", "group_size", "read_group", "shift_sharded_multi", "sum_over", "sum_over_group"]


def shift_sharded_multi(tensors: Sequence[torch.Tensor], plan: Plan, group: Any, *, shifts: Sequence[int],
                        pad_values: Sequence[Scalar | None] | None = None, fills: Sequence[Scalar] | None = None,
                        check: bool | None = None) -> list[torch.Tensor]:
    """Shift several sharded tensors by several shifts with one collective: ``shard(shift(x, k))`` for each.

    For the labels and loss mask of every multi-token-prediction depth. Each segment's *halo* (the
    ``max(shifts)`` positions after it) is exchanged once for all tensors and shifts, in one
    ``all_to_all_single`` of the tensors' rows packed side by side as bytes; see Note [Halo exchange
    for several shifts] in ``index/halo.py``. No collective when no halo row lies on another rank.

    Args:
        tensors: this rank's rows, each ``plan.local_shape + trailing`` (``(L,)`` THD, ``(B, M /
            cp)`` BSHD), any dtypes and trailing shapes.
        plan: the plan shared by every rank of ``group``.
        group: the context-parallel group (required); its size must be ``plan.cp_size``.
        shifts: the shifts ``k`` (negative ones look back: the halo before each segment travels in
            the same collective).
        pad_values: per tensor, the value of pad rows (``None``: as :func:`cpshard.shard`, ``fill``
            for a shifted tensor); default all ``None``.
        fills: per tensor, the value of token rows shifted past the sequence's end; default 0.
        check: as in :func:`gather`.

    Returns:
        Per tensor, ``(len(shifts), *local_shape, *trailing)``: entry ``s`` is the tensor shifted by
        ``shifts[s]``; pad rows take their pad value for every shift. No gradient flows (labels and
        masks); the inputs are read detached.
    """
    from cpshard.base.dtypes import check_fill
    from cpshard.index import halo as _halo  # here, not at the top: this section stays apart from the rest

    def validate() -> tuple[tuple[list[torch.Tensor], tuple[int, ...], list[Any], list[Any]], dict[str, Any]]:
        checked = [_check_local(t, plan) for t in tensors]
        pads = list(pad_values) if pad_values is not None else [None] * len(checked)
        fils = list(fills) if fills is not None else [0] * len(checked)
        if not checked or len(pads) != len(checked) or len(fils) != len(checked):
            fail("tensors", f"{len(checked)} tensors, {len(pads)} pad_values and {len(fils)} fills",
                 "must be at least one tensor, with one pad value and one fill each", "pass matching lists")
        ks = tuple(check_shift(k, "shifts") for k in shifts)
        if not ks:
            fail("shifts", list(shifts), "must hold at least one shift", "pass e.g. shifts=[1, 2]")
        fils = [check_fill("fills", v, t.dtype) for v, t in zip(fils, checked)]
        pads = [f if v is None else check_fill("pad_values", v, t.dtype) for v, f, t in zip(pads, fils, checked)]
        call = {"dtypes": [t.dtype for t in checked],
                "row shapes": [tuple(t.shape[len(plan.local_shape):]) for t in checked],
                "shifts": ks, "pad_values": pads, "fills": fils}
        return (checked, ks, pads, fils), call

    (checked, ks, pads, fils), rank, call, ran_check = _checked(plan, group, check, validate)
    lead = len(plan.local_shape)
    rows = [t.detach().reshape(-1, *t.shape[lead:]) for t in checked]
    ms = plan.indices().halo(rank, ks, rows[0].device)
    received: list[torch.Tensor | None] = [None] * len(rows)
    if ms.total_remote:
        packed = _halo.pack_rows(rows)
        stamp = _Stamp("shift_sharded_multi", rank, ran_check, (plan,), call)
        recv = _all_to_all(packed.index_select(0, ms.send_rows), ms.recv_splits, ms.send_splits, group, stamp)
        received = list(_halo.unpack_rows(recv, rows))
    return [ms.apply(r, got, pad, fil).view(len(ks), *t.shape)
            for r, got, pad, fil, t in zip(rows, received, pads, fils, checked)]


def sum_over_group(values: torch.Tensor, plan: Plan, group: Any, *, check: bool | None = None) -> torch.Tensor:
    """``values`` summed over the ranks of ``group`` (one ``all_reduce``), as a new tensor.

    For token counts; the group's size must be ``plan.cp_size``. No gradient flows. The sum carries
    a trailer of the call (plan, dtype, shape; Note [Stamped reductions] in ``cpshard/distributed/header.py``): ranks
    that sum something else raise a ``ValueError`` instead of returning. ``check``: as in
    :func:`gather` (the agreement first, which names the ranks and plans).
    """
    def validate() -> tuple[torch.Tensor, dict[str, Any]]:
        checked = check_tensor("values", values)
        return checked, {"dtype": checked.dtype, "row shape": tuple(checked.shape)}

    values, rank, call, ran_check = _checked(plan, group, check, validate)
    if _solo(plan, group):
        return values.detach().clone()
    return _reduce_stamped(values, group, _Stamp("sum_over_group", rank, ran_check, (plan,), call))


def sum_over(values: torch.Tensor, group: Any) -> torch.Tensor:
    """``values`` summed over the ranks of any ``group`` (one ``all_reduce``), as a new tensor.

    For totals over the data-parallel group (``cpshard.loss``'s ``dp_group``). No gradient flows.
    Stamped with the dtype and shape (Note [Stamped reductions]; no plan: DP ranks hold other batches).
    """
    values = check_tensor("values", values)
    _require_group(group)
    call = {"dtype": values.dtype, "row shape": tuple(values.shape)}
    stamp = _Stamp("sum_over", dist.get_rank(group), False, (), call)
    return _reduce_stamped(values, group, stamp)


def max_over(values: torch.Tensor, group: Any) -> torch.Tensor:
    """``values``' elementwise maximum over the ranks of ``group`` (one ``all_reduce``, on the group's
    device: CUDA under NCCL), as a new tensor on ``values``' device: the slowest rank's time, or the
    largest micro-batch count of a DP group. No gradient flows. Stamped as :func:`sum_over`."""
    values = check_tensor("values", values)
    _require_group(group)
    device = _collective_device(group)
    call = {"dtype": values.dtype, "row shape": tuple(values.shape)}
    stamp = _Stamp("max_over", dist.get_rank(group), False, (), call)
    return _reduce_stamped(values.to(device), group, stamp, "max").to(values.device)


def validated(plan: Any, group: Any, check: bool | None,
              validate: Callable[[], tuple[_T, dict[str, Any]]]) -> tuple[_T, int, bool]:
    """For a call of layer 4 (the scan, the attention): ``validate()``'s result, this rank's group
    rank, and whether the agreement ran. With checks on (``check``, or :func:`set_checks`), a
    failure of ``validate`` on any rank, different plans or different ``call`` values (dtype, shape)
    raise on every rank, before any data collective; with checks off ``validate`` raises here."""
    result, rank, _, ran = _checked(plan, group, check, validate)
    return result, rank, ran


def agree(plan: Any, group: Any, error: Exception | None, call: dict[str, Any]) -> None:
    """The agreement of ``check=True`` for a call of layer 4 (a loss): raises on every rank of ``group``
    or none (``error``: this rank's own, raised on it after the exchange; ``call``: the arguments
    every rank must pass alike). One small all-gather (``distributed/agree.py``)."""
    _agree(plan, group, error, call)


def reduce_over(values: torch.Tensor, group: Any, *, op: str, plans: Sequence[Plan] = (),
                call: dict[str, Any] | None = None, checked: bool = False, failed: bool = False,
                reduce: str = "sum") -> torch.Tensor:
    """``values`` reduced (``"sum"`` or ``"max"``) over ``group`` in one stamped ``all_reduce`` (Note
    [Stamped reductions] in ``distributed/header.py``), for a call of layer 4 named ``op`` with ``plans`` and
    ``call`` (what every rank must pass alike). ``failed``: this rank rejected its input and joins
    only so that its peers raise too (``values`` then only give the size). Raises ``ValueError`` on
    every rank that sees a failure word or another call's digest. No gradient flows."""
    _require_group(group)
    if failed:  # only the size counts; on the group's device (CUDA under NCCL)
        values = torch.zeros(values.shape, dtype=values.dtype, device=_collective_device(group))
    stamp = _Stamp(op, dist.get_rank(group), checked, tuple(plans), dict(call or {}))
    return _reduce_stamped(values, group, stamp, reduce, failed)


def _reduce_stamped(values: torch.Tensor, group: Any, stamp: _Stamp, reduce: str = "sum",
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
    else:  # on the device, no host sync: a device-side assertion, as the headers' (_verify)
        torch._assert_async((head == expected.to(head.device, non_blocking=True)).all())
    if wide.is_complex():
        body = torch.view_as_complex(body.view(-1, 2))
    return body.view(values.shape).to(values.dtype)


def _reduction_error(stamp: _Stamp, verdict: str) -> str:
    if verdict == "failed":
        return (f"{stamp.op}: a rank of the group rejected its input (its own error says why; this is rank "
                f"{stamp.rank}). Fix: correct the input on that rank; it joined this sum with a failure word so "
                "that no rank of the group waits for it.")
    return (f"{stamp.op}: the ranks of the group disagree about this reduction (this is rank {stamp.rank}): "
            "another rank folded another call's digest into the sum (its plan, the number or dtype of the "
            "values, the operation or its arguments, or the check setting differ, or it runs another collective "
            "here). Its result would be wrong, so no rank returns it. Fix: call it on every rank with the same "
            "plan and arguments; check=True (or set_checks(True)) on every rank names the ranks and their plans.")


def initialized() -> bool:
    """Whether ``torch.distributed`` is available and initialized (no communication)."""
    return dist.is_available() and dist.is_initialized()


# -- the reference attention's gather (cpshard.attention) ----------------------------------------

__all__ += ["all_gather_rows", "initialized", "max_over"]


class _GatherRowsSumGrad(torch.autograd.Function):
    """All-gather along dim 0 (``all_gather_single``); backward: the gathered gradient summed over the
    group (``all_reduce``, stamped: Note [Stamped reductions]), of which the caller keeps its own rows.
    The pairing of nanotron's ``DifferentiableAllGather`` / ``DifferentiableReduceScatterSum``;
    ``all_reduce`` because gloo has no reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, rank: int, size: int, stamp: _Stamp) -> torch.Tensor:
        local = local.contiguous()
        ctx.rows, ctx.rank, ctx.group, ctx.stamp = local.shape[0], rank, group, stamp
        # the ranks' rows out of the headed buffer: one copy, as the result is (size * rows, ...)
        return _all_gather_stamped(local, group, size, stamp).reshape(size * local.shape[0], *local.shape[1:])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # summed in at least float32: gloo reduces half precision poorly or not at all
        wide = grad.to(torch.promote_types(grad.dtype, torch.float32)).contiguous()
        wide = _reduce_stamped(wide, ctx.group, ctx.stamp.backward(f"{ctx.stamp.op} backward"))
        own = wide[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]
        return own.to(grad.dtype), None, None, None, None


def all_gather_rows(rows: torch.Tensor, plan: Plan, group: Group, *, check: bool | None = None) -> torch.Tensor:
    """Every rank's ``rows`` ``(R, ...)``, concatenated in rank order: ``(cp * R, ...)``, for a
    computation in which every rank's rows serve every rank (the reference attention's keys and
    values). Backward: the gathered gradient is summed over the group and each rank keeps its own
    rows, so that when the ranks' losses add up to the batch's, every gradient equals ``cp = 1``'s.
    ``rows`` as they are at ``cp = 1`` with no group. ``check``: as in :func:`gather`.

    That backward is a collective: every rank's loss must depend on the result (:func:`joined`
    attaches it where a rank's output reads none of it), or the ranks that skip it leave the others
    waiting."""
    return _gather_rows(rows, plan, group, "all_gather_rows", check)


def _gather_rows(rows: torch.Tensor, plan: Plan, group: Group, op: str, check: bool | None) -> torch.Tensor:
    def validate() -> tuple[torch.Tensor, dict[str, Any]]:
        checked = check_tensor("rows" if op == "all_gather_rows" else "states", rows)
        return checked, {"dtype": checked.dtype, "row shape": tuple(checked.shape[1:])}

    rows, rank, call, ran_check = _checked(plan, group, check, validate)
    if _solo(plan, group):
        return rows
    stamp = _Stamp(op, rank, ran_check, (plan,), call)
    return _GatherRowsSumGrad.apply(rows, group, rank, plan.cp_size, stamp)


class _Joined(torch.autograd.Function):
    """``out`` itself, made to depend on ``gathered``: a zero gradient flows to it, so that the
    gathered tensor's backward collective runs on this rank too."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        ctx.shape, ctx.dtype, ctx.device = gathered.shape, gathered.dtype, gathered.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)


def joined(out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """``out`` (a view of it), made to depend on ``gathered`` (the result of :func:`all_gather_rows` or
    :func:`gather_states`) with a zero gradient: so that the gather's backward ``all_reduce`` runs on
    every rank, also where ``out`` reads none of ``gathered`` (a rank whose rows are all pad rows, a
    scan rank with no carry), instead of the others waiting in it. Nothing is attached where no
    gradient can flow."""
    if not (torch.is_grad_enabled() and gathered.requires_grad):
        return out
    return _Joined.apply(out, gathered)


def read_group(group: Any, what: str) -> int | None:
    """``torch.distributed.get_rank(group=)`` (``what="rank"``) or ``get_world_size(group=)``
    (``"size"``), looked up at call time (tests may fake them), or None where torch does not know the
    group (not initialized, or a stand-in object). No communication; what verl's helpers read."""
    reader = getattr(dist, "get_rank" if what == "rank" else "get_world_size", None)
    if reader is None or not dist.is_available():
        return None
    try:
        return int(reader(group=group))
    except (RuntimeError, ValueError, KeyError, AttributeError, TypeError):
        return None


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

__all__ += ["gather_states", "joined", "relayout"]


def _run_relayout(flat: torch.Tensor, route: Any, group: Any, stamp: _Stamp) -> torch.Tensor:
    """``flat``'s rows moved by ``route`` (``cpshard.plan.twins.Route``): one all-to-all, or none when no
    row of the group changes rank."""
    received = None
    if route.total_remote:
        received = _all_to_all(flat.index_select(0, route.send_rows), route.recv_splits, route.send_splits, group,
                               stamp)
    return route.apply(flat, received)


class _Relayout(torch.autograd.Function):
    """Forward: the route from src to dst. Backward: the reverse route (dst to src), one all-to-all."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, forward_route: Any, backward_route: Any, group: Any,
                stamp: _Stamp) -> torch.Tensor:
        ctx.route, ctx.group, ctx.stamp = backward_route, group, stamp
        return _run_relayout(flat.contiguous(), forward_route, group, stamp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        stamp = ctx.stamp.backward("relayout backward")
        return _run_relayout(grad.contiguous(), ctx.route, ctx.group, stamp), None, None, None, None


def relayout(local: torch.Tensor, src_plan: Plan, dst_plan: Plan, group: Any, *,
             check: bool | None = None) -> torch.Tensor:
    """This rank's rows under ``dst_plan`` from its rows under ``src_plan``, its twin: exactly
    ``shard(x, dst_plan, cp_rank)`` when ``local == shard(x, src_plan, cp_rank)``.

    For hybrid models whose attention layers run on a zigzag plan and whose linear-attention or
    state-space layers run on its contiguous twin (``cpshard.twin_plan(plan, "contiguous")``; SPEC.md,
    "Changing layout inside a model"). One ``all_to_all_single`` per call that moves only the rows
    whose rank changes; rows that stay are copied locally; no collective at all when no row of the
    group changes rank (``cp_size == 1``, equal plans). Every rank derives the route from the two
    plans (Note [Twin plans and their route] in ``plan/twins.py``): no metadata message, split sizes
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
    from cpshard.base.dtypes import carrier
    from cpshard.plan.twins import check_twins, relayout_route

    def validate() -> tuple[tuple[torch.Tensor, Plan], dict[str, Any]]:
        _, dst = check_twins(src_plan, dst_plan)
        checked = _check_local(local, src_plan)
        return (checked, dst), {"dtype": checked.dtype, "row shape": tuple(checked.shape[len(src_plan.local_shape):]),
                                "dst_plan": plan_fingerprint(dst).tolist()}

    (checked, dst), rank, call, ran_check = _checked(src_plan, group, check, validate)
    lead = len(src_plan.local_shape)
    trailing = checked.shape[lead:]
    flat = checked.reshape(math.prod(src_plan.local_shape), *trailing)
    over = carrier(flat.dtype)
    if over is not None:  # fp8 / uintN move as their same-width carrier (no index_select there)
        flat = flat.view(over)
    device = flat.device
    forward_route = relayout_route(src_plan, dst, rank, device)
    backward_route = relayout_route(dst, src_plan, rank, device)
    stamp = _Stamp("relayout", rank, ran_check, (src_plan, dst), call)
    out = _Relayout.apply(flat, forward_route, backward_route, group, stamp)
    if over is not None:  # only then: view(dtype), even to the same dtype, leaves the autograd graph
        out = out.view(checked.dtype)
    return out.view(*dst.local_shape, *trailing)


def gather_states(states: torch.Tensor, plan: Plan, group: Any, *, check: bool | None = None) -> torch.Tensor:
    """``(cp, *states.shape)``: every rank's ``states`` (one shape and dtype on every rank), in rank order.

    What a recurrence needs from the ranks before it: each rank's segment end states and decay
    products (``cpshard.scan``), or the last rows a causal convolution looks back at. One
    ``all_gather_single``; the group's size must be ``plan.cp_size``.

    Autograd: every rank's result feeds every rank's later computation, so the gradient of a rank's
    ``states`` is the sum over the group of the gradients of its slice (one ``all_reduce`` in
    backward): if the ranks' losses add up to the batch's, it is the single-process gradient. That
    backward is a collective: every rank's loss must depend on its result (a rank that reads no
    carry attaches it anyway with :func:`joined`, as ``cpshard.scan`` does), or the ranks that skip
    it leave the others waiting. ``check``: as in :func:`gather` (the agreement covers the dtype and
    shape: a rank whose states differ raises with the others, before the gather).
    """
    states = check_tensor("states", states)
    return _gather_rows(states.unsqueeze(0), plan, group, "gather_states", check).reshape(plan.cp_size,
                                                                                          *states.shape)
