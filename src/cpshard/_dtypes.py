"""Dtype rules shared by data movement and communication: fill values that fit, opaque dtypes.

Moving rows never looks at their values, so dtypes that some kernels or backends lack (the fp8
formats: no ``index_fill_`` on CPU, no gloo support) travel as same-width unsigned bytes, and a fill
value becomes its bit pattern in that dtype.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from cpshard._errors import fail

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
    if dtype.is_complex:
        return value
    if isinstance(value, complex):
        fail(name, repr(value), f"does not fit rows of dtype {dtype}", f"pass a real {name}")
    if dtype.is_floating_point:
        return value
    if isinstance(value, float) and not value.is_integer():
        fail(name, repr(value), f"does not fit rows of integer dtype {dtype}", f"pass a whole number as {name}")
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        fail(name, repr(value), f"is outside the range of {dtype} [{info.min}, {info.max}]",
             f"pass a {name} inside that range")
    return int(value)


def bit_pattern(value: Any, dtype: torch.dtype) -> int:
    """The unsigned byte value of ``value`` stored as ``dtype`` (a one-byte opaque dtype)."""
    return int(torch.tensor([value], dtype=torch.float32).to(dtype).view(torch.uint8)[0])


def wire(t: torch.Tensor) -> torch.Tensor:
    """A same-width view every backend and kernel can move: bool and fp8 rows travel as uint8."""
    return t.view(torch.uint8) if (t.dtype == torch.bool or t.dtype in OPAQUE) else t
