"""Parsing the arguments every plan builder takes: lengths (ints, tensors, NumPy arrays, jagged nested
tensors), sizes, layout and ``fp8``. Clear errors before any work; no plan, no index math."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from cpshard.base.errors import check_int, check_real, fail
from cpshard.base.layout import Layout

__all__ = ["check_shift", "int_tuple", "jagged", "jagged_lengths", "parse_plan_args", "parse_seqlens", "plain_ints"]


def parse_seqlens(seqlens: Any, name: str = "seqlens") -> tuple[int, ...]:
    """Sequence lengths as a tuple of Python ints, from ints, a 1-D integer tensor or a jagged tensor.

    A tensor costs exactly one device-to-host copy here; nothing later reads lengths back.
    """
    values: list[Any]
    if type(seqlens) in (list, tuple) and plain_ints(seqlens):
        return tuple(seqlens)  # the common case, checked at C speed
    if isinstance(seqlens, np.ndarray) and seqlens.ndim == 1 and seqlens.dtype.kind in "iu" and seqlens.size \
            and seqlens.min() >= 0:
        return tuple(seqlens.tolist())  # a NumPy array of counts (plans_from_positions'), checked in NumPy
    if isinstance(seqlens, torch.Tensor) and seqlens.is_meta:
        fail(name, "a tensor on the meta device", "must hold real values", "pass the lengths on a real device")
    if isinstance(seqlens, torch.Tensor) and seqlens.is_nested:
        values = list(jagged_lengths(seqlens, name))
    elif isinstance(seqlens, torch.Tensor):
        if seqlens.dim() != 1:
            fail(name, f"tensor of shape {tuple(seqlens.shape)}", "must be 1-D, one length per sequence",
                 "pass a (B,) tensor or a list of ints")
        if seqlens.dtype.is_floating_point or seqlens.dtype.is_complex or seqlens.dtype == torch.bool:
            fail(name, f"tensor of dtype {seqlens.dtype}", "must hold integers",
                 "pass an integer tensor (e.g. torch.int32) or a list of ints", kind=TypeError)
        values = seqlens.tolist()
    elif hasattr(seqlens, "tolist") and getattr(seqlens, "ndim", None) == 1:  # a NumPy array
        values = list(seqlens.tolist())
    elif isinstance(seqlens, (str, bytes)) or not isinstance(seqlens, Sequence):
        fail(name, repr(seqlens), "must be a sequence of ints or a 1-D integer tensor",
             f"pass e.g. {name}=[5, 3]", kind=TypeError)
    else:
        values = list(seqlens)
    if not values:
        fail(name, seqlens, "must hold at least one sequence (B >= 1)", "pass the lengths of a non-empty batch")
    out = []
    for i, n in enumerate(values):
        if isinstance(n, torch.Tensor):
            check_real(f"{name}[{i}]", n)
        if isinstance(n, torch.Tensor) and (n.dim() != 0 or n.dtype.is_floating_point or n.dtype.is_complex
                                            or n.dtype == torch.bool):
            fail(f"{name}[{i}]", f"tensor of shape {tuple(n.shape)} and dtype {n.dtype}",
                 "must be a whole number (an int, or a 0-d integer tensor)", "pass whole token counts",
                 kind=TypeError)
        if isinstance(n, bool) or not hasattr(type(n), "__index__"):
            fail(f"{name}[{i}]", repr(n), "must be an integer", "pass whole token counts", kind=TypeError)
        n = int(n)
        if n < 0:
            fail(f"{name}[{i}]", n, "must be >= 0 (a length counts tokens)", "drop or fix the negative length")
        out.append(n)
    return tuple(out)


def _jagged_offsets(nt: torch.Tensor, name: str) -> torch.Tensor:
    """The offsets of a compact jagged nested tensor (checks layout, holes, ragged dim; no device copy)."""
    if nt.layout != torch.jagged:
        fail(name, f"nested tensor with layout={nt.layout}", "must use layout=torch.jagged",
             "build it with torch.nested.nested_tensor(..., layout=torch.jagged) or pass a list", kind=TypeError)
    if getattr(nt, "_lengths", None) is not None:
        fail(name, "non-contiguous jagged tensor", "must have no holes (lengths=None)",
             "call torch.nested.nested_tensor_from_jagged(values, offsets) with compact values")
    ragged = getattr(nt, "_ragged_idx", 1)
    if ragged != 1:
        fail(name, f"nested tensor of shape {tuple(nt.shape)} with its ragged dimension at {ragged}",
             "the ragged (sequence) dimension must be dimension 1", "transpose it back before sharding")
    return nt.offsets()  # type: ignore[attr-defined]


def jagged_lengths(nt: torch.Tensor, name: str) -> tuple[int, ...]:
    """The sequence lengths of a compact jagged nested tensor: one device-to-host copy."""
    check_real(name, nt)
    offsets = _jagged_offsets(nt, name).tolist()
    if offsets[0] != 0:
        fail(name, f"nested tensor with offsets starting at {offsets[0]}", "offsets must start at 0",
             "build it with nested_tensor_from_jagged(values, offsets) where offsets[0] == 0")
    rows = nt.values().shape[0]
    if offsets[-1] != rows:
        fail(name, f"nested tensor with {rows} value rows and offsets ending at {offsets[-1]}",
             "its offsets must end at the number of value rows", "build it with "
             "nested_tensor_from_jagged(values, offsets) where offsets[-1] == values.shape[0]")
    return tuple(b - a for a, b in zip(offsets[:-1], offsets[1:]))


@functools.cache
def _quiet_fx_notice() -> None:
    """Spend torch's once-per-process ``is_fx_tracing will return true ...`` notice with its logger muted.

    ``torch.nested.nested_tensor_from_jagged`` asks ``torch.fx``'s deprecated ``is_fx_tracing()``,
    which logs that notice (a deprecation aimed at torch's own callers, not at cpshard's users) the
    first time; it is cached (``functools.lru_cache``) so that it logs at most once. Calling it here
    once with its logger above WARNING uses up that one time; the logger's level is put back, so
    anything else torch.fx logs still shows. Torch releases without the notice are left alone."""
    try:
        from torch.fx import _symbolic_trace
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    notice = getattr(_symbolic_trace, "is_fx_tracing_warning", None)
    if notice is None:
        return
    log = logging.getLogger(_symbolic_trace.__name__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        notice()
    finally:
        log.setLevel(level)


def jagged(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch.nested.nested_tensor_from_jagged(values, offsets=offsets)``, without torch's
    deprecation notice about ``is_fx_tracing`` (see :func:`_quiet_fx_notice`): every jagged tensor
    cpshard returns is built here."""
    _quiet_fx_notice()
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


