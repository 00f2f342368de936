"""verl's Ulysses helpers (``verl/utils/ulysses.py``, the FSDP backend's sequence parallelism) at one ring rank.

Six drop-ins with verl's names, parameters and return structure: ``ulysses_pad`` (the packed row padded
to a multiple of ``sp_size``, pad positions ``0, 1, ...``), ``ulysses_pad_and_slice_inputs`` (padded,
then this rank's slice), ``slice_input_tensor`` (this rank's equal piece of one dimension),
``gather_outputs_and_unpad`` (every rank's piece concatenated, the pad dropped; verl's ``Gather``
gradient: this rank's own slice, times the group size with ``grad_scaler``),
``gather_seq_scatter_heads`` and ``gather_heads_scatter_seq`` (Ulysses' all-to-all and its inverse).
Every output and every input gradient equals verl's bit for bit on the same inputs
(tests/test_verl_ulysses.py, against verl 0.9.1's functions on gloo ranks; verl main's
``ulysses.py`` is the same file), except where docs/verl.md's "FSDP backend: the Ulysses drop-ins"
lists a difference: an explicit ``group=`` gives ``slice_input_tensor`` this rank's place in that group
(verl takes it from its set group), and inputs on which verl returns a tensor of the wrong size or
stops at an ``assert`` raise a clear error here.

The group, as verl reads it: ``group=`` where given, else the group set by verl's
``set_ulysses_sequence_parallel_group`` (read from ``verl.utils.ulysses`` at each call; none when verl
is not importable), else none: the collective helpers then return their input, and
``slice_input_tensor`` (like verl) slices by the world group's size at rank 0.

The collectives run in :mod:`cpshard.distributed.ulysses` (``exchange_dims``, ``all_gather_dim``).
With a ring axis (``CPSHARD_RING=R``, :mod:`cpshard.compat.verl._fsdp`) the FSDP engine's micro-batch
runs inside :func:`ring_rows`: then ``ulysses_pad_and_slice_inputs`` and ``gather_outputs_and_unpad``
called without ``group=`` cut and restore by the micro-batch's two-axis plan instead, and the four others
raise (verl's group is then both axes: its slices and exchanges would not match the plan's rows).

Sources read (not copied): verl 0.9.1's and verl main's (1dda039) ``verl/utils/ulysses.py``,
``verl/workers/engine/fsdp/transformer_impl.py``, ``verl/models/transformers/monkey_patch.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from cpshard.base.errors import check_int, check_tensor, fail
from cpshard.distributed.groups import read_group
from cpshard.distributed.ulysses import all_gather_dim, exchange_dims

__all__ = ["ULYSSES_DROP_INS", "gather_heads_scatter_seq", "gather_outputs_and_unpad", "gather_seq_scatter_heads",
           "ring_rows", "slice_input_tensor", "ulysses_pad", "ulysses_pad_and_slice_inputs", "verl_group"]


_RING: list[Any] = []  # the two-axis rows of the micro-batch in force (ring_rows)


@contextlib.contextmanager
def ring_rows(rows: Any) -> Iterator[None]:
    """Inside, the helpers called without ``group=`` follow ``rows`` (``slice``, ``gather``, ``refuse``:
    :class:`cpshard.compat.verl.RingRows`)."""
    _RING.append(rows)
    try:
        yield
    finally:
        _RING.remove(rows)


def _ring(group: Any, fn: str) -> Any:
    """The ring rows in force for a call without ``group=``; the four helpers that have no two-axis
    meaning refuse (``fn``)."""
    rows = _RING[-1] if _RING and group is None else None
    if rows is not None and fn:
        rows.refuse(fn)
    return rows


def verl_group() -> Any:
    """The group verl's ``set_ulysses_sequence_parallel_group`` set, or None (none set, or no verl)."""
    try:
        from verl.utils.ulysses import get_ulysses_sequence_parallel_group
    except ImportError:
        return None
    return get_ulysses_sequence_parallel_group()


