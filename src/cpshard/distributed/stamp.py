"""The call's stamp on the wire: every all-gather and all-to-all cpshard makes is led by the call's
64-byte header and checked on arrival (Note [Call headers] in ``distributed/header.py``, which builds
and compares the words; here they travel as tensors).

:class:`Stamp` is one call's identity (operation, rank, plans, the arguments every rank must pass
alike); :func:`all_gather_stamped` and :func:`all_to_all` are the two stamped transports every data
collective runs on; its :meth:`Stamp.reduction_word` is what a stamped reduction folds into its trailer
(``distributed/sums.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from cpshard.base.dtypes import wire
from cpshard.distributed import header as _header
from cpshard.plan.values import Plan

__all__ = ["Stamp", "all_gather_flat", "all_gather_stamped", "all_to_all", "raise_on_mismatch", "verify_headers"]


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    """Concatenate every rank's ``inp`` into ``out`` along dim 0.

    ``all_gather_single`` where torch has it (2.13 deprecates ``all_gather_into_tensor``, which
    older releases, back to the 2.4 that cpshard supports, only have). Looked up at call time so
    that wrappers installed on ``torch.distributed`` (collective counters) see the call.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


@dataclasses.dataclass(frozen=True)
class Stamp:
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

    def backward(self, op: str) -> Stamp:
        """The stamp of the reverse exchange in backward (another operation, the same call)."""
        return dataclasses.replace(self, op=op)

    def bytes_on(self, device: torch.device) -> torch.Tensor:
        """The header as ``HEADER_BYTES`` uint8 on ``device`` (a non-blocking copy: no host sync)."""
        host = torch.tensor(self.words, dtype=torch.int64).view(torch.uint8)
        return host if device.type == "cpu" else host.to(device, non_blocking=True)


@functools.lru_cache(maxsize=256)
def _reduction_word(op: str, checked: bool, plans: tuple[Plan, ...], call: tuple[tuple[str, str], ...], size: int,
                    reduce: str) -> int:
    """:meth:`Stamp.reduction_word`, kept per call (plans are values: a step's calls repeat)."""
    plan_words = tuple(w for p in plans for w in p.indices().fingerprint().tolist())
    return _header.digest((op, checked, plan_words, list(call), size, reduce))


def raise_on_mismatch(op: str, rank: int, got: Sequence[Sequence[int]], mine: Sequence[int],
                       senders: Sequence[int], call: dict[str, Any] | None = None) -> None:
    bad = {}
    for sender, words in zip(senders, got):
        fields = _header.mismatch(words, mine, sender)
        if fields:
            bad[sender] = (fields, words)
    if bad:
        raise ValueError(_header.describe_mismatch(op, rank, bad, mine, call))


def verify_headers(stamp: Stamp, headers: torch.Tensor, senders: Sequence[int]) -> None:
    """Compare the ``(n, HEADER_BYTES)`` uint8 headers received from ``senders`` with this rank's.

    On the host (gloo, CPU tensors) a mismatch raises ValueError naming the ranks and fields; on a
    device the comparison stays there (``torch._assert_async``: no host sync; a mismatch is a
    device-side assertion, fatal to the process, as NCCL mismatches are)."""
    words = headers.reshape(-1).view(torch.int64).view(-1, _header.HEADER_WORDS)  # a copy unless one row
    if words.device.type == "cpu":
        raise_on_mismatch(stamp.op, stamp.rank, words.tolist(), stamp.words, senders, stamp.call)
        return
    expected = torch.tensor([[w if i != 2 else s for i, w in enumerate(stamp.words)] for s in senders],
                            dtype=torch.int64).to(words.device, non_blocking=True)
    message = (f"cpshard {stamp.op}: the ranks of the context-parallel group disagree about this call "
               f"(rank {stamp.rank} received another header); rerun with check=True to name them")
    try:
        torch._assert_async((words == expected).all(), message)
    except TypeError:  # torch without the message overload
        torch._assert_async((words == expected).all())


def all_gather_stamped(local: torch.Tensor, group: Any, size: int, stamp: Stamp) -> torch.Tensor:
    """``(size, *local.shape)``: every rank's ``local`` (contiguous), each sent after this call's header
    and checked against it (a strided view of the received buffer, no copy)."""
    data = wire(local).reshape(-1)
    h = _header.HEADER_BYTES
    send = torch.empty(h + data.numel(), dtype=torch.uint8, device=local.device)
    send[:h].copy_(stamp.bytes_on(local.device), non_blocking=True)
    send[h:].copy_(data)
    out = torch.empty((size, send.numel()), dtype=torch.uint8, device=local.device)
    out[:, :h].zero_()  # a shorter message from a peer leaves "no header", not a stale one
    all_gather_flat(out.view(-1), send, group)
    verify_headers(stamp, out[:, :h], range(size))
    body = out[:, h:]
    if local.dtype != torch.uint8:
        body = body.view(local.dtype)
    return body.view(size, *local.shape)


def all_to_all(rows: torch.Tensor, recv_splits: Sequence[int], send_splits: Sequence[int], group: Any,
                stamp: Stamp) -> torch.Tensor:
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
    verify_headers(stamp, torch.stack(list(headers)), range(len(recv_splits)))
    body = torch.cat(list(bodies))
    if rows.dtype != torch.uint8:
        body = body.view(rows.dtype)
    return body.view(sum(recv_splits), *trailing)
