"""Error messages that teach: the argument, the value, the rule and the fix.

Every user-facing check in cpshard goes through these helpers so that messages share one shape
(``name=value: rule. Fix: ...``) and tests can match on the parts. They run before any collective
and before any output is written.
"""

from __future__ import annotations

import operator
from typing import Any, NoReturn

import torch


def fail(name: str, value: Any, rule: str, fix: str, *, kind: type[Exception] = ValueError) -> NoReturn:
    """Raise ``kind`` with a message naming the argument, its value, the rule it broke and the fix.

    A ``str`` value is a description written into the message as is ("tensor of shape (9,)"); a
    caller reporting a user's string passes ``repr(value)``.
    """
    raise kind(f"{name}={_short(value)}: {rule}. Fix: {fix}.")


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 120 else text[:100] + " ... " + text[-15:]


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """Return ``value`` as a Python int; reject bools, floats and anything without ``__index__``."""
    if isinstance(value, torch.Tensor):
        check_real(name, value)
    if isinstance(value, bool) or not hasattr(type(value), "__index__") or (
            isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.is_floating_point())):
        shown = f"{value.dtype} tensor {value.tolist() if value.numel() == 1 else tuple(value.shape)}" \
            if isinstance(value, torch.Tensor) else repr(value)
        fail(name, shown, "must be an integer", f"pass an int, e.g. {name}=2", kind=TypeError)
    try:
        value = operator.index(value)
    except TypeError:  # a tensor of several elements
        fail(name, f"tensor of shape {tuple(value.shape)}", "must be one integer", f"pass an int, e.g. {name}=2",
             kind=TypeError)
    if minimum is not None and value < minimum:
        fail(name, value, f"must be >= {minimum}", f"pass {name} >= {minimum}")
    if maximum is not None and value > maximum:
        fail(name, value, f"must be <= {maximum}", f"pass {name} <= {maximum}")
    return value


def check_real(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` unless it lives on the ``meta`` device (shapes without values: nothing to read, and
    torch's collectives return on it without communicating, so that a rank's peers would wait)."""
    if value.is_meta:
        fail(name, f"a tensor of shape {tuple(value.shape)} on the meta device", "must hold real values (a meta "
             "tensor has none to read or send)", f"pass {name} on a real device (cpu or cuda)")
    return value


def check_rank(cp_rank: Any, cp_size: int) -> int:
    cp_rank = check_int("cp_rank", cp_rank)
    if not 0 <= cp_rank < cp_size:
        fail("cp_rank", cp_rank, f"must lie in [0, cp_size) = [0, {cp_size})",
             f"pass the rank's index inside its context-parallel group (0 .. {cp_size - 1})")
    return cp_rank


# torch's "bits" dtypes: opaque bytes with no arithmetic (no iinfo, no fill)
BITS = frozenset(getattr(torch, n) for n in ("bits8", "bits16", "bits1x8", "bits2x4", "bits4x2") if hasattr(torch, n))


def check_tensor(name: str, value: Any) -> torch.Tensor:
    """``value`` if it is a dense (strided) tensor or a jagged nested one; else a ``TypeError``.

    Quantized tensors (whose rows index_select would read as garbage or crash on), sparse ones,
    other layouts and torch's bits dtypes are refused here, before anything reads them."""
    if not isinstance(value, torch.Tensor):
        fail(name, type(value).__name__, "must be a torch.Tensor", f"pass {name} as a tensor", kind=TypeError)
    if value.is_quantized:
        fail(name, f"quantized tensor ({value.dtype})", "cannot be moved row by row",
             f"pass {name}.dequantize() or its int_repr()", kind=TypeError)
    if value.dtype in BITS:
        fail(name, f"tensor of dtype {value.dtype}", "holds bits, not numbers: no pad or fill value can be "
             "written into it", f"pass {name}.view(torch.uint8) (same bytes) and view the result back", kind=TypeError)
    if value.layout not in (torch.strided, torch.jagged):
        fail(name, f"tensor with layout {value.layout}", "must be dense (strided) or a jagged nested tensor",
             f"pass {name}.to_dense()", kind=TypeError)
    return value


def parse_choice(cls: Any, value: Any, name: str, what: str, member: str) -> Any:
    """A member of the ``str`` enum ``cls`` from itself or its value (any case); else a clear error."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value.lower())
        except ValueError:
            pass
    valid = ", ".join(repr(m.value) for m in cls)
    fail(name, repr(value), f"is not a {what} (valid: {valid})",
         f"pass one of {valid} or a {member} member")