def _group(group: Any) -> Any:
    return verl_group() if group is None else group


def _read(group: Any, what: str, fn: str) -> int:
    value = read_group(group, what)
    if value is None:
        fail("group", repr(group), f"{fn} reads the {what} of this group (of the world group where no group is "
             "given or set, as verl does) and torch.distributed does not know it",
             "initialize torch.distributed and pass the Ulysses group, or set verl's with "
             "verl.utils.ulysses.set_ulysses_sequence_parallel_group")
    return value


def _dim(x: torch.Tensor, name: str, dim: Any) -> int:
    dim = check_int(name, dim)
    if not -x.dim() <= dim < x.dim():
        fail(name, dim, f"must name a dimension of the tensor of shape {tuple(x.shape)}",
             f"pass {name} in [{-x.dim()}, {x.dim() - 1}]")
    return dim


def _exchange_args(x: torch.Tensor, seq_dim: Any, head_dim: Any, group: Any, fn: str) -> tuple[int, int, int]:
    """The two dimensions of an exchange, checked, and the group's size."""
    check_tensor("x", x)
    return _dim(x, "seq_dim", seq_dim), _dim(x, "head_dim", head_dim), _read(group, "size", fn)


def _zero_pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with ``size`` zero rows appended along ``dim`` (verl's ``_pad_tensor``)."""
    shape = list(x.shape)
    shape[dim] = size
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def ulysses_pad(
    input_ids_rmpad: torch.Tensor, position_ids_rmpad: torch.Tensor | None = None, sp_size: int = 1, pad_value: Any = 0
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The packed row padded at its end to a multiple of ``sp_size`` (verl's ``ulysses_pad``).

    Args:
        input_ids_rmpad: ``(B, T)``; padded with ``pad_value``.
        position_ids_rmpad: ``(1, T)`` or ``(C, 1, T)`` (multimodal RoPE); the pad positions are
            ``arange(pad)`` (int64, so a narrower position dtype widens as verl's ``torch.cat`` does).
        sp_size: at most 1: both returned as given, pad 0.

    Returns:
        ``(input_ids, position_ids, pad)``, ``pad = (-T) % sp_size``; the inputs themselves where
        ``pad`` is 0.
    """
    check_tensor("input_ids_rmpad", input_ids_rmpad)
    if sp_size > 1:
        _ring(None, "ulysses_pad")
    if position_ids_rmpad is not None:
        check_tensor("position_ids_rmpad", position_ids_rmpad)
        if position_ids_rmpad.dim() < 2 or position_ids_rmpad.size(-2) != 1:
            fail("position_ids_rmpad", f"a tensor of shape {tuple(position_ids_rmpad.shape)}",
                 "must have size 1 in its second-to-last dimension (one packed row)",
                 "pass the packed row's positions as (1, T) or (C, 1, T)")
        if input_ids_rmpad.dim() == 0 or input_ids_rmpad.size(-1) != position_ids_rmpad.size(-1):
            fail("position_ids_rmpad", f"a tensor of shape {tuple(position_ids_rmpad.shape)}",
                 f"must have as many tokens as input_ids_rmpad {tuple(input_ids_rmpad.shape)} in the last dimension",
                 "pass the positions of the same packed row")
    if sp_size <= 1:
        return input_ids_rmpad, position_ids_rmpad, 0
    sp_size = check_int("sp_size", sp_size)
    if input_ids_rmpad.dim() != 2:
        fail("input_ids_rmpad", f"a tensor of shape {tuple(input_ids_rmpad.shape)}", "must be (B, T)",
             "pass the packed row as (1, T)")
    pad = -input_ids_rmpad.size(1) % sp_size
    if pad == 0:
        return input_ids_rmpad, position_ids_rmpad, 0
    input_ids_rmpad = torch.nn.functional.pad(input_ids_rmpad, (0, pad), value=pad_value)
    if position_ids_rmpad is not None:
        if position_ids_rmpad.dim() not in (2, 3):
            fail("position_ids_rmpad", f"a tensor of shape {tuple(position_ids_rmpad.shape)}",
                 "must be (1, T) or (C, 1, T) to be padded", "pass the packed row's positions in one of these shapes")
        extra = torch.arange(pad, device=position_ids_rmpad.device)
        position_ids_rmpad = torch.cat((position_ids_rmpad, extra.expand(*position_ids_rmpad.shape[:-1], pad)), dim=-1)
    return input_ids_rmpad, position_ids_rmpad, pad


def slice_input_tensor(x: torch.Tensor, dim: int, padding: bool = True, group: Any = None) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` (verl's ``slice_input_tensor``): ``x`` zero-padded to a
    multiple of the group size first where ``padding``, else its last ``size % n`` rows left out;
    contiguous. The group: ``group``, verl's set group, or the world group at rank 0 (as verl).
    """
    check_tensor("x", x)
    dim = _dim(x, "dim", dim)
    _ring(group, "slice_input_tensor")
    group = _group(group)
    n = _read(group, "size", "slice_input_tensor")
    rank = 0 if group is None else _read(group, "rank", "slice_input_tensor")
    if rank < 0:
        fail("group", repr(group), f"does not contain this process (global rank {read_group(None, 'rank')})",
             "pass (or set in verl) the Ulysses group this rank belongs to")
    if padding and x.size(dim) % n:
        x = _zero_pad(x, dim, -x.size(dim) % n)
    part = x.size(dim) // n
    return x.narrow(dim, rank * part, part).contiguous()


def ulysses_pad_and_slice_inputs(
    input_ids_rmpad: torch.Tensor,
    position_ids_rmpad: torch.Tensor | None = None,
    sp_size: int = 1,
    skip_position_ids_rmpad: bool = False,
    pad_value: Any = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """:func:`ulysses_pad`, then this rank's piece of dimension 1 of the ids (and of the positions unless
    ``skip_position_ids_rmpad``) by :func:`slice_input_tensor` with verl's group (verl's
    ``ulysses_pad_and_slice_inputs``). Returns ``(ids, positions, pad)``. Inside :func:`ring_rows`: this
    rank's rows of the micro-batch's two-axis plan, pad 0 (the plan's pad rows are its own)."""
    rows = _ring(None, "")
    if rows is not None:
        return rows.slice(input_ids_rmpad, position_ids_rmpad, sp_size, skip_position_ids_rmpad, pad_value)
    input_ids_rmpad, position_ids_rmpad, pad = ulysses_pad(input_ids_rmpad, position_ids_rmpad, sp_size,
                                                           pad_value=pad_value)
    input_ids_rmpad = slice_input_tensor(input_ids_rmpad, dim=1, padding=False)
    if position_ids_rmpad is not None and not skip_position_ids_rmpad:
        position_ids_rmpad = slice_input_tensor(position_ids_rmpad, dim=1, padding=False)
    return input_ids_rmpad, position_ids_rmpad, pad


def gather_outputs_and_unpad(
    x: torch.Tensor,
    gather_dim: int,
    unpad_dim: int | None = None,
    padding_size: int = 0,
    grad_scaler: bool = True,
    group: Any = None,
) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``gather_dim`` in group order, then the last
    ``padding_size`` rows of ``unpad_dim`` dropped (verl's ``gather_outputs_and_unpad``). ``x`` itself
    where no group is given or set. Gradient, as verl's ``Gather``: this rank's own slice of its own
    gradient, times the group size where ``grad_scaler`` (no sum over the ranks). Inside
    :func:`ring_rows` (no ``group=``): the two-axis plan's restore, then the same unpad and gradient."""
    rows = _ring(group, "")
    if rows is not None:
        return rows.gather(x, gather_dim, unpad_dim, padding_size, grad_scaler)
    group = _group(group)
    if group is None:
        return x
    check_tensor("x", x)
    gather_dim = _dim(x, "gather_dim", gather_dim)
    if unpad_dim is not None:
        if isinstance(padding_size, bool) or not isinstance(padding_size, int):
            fail("padding_size", repr(padding_size), "must be an int where unpad_dim is given (verl asserts it)",
                 "pass the pad size ulysses_pad returned", kind=TypeError)
        unpad_dim = _dim(x, "unpad_dim", unpad_dim) % x.dim()
        size = x.size(unpad_dim) * (_read(group, "size", "gather_outputs_and_unpad")
                                    if unpad_dim == gather_dim % x.dim() else 1)
        if not 0 <= padding_size <= size:
            fail("padding_size", padding_size, f"must be in [0, {size}] (the gathered size of dimension {unpad_dim}); "
                 "verl returns a tensor of the wrong size", "pass the pad size ulysses_pad returned")
    out = all_gather_dim(x, group, dim=gather_dim, grad="own_scaled" if grad_scaler else "own")
    if unpad_dim is None or padding_size == 0:
        return out
    return out.narrow(unpad_dim, 0, out.size(unpad_dim) - padding_size)


def gather_seq_scatter_heads(
    x: torch.Tensor, seq_dim: int, head_dim: int, unpadded_dim_size: int = 0, group: Any = None
) -> torch.Tensor:
    """Ulysses' exchange before attention (verl's ``gather_seq_scatter_heads``): ``[.., S/n, H, ..]`` ->
    ``[.., S, H/n, ..]``, then cut to ``unpadded_dim_size`` rows of ``seq_dim`` where that is not a
    multiple of the group size. ``x`` itself where no group is given or set. Backward: the inverse
    exchange."""
    _ring(group, "gather_seq_scatter_heads")
    group = _group(group)
    if not group:
        return x
    seq_dim, head_dim, n = _exchange_args(x, seq_dim, head_dim, group, "gather_seq_scatter_heads")
    cut = bool(unpadded_dim_size) and unpadded_dim_size % n != 0
    if cut and not 0 < unpadded_dim_size < n * x.size(seq_dim):
        fail("unpadded_dim_size", unpadded_dim_size, f"must be in [1, {n * x.size(seq_dim)}) (the gathered "
             "sequence length) where it is not a multiple of the group size; verl returns a tensor of the "
             "wrong size", "pass the sequence length before ulysses_pad")
    out = exchange_dims(x, group, scatter_dim=head_dim, gather_dim=seq_dim)
    return out.narrow(seq_dim, 0, unpadded_dim_size) if cut else out


def gather_heads_scatter_seq(x: torch.Tensor, head_dim: int, seq_dim: int, group: Any = None) -> torch.Tensor:
    """Ulysses' exchange after attention (verl's ``gather_heads_scatter_seq``): ``[.., S, H/n, ..]`` ->
    ``[.., S/n, H, ..]``, ``seq_dim`` zero-padded to a multiple of the group size first. ``x`` itself
    where no group is given or set. Backward: the inverse exchange."""
    _ring(group, "gather_heads_scatter_seq")
    group = _group(group)
    if not group:
        return x
    seq_dim, head_dim, n = _exchange_args(x, seq_dim, head_dim, group, "gather_heads_scatter_seq")
    if x.size(seq_dim) % n:
        x = _zero_pad(x, seq_dim, -x.size(seq_dim) % n)
    return exchange_dims(x, group, scatter_dim=seq_dim, gather_dim=head_dim)


#: verl's six helpers in ``verl.utils.ulysses``, by name -> the drop-ins (``patch()`` binds them)
ULYSSES_DROP_INS = {fn.__name__: fn for fn in (ulysses_pad, ulysses_pad_and_slice_inputs, slice_input_tensor,
                                               gather_outputs_and_unpad, gather_seq_scatter_heads,
                                               gather_heads_scatter_seq)}
