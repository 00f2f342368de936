"""A packed row as Hugging Face's padding-free collators give it, cut for ``R`` ring ranks times ``U``
Ulysses ranks: the documents read from the position ids, the plan, this rank's rows and the way back.

Note [The two-axis layout]
--------------------------
One plan describes every rank's rows: ``ShardPlan.build(lengths, cp_size=R, tp_size=U, padding=...)``
(contiguous: with ``reorder="balanced"``; Note [Padding of the ring plan]). Ring rank ``r`` holds the plan's
``L = local_len`` rows, the ones ``cpshard.shard(x, plan, r)`` gives; the plan's ``tp_size`` keeps
``L`` divisible by ``U``, and Ulysses rank ``u`` of that ring rank holds the ``u``-th of ``U``
consecutive equal pieces, rows ``u * L / U .. (u + 1) * L / U - 1``: Megatron's sequence-parallel
split of a CP rank, which is what ``tp_size`` already means for the plan. So no second plan kind is
needed: a rank's rows are a slice of its ring rank's, every guarantee of ``shard``, the shifts,
``unshard`` and the losses holds for the ring rank's rows, and the Ulysses all-to-all of attention
puts exactly those rows back together (its group ranks are the pieces, in order). A two-axis plan type
would repeat the ring plan's index service for the same rows.

Note [Padding of the ring plan]
-------------------------------
Zigzag's default is ``padding="none"`` (SPEC "Zigzag without padding"): no document is padded, its
``2R`` chunks may differ by one row, and only the total is extended, by at most ``R * U - 1`` rows at the
end of the last document, so that every ring rank holds ``L`` rows divisible by ``U``. Nothing of this
layer reads zigzag as equal chunks: the attention masks come from the plan's per-row sequence ids,
positions and token masks, flash's metadata from its segments (``cpshard.plan.varlen``), and the shifts,
restore and loss from the plan's index service, all of which hold for any plan. ``padding="minimal"``
(each document padded to a multiple of ``2R``) stays selectable: the plan that equal-chunk kernels and
micro-batch packing need. Contiguous pads no document under either (``"minimal"`` is its default and
``"none"`` gives the same rows); anything else (``"aligned"``) is refused: it only adds pad rows here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cpshard.base.errors import check_int, check_tensor, fail
from cpshard.base.layout import Layout, Padding
from cpshard.index.segments import document_runs
from cpshard.plan.values import ShardPlan

__all__ = ["PADDINGS", "SequenceBatch", "build_plan", "check_layout", "check_padding", "document_lengths",
           "packed_rows", "piece", "rank_batch", "shard_row"]

#: the paddings of the ring plan (Note [Padding of the ring plan])
PADDINGS = ("none", "minimal")


def _row(name: str, x: Any, integer: bool = True) -> torch.Tensor:
    """``x`` as the packed row's ``(T,)``: HF's ``(1, T)`` (or ``(T,)``)."""
    x = check_tensor(name, x)
    if x.is_nested or x.dim() not in (1, 2) or (x.dim() == 2 and x.shape[0] != 1):
        fail(name, f"tensor of shape {tuple(x.shape)}", "must be one packed row (1, T), as a padding-free "
             "collator gives it (DataCollatorWithFlattening)", f"pass {name} of shape (1, T): the documents "
             "packed one after another")
    if integer and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        fail(name, f"a {x.dtype} tensor", "must hold integers", f"pass {name} as int64", kind=TypeError)
    return x.reshape(-1)


def document_lengths(position_ids: Any) -> list[int]:
    """The documents' lengths of a packed row ``(1, T)``, read from its position ids: a document starts
    where the position id is 0 and counts ``0, 1, ..., n - 1`` (HF's ``DataCollatorWithFlattening``,
    ``return_position_ids=True``). ``ValueError`` naming the first row that breaks this."""
    pos = _row("position_ids", position_ids)
    if pos.numel() == 0:
        fail("position_ids", "an empty row", "must hold at least one token", "pass a non-empty packed row")
    # int64: a narrow dtype's diff wraps (int8: 127 -> -128 reads +1). NumPy: a few passes over T int64, tens of
    # microseconds at 128k
    host = pos.detach().cpu().numpy().astype(np.int64)
    lengths, bad = document_runs(host[None])
    if bad is not None:
        first = bad[1]
        shown = host[max(first - 2, 0):first + 3].tolist()
        fail("position_ids", f"a row with {host[first]} at index {first} (around it: {shown})",
             "must be runs 0, 1, ..., n - 1, one per packed document (a document starts where the id is 0)",
             "pass the position ids of a padding-free collator (transformers' DataCollatorWithFlattening), "
             "or torch.cat([torch.arange(n) for n in lengths])[None]")
    return lengths[0].tolist()


def check_layout(layout: Any) -> Layout:
    """``"zigzag"`` or ``"contiguous"`` (with the balanced order), as a :class:`~cpshard.Layout`."""
    layout = Layout.parse(layout)
    if layout not in (Layout.ZIGZAG, Layout.CONTIGUOUS):
        fail("layout", repr(layout.value), "must be 'zigzag' or 'contiguous'", "pass one of them")
    return layout


def check_padding(padding: Any, layout: Layout) -> str:
    """``"none"`` or ``"minimal"``; ``None``: the layout's default (zigzag ``"none"``, contiguous ``"minimal"``;
    Note [Padding of the ring plan])."""
    if padding is None:
        return "none" if layout is Layout.ZIGZAG else "minimal"
    value = Padding.parse(padding).value
    if value not in PADDINGS:
        fail("padding", repr(value), f"must be one of {PADDINGS} for a Hugging Face packed row ('aligned' pads "
             "every document to 2 * R * U rows, which no kernel of this layer needs)",
             "pass padding='none' (zigzag's default: no document padded) or 'minimal' (each document to 2 * R)")
    return value


def build_plan(lengths: list[int], ring: int, ulysses: int, layout: str, padding: str) -> ShardPlan:
    """The ring plan of Note [The two-axis layout], padded as Note [Padding of the ring plan] says: the one
    builder of this layer's plans."""
    reorder = "balanced" if layout == "contiguous" else None
    return ShardPlan.build(lengths, cp_size=ring, tp_size=ulysses, layout=layout, padding=padding, reorder=reorder)


