"""Padded ``(B, S, ...)`` batches with an attention mask <-> jagged nested tensors, without loops.

Like flash-attention's ``unpad_input`` / ``pad_input``, both directions are driven by one integer
index of the token positions (integer indices, not boolean masks, on the data path).
"""

from __future__ import annotations

from typing import Any

import torch

from cpshard.base.dtypes import check_fill, movable
from cpshard.base.errors import check_int, check_tensor, fail
from cpshard.plan.args import jagged

__all__ = ["from_padded", "to_padded"]


def from_padded(x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The token rows of a padded batch as a jagged nested tensor ``(B, j, ...)``.

    Args:
        x: ``(B, S, ...)``, any dtype.
        attention_mask: ``(B, S)``, True (or 1) on tokens; each row's tokens form one run, so left
            and right padding both work. One device-to-host copy (the lengths).

    Example::

        >>> x = torch.tensor([[0, 0, 7, 8], [5, 6, 9, 0]])
        >>> m = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
        >>> from_padded(x, m).offsets(), from_padded(x, m).values()
        (tensor([0, 2, 5]), tensor([7, 8, 5, 6, 9]))
    """
    x = check_tensor("x", x)
    mask = check_tensor("attention_mask", attention_mask)
    if mask.dim() != 2 or x.dim() < 2 or tuple(x.shape[:2]) != tuple(mask.shape):
        fail("attention_mask", f"shape {tuple(mask.shape)} for x of shape {tuple(x.shape)}",
             "must be (B, S) matching x's first two dimensions", "pass the batch's (B, S) attention mask")
    if mask.device != x.device:
        fail("attention_mask", f"on {mask.device}", f"must be on x's device ({x.device})", "move it with .to(x.device)")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        fail("attention_mask", f"dtype {mask.dtype}", "must be bool or integer 0/1", "pass mask.bool()", kind=TypeError)
    mask = mask.bool()
    b, s = mask.shape
    if b == 0:
        fail("attention_mask", f"shape {tuple(mask.shape)}", "must hold at least one row (B >= 1)",
             "pass a non-empty batch")
    lengths = mask.sum(1)
    # A row's tokens form one run iff it has at most one rising edge (counting a start at column 0).
    rises = (mask[:, 1:] & ~mask[:, :-1]).sum(1) + mask[:, 0] if s else torch.zeros_like(lengths)
    stats = torch.stack([rises.max() if b else lengths.new_zeros(()), lengths.sum()]).tolist()  # one sync
    if stats[0] > 1:
        bad = int(torch.nonzero(rises > 1)[0])
        fail("attention_mask", f"row {bad} = {mask[bad].int().tolist()}",
             "each row's tokens must be one contiguous run (left or right padding)",
             "pack rows with holes yourself, or pass a left/right-padded batch")
    index = torch.nonzero(mask.reshape(-1)).flatten()
    values = x.reshape(b * s, *x.shape[2:]).index_select(0, index)
    offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    return jagged(values, offsets)


def to_padded(nt: torch.Tensor, *, padding_side: str = "right", length: int | None = None,
              pad_value: Any = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A jagged nested tensor as a padded batch and its attention mask: the inverse of ``from_padded``.

    Args:
        nt: jagged nested tensor ``(B, j, ...)``.
        padding_side: ``"right"`` (tokens first) or ``"left"`` (tokens last).
        length: ``S``; default the longest sequence. Must be at least that long.
        pad_value: value of pad entries.

    Returns:
        ``(x, attention_mask)``: ``(B, S, ...)`` and ``(B, S)`` bool. One device-to-host copy.
    """
    if not (isinstance(nt, torch.Tensor) and nt.is_nested and nt.layout == torch.jagged):
        fail("nt", type(nt).__name__, "must be a jagged nested tensor", "build one with "
             "torch.nested.nested_tensor_from_jagged or cpshard.unshard", kind=TypeError)
    if padding_side not in ("right", "left"):
        fail("padding_side", repr(padding_side), "must be 'right' or 'left'", "pass padding_side='right' or 'left'")
    if getattr(nt, "_lengths", None) is not None:
        fail("nt", "non-contiguous jagged tensor", "must have no holes (lengths=None)", "pass compact values")
    values, offsets = nt.values(), nt.offsets()  # type: ignore[attr-defined]
    lengths = offsets[1:] - offsets[:-1]
    b, n = lengths.numel(), values.shape[0]
    first, last, longest = torch.stack([offsets[0], offsets[-1], lengths.max() if b else offsets[0] * 0]).tolist()
    if first != 0 or last != n:  # the one sync, above
        fail("nt", f"nested tensor with offsets [{first}, ..., {last}] over {n} value rows",
             "its offsets must start at 0 and end at the number of value rows",
             "build it with torch.nested.nested_tensor_from_jagged(values, offsets) with compact offsets")
    pad_value = check_fill("pad_value", pad_value, values.dtype)
    if length is None:
        length = longest
    length = check_int("length", length, minimum=0)
    if length < longest:
        fail("length", length, f"must be >= the longest sequence ({longest})", f"pass length >= {longest}")
    seq = torch.repeat_interleave(torch.arange(b, device=values.device), lengths, output_size=n)
    pos = torch.arange(n, device=values.device) - offsets[:-1][seq]
    if padding_side == "left":
        pos = pos + (length - lengths)[seq]
    index = seq * length + pos
    moved = movable(values, pad_value, pad_value)  # fp8, uintN: copy the bits
    carried, fill = (values, pad_value) if moved is None else moved[:2]
    out = carried.new_full((b * length, *values.shape[1:]), fill)
    out.index_copy_(0, index, carried)
    out = out.view(values.dtype)
    mask = torch.zeros(b * length, dtype=torch.bool, device=values.device)
    mask[index] = True
    return out.view(b, length, *values.shape[1:]), mask.view(b, length)