def parse_plan_args(seqlens: Any, cp_size: Any, tp_size: Any, layout: Any,
                    fp8: Any) -> tuple[tuple[int, ...], int, int, Layout, bool]:
    """Validate the arguments every plan builder shares."""
    lens = parse_seqlens(seqlens)
    cp_size = check_int("cp_size", cp_size, minimum=1)
    tp_size = check_int("tp_size", tp_size, minimum=1)
    layout = Layout.parse(layout)
    if not isinstance(fp8, bool):
        fail("fp8", repr(fp8), "must be a bool", "pass fp8=True or fp8=False", kind=TypeError)
    if cp_size * tp_size >= 2**31:  # before any NumPy arithmetic on them (int64 would overflow first)
        fail("cp_size", cp_size, f"with tp_size={tp_size} every padded batch has at least cp_size * tp_size rows, "
             "which must stay below 2**31 (cu_seqlens are int32, as Megatron and TransformerEngine take them)",
             "pass the sizes of your context- and tensor-parallel groups")
    return lens, cp_size, tp_size, layout, fp8


def plain_ints(values: Sequence[Any]) -> bool:
    """Non-empty, every value a plain ``int`` (not bool) and >= 0: the fast path of every check."""
    return bool(values) and set(map(type, values)) == {int} and min(values) >= 0


def int_tuple(name: str, values: Sequence[Any]) -> tuple[int, ...]:
    """``values`` as a tuple of ints >= 0; a fast path for plain ints (plans of thousands of sequences)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        fail(name, repr(values), "must be a sequence of non-negative ints", f"pass {name} as a tuple of ints",
             kind=TypeError)
    out = tuple(values)
    if plain_ints(out):
        return out
    return tuple(check_int(f"{name}[{i}]", v, minimum=0) for i, v in enumerate(out))


def check_shift(value: Any, name: str = "shift") -> int:
    """A shift ``k``, an int with ``|k| < 2**31`` (no sequence is longer than a plan's int32 offsets):
    ``k > 0`` looks ahead (labels, MTP depths), ``k < 0`` looks back (causal convolutions), 0 is none."""
    return check_int(name, value, minimum=-(2**31 - 1), maximum=2**31 - 1)
