"""The caller's padded buffer of a batch of plans, the indices torch's load balancer hands out over
it, and the document mask over it. No torch private name here (``_torch.py`` holds those).

**The caller's padded buffer** of a batch row is its documents in the caller's order, each padded
at its end to the plan's padded length (``plan.input_padded_seqlens_py``): ``(S, ...)`` with
``S = plan.total_len``. Row ``cu + p`` of a document starting at ``cu`` holds its token ``p`` for
``p < n``, else a pad row. :func:`to_buffer` builds it, :func:`from_buffer` takes the documents
back; every index of this package refers to it. Lengths ``[5, 3]`` at ``cp = 2``, zigzag (padded
``[8, 4]``)::

    buffer      : d0p0 d0p1 d0p2 d0p3 d0p4 pad pad pad | d1p0 d1p1 d1p2 pad     (rows 0-11)
    rearrange   : 0 1 6 7 8 11 | 2 3 4 5 9 10      (rank 0's rows, then rank 1's)
    restore     : 0 1 6 7 8 9 2 3 4 10 11 5        (rearrange's inverse)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from cpshard.base.dtypes import check_fill
from cpshard.base.errors import check_int, check_tensor, fail
from cpshard.compat.torch_cp._plans import check_plans
from cpshard.index.segments import expand_np
from cpshard.plan.values import ShardPlan

__all__ = ["document_mask_mod", "from_buffer", "rearrange_indices", "to_buffer", "token_rows"]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu" if device is None else device)


def rearrange_indices(plans: Sequence[ShardPlan] | ShardPlan, *, restore: bool = False,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """``(B, S)`` int64 on ``device`` (CPU by default): for each batch row, the rows of the caller's
    padded buffer (module docstring) in rank order, rank 0's ``S / cp`` rows first, as
    ``plan.global_rows(r)`` names them; with ``restore=True`` the inverse permutation. So
    ``buffer.gather(1, rearrange)`` cut into ``cp`` equal pieces gives rank ``r`` exactly
    ``cpshard.shard``'s rows of the row's documents, and ``rearranged.gather(1, restore)`` is the
    buffer again. What :func:`~cpshard.compat.torch_cp.load_balancer`'s ``_generate_indices`` returns,
    public, for code that shards by hand.

    ``plans``: one :class:`ShardPlan` per batch row, all with the same ``total_len`` (``S``) and
    ``cp_size``. Each plan's order is built once and kept by the plan
    (``plan.indices().rank_order()``, closed forms over the rows); each call stacks the rows afresh.
    """
    plans = check_plans(plans)
    which = 1 if restore else 0
    rows = np.stack([plan.indices().rank_order()[which] for plan in plans])
    return torch.from_numpy(rows).to(_device(device))


def token_rows(plan: ShardPlan) -> np.ndarray:
    """``(num_tokens,)`` int64: the buffer row of every token, documents in the caller's order."""
    padded = np.asarray(plan.input_padded_seqlens_py, dtype=np.int64)
    return expand_np(np.cumsum(padded) - padded, np.asarray(plan.input_seqlens_py, dtype=np.int64))


def _seq_dim(seq_dim: Any, dims: int, what: str) -> int:
    """``seq_dim`` checked against a ``dims``-dimensional ``what`` (the batch's dimension 0 is not it)."""
    seq_dim = check_int("seq_dim", seq_dim, minimum=1)
    if seq_dim >= dims:
        fail("seq_dim", seq_dim, f"must name a dimension of the {dims}-dimensional {what} after the batch's "
             "(1 for (B, S, ...), 2 for (B, H, S, D))", "pass the dimension that holds the sequence")
    return seq_dim


def to_buffer(documents: Sequence[Sequence[torch.Tensor]], plans: Sequence[ShardPlan] | ShardPlan, *,
              pad_value: Any = 0, seq_dim: int = 1) -> torch.Tensor:
    """THE way to build the buffer the indices of this package refer to: ``(B, S, ...)``, row ``b``
    holding ``documents[b]`` (tensors ``(n_i, ...)`` in the caller's order, one trailing shape and
    dtype throughout), each padded at its end to ``plans[b]``'s padded length with ``pad_value``
    (checked against the documents' dtype as :func:`cpshard.shard` checks it: ``1.5`` on int64 rows
    or ``-1`` on uint8 rows is a ``ValueError``). :func:`from_buffer` is its inverse. On the
    documents' device.

    ``seq_dim``: the buffer's sequence dimension (1: ``(B, S, ...)``; 2: ``(B, H, S, D)``, the layout
    attention takes); each document then holds its tokens along ``seq_dim - 1`` (``(H, n_i, D)``).
    The buffer is built in that layout (contiguous), no transpose needed.

    >>> from cpshard import ShardPlan
    >>> plan = ShardPlan.build([5, 3], cp_size=2, total_len=12)
    >>> to_buffer([[torch.arange(1, 6), torch.arange(6, 9)]], [plan], pad_value=-1).tolist()
    [[1, 2, 3, 4, 5, -1, -1, -1, 6, 7, 8, -1]]
    """
    plans = check_plans(plans)
    if isinstance(documents, torch.Tensor) or not isinstance(documents, Sequence) or len(documents) != len(plans):
        fail("documents", type(documents).__name__, f"must be a list of {len(plans)} rows (one per plan), each a "
             "list of the row's documents", "pass [[doc, doc, ...], ...] in the caller's order", kind=TypeError)
    first, dim = None, 0
    for b, (docs, plan) in enumerate(zip(documents, plans)):
        lens = plan.input_seqlens_py
        if isinstance(docs, torch.Tensor) or not isinstance(docs, Sequence) or len(docs) != len(lens):
            fail(f"documents[{b}]", type(docs).__name__, f"must be a list of the row's {len(lens)} documents "
                 f"(lengths {list(lens)})", "pass the documents the plan was built for, in the caller's order",
                 kind=TypeError)
        for i, doc in enumerate(docs):
            doc = check_tensor(f"documents[{b}][{i}]", doc)
            if first is None:
                first, dim = doc, _seq_dim(seq_dim, max(doc.dim(), 1) + 1, "buffer (B and a document's)") - 1
            doc = doc.movedim(dim, 0) if doc.dim() > dim else doc
            if doc.dim() == 0 or doc.shape[0] != lens[i] or doc.shape[1:] != first.movedim(dim, 0).shape[1:] \
                    or doc.dtype != first.dtype or doc.device != first.device:
                want = list(first.shape) or [lens[i]]
                want[dim] = lens[i]
                fail(f"documents[{b}][{i}]", f"{doc.dtype} tensor of shape {tuple(docs[i].shape)} on {doc.device}",
                     f"must hold the plan's {lens[i]} tokens along dimension {dim} as {tuple(want)} {first.dtype} "
                     f"rows on {first.device}, like the first document",
                     "pass every document with the length its plan holds and one trailing shape")
    assert first is not None  # a plan holds at least one sequence
    pad_value = check_fill("pad_value", pad_value, first.dtype)
    shape = list(first.shape)
    shape[dim] = plans[0].total_len
    out = torch.full((len(plans), *shape), pad_value, dtype=first.dtype, device=first.device)
    rows_first = out.movedim(dim + 1, 1)  # a view: (B, S, ...) whatever seq_dim
    for b, (docs, plan) in enumerate(zip(documents, plans)):
        if plan.num_tokens:
            rows = torch.from_numpy(token_rows(plan)).to(first.device)
            rows_first[b].index_copy_(0, rows, torch.cat([doc.movedim(dim, 0) for doc in docs]))
    return out


