"""Dtype rules shared by data movement and communication: fill values that fit, carried dtypes.

Moving rows never looks at their values, so dtypes that some kernels or backends lack (the fp8
formats: no ``index_fill_`` on CPU, no gloo support; ``uint16/32/64``: no ``index_select``) travel
as a same-width carrier dtype, and a fill value becomes its bit pattern in that carrier.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from cpshard.base.errors import BITS, fail

OPAQUE = frozenset(getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name))


def check_fill(name: str, value: Any, dtype: torch.dtype) -> Any:
    """``value`` if a ``dtype`` tensor can hold it exactly (floats: any real number); else an error.

    bool rows take ``True``/``False`` (or 0/1); integer rows take integers inside the dtype's range
    (a float only if it is a whole number); floating rows take any real number, complex rows any
    number. Writing ``-100`` into a bool loss mask (True) or a ``uint8`` tensor (156) is refused.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_meta:
        value = value.item()
    elif isinstance(value, numbers.Number) and hasattr(value, "item"):  # NumPy scalar
        value = value.item()
    if not isinstance(value, (int, float, complex)):  # bool is an int; NumPy scalars became Python ones above
        fail(name, repr(value), "must be a Python number", f"pass {name} as an int, float or bool", kind=TypeError)
    if dtype == torch.bool:
        if value not in (0, 1) or isinstance(value, complex):
            fail(name, repr(value), f"does not fit rows of dtype {dtype} (True/False only)",
                 f"pass {name}=False or {name}=True")
        return bool(value)
    if isinstance(value, complex) and not dtype.is_complex:
        fail(name, repr(value), f"does not fit rows of dtype {dtype}", f"pass a real {name}")
    if dtype.is_floating_point or dtype.is_complex:
        # one representation per value (0 and 0.0 agree across ranks); rounded as the dtype rounds.
        # One rule for every floating dtype: a finite value must lie within the dtype's finite range
        # (float16's 65504, fp8's 448 ...): torch raised for float16 and saturated fp8 silently.
        try:
            number = complex(value) if dtype.is_complex else float(value)  # type: ignore[arg-type]
        except OverflowError:
            fail(name, repr(value), f"is too large for any floating dtype ({dtype})",
                 f"pass a {name} within the float range")
        real_dtype = dtype.to_real() if dtype.is_complex else dtype
        limit = torch.finfo(real_dtype).max
        parts = (number.real, number.imag) if isinstance(number, complex) else (number,)
        if any(math.isfinite(v) and abs(v) > limit for v in parts):
            fail(name, repr(value), f"is outside the finite range of rows of dtype {dtype} (+-{limit:g})",
                 f"pass a {name} within +-{limit:g} (or inf / nan themselves), or use a wider dtype")
        return number
    assert not isinstance(value, complex)  # refused above
    if dtype in BITS:
        fail(name, repr(value), f"cannot be written into rows of {dtype}, which hold bits, not numbers",
             f"view the rows as torch.uint8 (x.view(torch.uint8)) and pass an integer {name}", kind=TypeError)
    if isinstance(value, float) and not value.is_integer():
        fail(name, repr(value), f"does not fit rows of integer dtype {dtype}", f"pass a whole number as {name}")
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        fail(name, repr(value), f"is outside the range of {dtype} [{info.min}, {info.max}]",
             f"pass a {name} inside that range")
    return int(value)


_CARRIERS = {**{d: torch.uint8 for d in OPAQUE}, **{getattr(torch, u): getattr(torch, i) for u, i in (
    ("uint16", "int16"), ("uint32", "int32"), ("uint64", "int64")) if hasattr(torch, u)}}


def carrier(dtype: torch.dtype) -> torch.dtype | None:
    """The same-width dtype rows of ``dtype`` move as (fp8 as uint8, uintN as intN), or None."""
    return _CARRIERS.get(dtype)


def bit_pattern(value: Any, dtype: torch.dtype) -> int:
    """``value`` stored as ``dtype``, read back as an integer of ``carrier(dtype)`` (a fill value)."""
    source = torch.float32 if dtype in OPAQUE else dtype
    return int(torch.tensor([value], dtype=source).to(dtype).view(_CARRIERS[dtype])[0])


def wire(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, ``(rows, ..., itemsize)`` uint8, a view: what collectives that only move data send.

    Every backend moves uint8 (gloo has no int16, uintN, bool or fp8), and an all-gather or
    all-to-all never looks at values, so every dtype travels as its bytes; the leading row
    dimension, and with it the splits counted in rows, is unchanged. ``t`` must be contiguous. A
    conjugate or negative view (complex ``x.conj()``) is materialized first: its bytes are not its
    values (an output buffer never is one, so writes still land in it).
    """
    return t.resolve_conj().resolve_neg().unsqueeze(-1).view(torch.uint8)


def movable(t: torch.Tensor, pad_value: Any, fill: Any) -> tuple[torch.Tensor, int, int] | None:
    """``(t viewed as its carrier, pad_value's and fill's bit patterns)`` for a carried dtype, else None."""
    over = _CARRIERS.get(t.dtype)
    if over is None:
        return None
    return t.view(over), bit_pattern(pad_value, t.dtype), bit_pattern(fill, t.dtype)