def packed_rows(input_ids: Any, position_ids: Any, labels: Any, ring: int, ulysses: int, layout: str,
                padding: str) -> tuple[ShardPlan, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The ring plan of a packed row and its ``(T,)`` token ids, positions and labels, checked. No communication."""
    ids = _row("input_ids", input_ids)
    pos = _row("position_ids", position_ids)
    if ids.shape != pos.shape:
        fail("position_ids", f"{pos.numel()} positions", f"must match input_ids' {ids.numel()} tokens",
             "pass the position ids of the same packed row")
    lab = None
    if labels is not None:
        lab = _row("labels", labels)
        if lab.shape != ids.shape:
            fail("labels", f"{lab.numel()} labels", f"must match input_ids' {ids.numel()} tokens (unshifted: "
                 "transformers' labels, -100 where ignored)", "pass the labels of the same packed row")
        lab = _labels(lab)
    rows = (ids, pos.to(torch.int64), lab)  # positions as int64, not ids' dtype: int8 ids wrapped them
    return build_plan(document_lengths(pos), ring, ulysses, layout, padding), rows


def _labels(lab: torch.Tensor) -> torch.Tensor:
    """``lab`` as int64 (cross entropy's targets), each -100 (ignored) or a class >= 0, read on the host."""
    lab = lab.to(torch.int64)
    host = lab.detach().cpu().numpy()
    bad = np.flatnonzero((host < 0) & (host != -100))
    if bad.size:
        first = int(bad[0])
        fail("labels", f"a row with {host[first]} at index {first}", "must be -100 (ignored) or a class >= 0",
             "mark ignored tokens with -100 (transformers' ignore index)")
    return lab


def rank_batch(plan: ShardPlan, rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], ring_rank: int,
               ulysses_rank: int, sp: Any) -> SequenceBatch:
    """Rank ``(r, u)``'s :class:`SequenceBatch` of the checked rows (Note [The two-axis layout])."""
    from cpshard.ops.sharding import shard

    ids, pos, lab = rows
    r, u = ring_rank, ulysses_rank
    return SequenceBatch(
        input_ids=piece(shard(ids, plan, r), plan, u), position_ids=piece(shard(pos, plan, r), plan, u),
        labels=None if lab is None else piece(shard(lab, plan, r, shift=1, fill=-100), plan, u),
        plan=plan, ring_rank=r, ulysses_rank=u, sp=sp, max_label=-100 if lab is None else int(lab.max()))


def shard_row(input_ids: Any, position_ids: Any, labels: Any = None, *, ring_size: int, ulysses_size: int = 1,
              ring_rank: int, ulysses_rank: int = 0, layout: str = "zigzag", padding: str | None = None
              ) -> SequenceBatch:
    """Rank ``(ring_rank, ulysses_rank)``'s :class:`SequenceBatch` of a packed row, without process groups:
    what :meth:`SequenceParallel.shard` computes, for a data loader's workers or a host-side benchmark.
    No communication. The batch serves ``sp.attend`` and ``sp.loss`` of the matching ``SequenceParallel``;
    its ``restore`` needs the groups: call ``sp.restore(x, batch)``. ``layout`` and ``padding`` as there
    (Note [Padding of the ring plan])."""
    ring_size = check_int("ring_size", ring_size, minimum=1)
    ulysses_size = check_int("ulysses_size", ulysses_size, minimum=1)
    ring_rank = check_int("ring_rank", ring_rank, minimum=0, maximum=ring_size - 1)
    ulysses_rank = check_int("ulysses_rank", ulysses_rank, minimum=0, maximum=ulysses_size - 1)
    layout = check_layout(layout)
    plan, rows = packed_rows(input_ids, position_ids, labels, ring_size, ulysses_size, layout.value,
                             check_padding(padding, layout))
    return rank_batch(plan, rows, ring_rank, ulysses_rank, None)


def piece(rows: torch.Tensor, plan: ShardPlan, ulysses_rank: int) -> torch.Tensor:
    """Ulysses rank ``u``'s consecutive piece of its ring rank's ``(L, ...)`` rows, as ``(1, L / U, ...)``."""
    size = plan.local_len // plan.tp_size
    return rows[ulysses_rank * size:(ulysses_rank + 1) * size].unsqueeze(0)


@dataclass(frozen=True, eq=False)
class SequenceBatch:
    """This rank's rows of one packed micro-batch (what :meth:`SequenceParallel.shard` returns).

    ``input_ids``, ``position_ids``, ``labels``: ``(1, L / U)``. ``position_ids`` is each token's
    position in its document (RoPE); ``labels`` the shifted label of each row (the next token's label
    in the same document, ``-100`` at each document's last token and on pad rows: transformers'
    ``shift_labels``), ``None`` without labels. ``plan`` is the ring plan (Note [The two-axis
    layout]); ``ring_rank`` and ``ulysses_rank`` place this rank.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None
    plan: ShardPlan
    ring_rank: int
    ulysses_rank: int
    sp: Any = field(repr=False)
    #: the packed row's largest label (every rank's rows, not this rank's): ``sp.loss`` checks the vocabulary
    max_label: int = field(default=-100, repr=False)

    @property
    def num_tokens(self) -> int:
        """Tokens of the packed row, ``T``."""
        return self.plan.num_tokens

    def token_mask(self) -> torch.Tensor:
        """``(1, L / U)`` bool: True on this rank's token rows, False on pad rows."""
        return piece(self.plan.token_mask(self.ring_rank), self.plan, self.ulysses_rank)

    def shard(self, x: torch.Tensor, *, shift: int = 0, pad_value: Any = None, fill: Any = 0) -> torch.Tensor:
        """This rank's ``(1, L / U, ...)`` rows of any per-token tensor of the packed row ``(1, T, ...)`` (loss
        weights, advantages, a second label): ``cpshard.shard`` on the ring plan, optionally shifted inside
        each document (``shift``, ``fill``, ``pad_value`` as there), cut to this rank's Ulysses piece. No
        communication."""
        from cpshard.ops.sharding import shard

        x = check_tensor("x", x)
        if x.dim() < 2 or x.shape[0] != 1 or x.shape[1] != self.plan.num_tokens:
            fail("x", f"tensor of shape {tuple(x.shape)}", f"must be the packed row (1, T, ...) with T = "
                 f"{self.plan.num_tokens}", "pass a tensor of the row given to sp.shard")
        rows = shard(x[0], self.plan, self.ring_rank, shift=shift, pad_value=pad_value, fill=fill)
        return piece(rows, self.plan, self.ulysses_rank)

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``(1, L / U, ...)`` rows back to the packed row ``(1, T, ...)``, in the caller's
        order, pad rows dropped, on every rank (the logits, hidden states, per-token values). One
        all-gather over the Ulysses group, one over the ring group (cpshard's ``gather_tokens``)."""
        if self.sp is None:
            fail("batch", "a batch from shard_row (no process groups)", "cannot restore by itself",
                 "call sp.restore(x, batch) with the SequenceParallel that holds the groups")
        return self.sp.restore(x, self)