def from_buffer(buffer: torch.Tensor, plans: Sequence[ShardPlan] | ShardPlan, *,
                seq_dim: int = 1) -> list[list[torch.Tensor]]:
    """The documents of a ``(B, S, ...)`` buffer (:func:`to_buffer`'s, or one restored by torch's
    ``context_parallel_unshard``): per batch row, a list of ``(n_i, ...)`` tensors in the caller's
    order, pad rows dropped. Each is a new tensor (an ``index_select``), differentiable.
    ``seq_dim``: the buffer's sequence dimension, as :func:`to_buffer` takes it (2 for ``(B, H, S, D)``:
    documents ``(H, n_i, D)``)."""
    plans = check_plans(plans)
    buffer = check_tensor("buffer", buffer)
    S = plans[0].total_len
    dim = _seq_dim(seq_dim, max(buffer.dim(), 2), "buffer")
    if buffer.dim() < 2 or buffer.shape[0] != len(plans) or buffer.shape[dim] != S:
        lead = "..., " * (dim - 1)
        fail("buffer", f"tensor of shape {tuple(buffer.shape)}",
             f"must be (B, {lead}S, ...) = ({len(plans)}, {lead}{S}, ...): one row per plan, each plan's total_len "
             "long", "pass the buffer to_buffer built (or its unshard), with the seq_dim it was built with")
    rows_first = buffer.movedim(dim, 1)
    out = []
    for b, plan in enumerate(plans):
        rows = torch.from_numpy(token_rows(plan)).to(buffer.device)
        docs = rows_first[b].index_select(0, rows).split(list(plan.input_seqlens_py))
        out.append([doc.movedim(0, dim - 1) for doc in docs])
    return out


def document_mask_mod(plans: Sequence[ShardPlan] | ShardPlan, *, device: torch.device | str | None = None) -> MaskMod:
    """A flex-attention ``mask_mod(b, h, q_idx, kv_idx)`` over the caller's padded buffer (its rows,
    unpermuted: torch's CP block mask maps each rank's rows back through the load balancer before
    calling it): True where ``q_idx`` and ``kv_idx`` hold tokens of one document and
    ``kv_idx <= q_idx``; a pad row attends only to itself, and no token attends to a pad row, so
    pad rows never change a token's output (and no row is fully masked).

    One table lookup per call, vmap-friendly: ``key[b, idx]`` is the row's document (caller's
    index) on token rows and ``-1 - idx`` on pad rows, so ``key[b, q] == key[b, kv] and kv <= q``
    is the whole rule. The table lives on ``device`` (CPU by default): the device the block mask is
    built on. Called with broadcastable index tensors it also gives the explicit mask, e.g.
    ``mask_mod(b[:, None, None, None], 0, q[:, None], kv[None, :])``.

    Build its ``BlockMask`` with ``B`` = the number of plans (one per batch row), not a ``B = 1``
    mask broadcast over the batch: each row has its own documents and its own rank order.
    """
    plans = check_plans(plans)
    S = plans[0].total_len
    keys = np.empty((len(plans), S), dtype=np.int64)
    rows = np.arange(S, dtype=np.int64)
    for b, plan in enumerate(plans):  # per batch row: one expansion over the row
        padded = np.asarray(plan.input_padded_seqlens_py, dtype=np.int64)
        doc = np.repeat(np.arange(padded.size, dtype=np.int64), padded)
        keys[b] = -1 - rows
        tokens = token_rows(plan)
        keys[b, tokens] = doc[tokens]
    table = torch.from_numpy(keys).to(_device(device))

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (table[b, q_idx] == table[b, kv_idx]) & (kv_idx <= q_idx)

    return mask_mod
