"""The call header that every data collective of ``cpshard.distributed`` carries (pure: no communication).

Note [Call headers]
~~~~~~~~~~~~~~~~~~~
Ranks that disagree about a call (different plans of the same local length, different dtypes of one
width, shifts, fill values, or check settings) would otherwise exchange bytes of the right size and
return a wrong result without a word. So every all-gather and all-to-all of cpshard prepends
``HEADER_BYTES`` (64) bytes to each rank's contribution (all-gather) or to each destination's chunk
(all-to-all), eight int64 words:

    0 magic + kind (``DATA`` or ``CHECK``: the agreement all-gather of ``check=True``)
    1 the operation (``OPS``: gather, shift, halo, relayout, their backward exchanges ...)
    2 the sender's rank in the group
    3 whether a ``check=True`` agreement preceded the call on the sender
    4 the plan's digest (the fingerprint folded to 63 bits; a relayout folds both plans)
    5 the dtype (``dtype_code``, a digest of its name)
    6 the row shape (a digest)
    7 the call's other arguments (shift(s), pad and fill values: a digest)

There is no extra collective: the header travels inside the collective the call makes anyway, and
is compared where the result already is (gloo: on the host, right after the collective; NCCL: on the
device, by ``torch._assert_async``, so no host synchronisation). Every receiver compares every
sender's header with the one it would have sent itself (the sender's rank aside), so every rank that
received mismatching bytes raises and names the rank and the fields that differ.

The receive buffer's header slots are zeroed first: a peer whose message was shorter (gloo accepts a
short message) leaves zeros there, read as "no header" rather than as a stale header of an earlier
call. A peer whose message is *longer* than expected cannot be caught here: gloo aborts the
receiving process (``EnforceNotMet``), docs/guarantees.md.

Note [Stamped reductions]
~~~~~~~~~~~~~~~~~~~~~~~~~
An ``all_reduce`` cannot carry a header: every rank receives the sum, not the others' words. So each
rank puts a *trailer* in front of its values (the same dtype, reduced with them, in the same
collective): one failure word, then the call's digest (the header's words but the rank, and the
number of values) cut into ``k`` chunks of ``b`` bits, each plus one (``c_i``, never zero):

    SUM:  [failed, c_1 .. c_k, c_1**2 .. c_k**2]     MAX: [failed, c_1 .. c_k, -c_1 .. -c_k]

After the reduction every rank checks, per chunk, ``sum c = n c_i`` and ``sum c**2 = n c_i**2`` (n
ranks): together they say that the ranks' chunks have zero variance, so *every* rank's chunk equals
this rank's (under MAX, ``max c = c_i`` and ``max -c = -c_i`` say the same). ``b`` is chosen so that
every sum is an exact integer in the dtype (``n 2**(2b) < 2**p``, ``p`` its precision: 53 bits for
float64, 24 for float32, 63 for int64); narrower dtypes are summed in float64 or int64. A peer that
sums something else (another plan, size, dtype, operation or argument) breaks the equalities on
every rank that returns, which then raises instead of returning the sum. A peer that contributes
fewer values leaves a trailer word of this rank's own (``c`` where ``n c`` is expected). ``failed``
is the number of ranks that rejected their input and still joined the sum (the losses: Note
[Failure in a loss] in ``loss/reductions.py``); it is read first. Sums whose sizes differ by rank can still be
aborted by gloo, as messages of different sizes are (docs/guarantees.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CHECK", "DATA", "HEADER_BYTES", "HEADER_WORDS", "OPS", "describe_mismatch", "digest", "make",
           "mismatch", "reduction_dtype", "trailer", "trailer_mismatch"]

HEADER_WORDS = 8
HEADER_BYTES = 8 * HEADER_WORDS  # a multiple of 16: the data after it stays aligned for every dtype
_MAGIC = 0x6370_7368_6400 << 8  # "cpshd", then a kind byte
DATA, CHECK = 1, 2
_KINDS = {DATA: "a data collective", CHECK: "the agreement check of check=True (or CPSHARD_CHECK=1)"}
OPS = {"gather": 1, "all_gather_rows": 2, "gather_states": 3, "shift_sharded": 4,
       "shift_sharded backward": 5, "shift_sharded_multi": 6, "relayout": 7, "relayout backward": 8,
       "check": 9, "exchange_dims": 10, "exchange_dims backward": 11, "all_gather_dim": 12}
_OP_NAMES = {v: k for k, v in OPS.items()}
_FIELDS = ("kind", "operation", "rank", "check setting", "plan", "dtype", "row shape",
           "shift, pad and fill values or the calling operation's arguments")


def digest(value: Any) -> int:
    """63 bits of a BLAKE2b digest of ``repr(value)`` (non-negative, fits an int64 word). Floats by their
    exact bits: a float's ``repr`` is the shortest text that reads back as the same double, so ``0.1`` and
    the next double, or ``0.0`` and ``-0.0``, digest apart (the callers pass Python floats)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 1


_DTYPE_NAMES = {digest(str(d)): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}


_SHAPE_KEYS = ("dtype", "dtypes", "row shape", "row shapes")


def make(kind: int, op: str, rank: int, checked: bool, plan_words: Sequence[int], call: dict[str, Any]) -> list[int]:
    """This rank's header words for one call: ``plan_words`` are the plan fingerprint(s) (folded here),
    ``call`` the arguments every rank must pass alike (``dtype``/``dtypes``, ``row shape``/``row shapes``,
    the rest: shifts, pad and fill values), as the functions' checks name them."""
    dtype = call.get("dtype", call.get("dtypes"))
    shape = call.get("row shape", call.get("row shapes"))
    rest = sorted((k, v) for k, v in call.items() if k not in _SHAPE_KEYS)
    return [_MAGIC | kind, OPS[op], rank, int(checked), digest(tuple(plan_words)), digest(str(dtype)),
            digest(shape), digest(rest)]


def mismatch(got: Sequence[int], mine: Sequence[int], sender: int) -> list[str]:
    """The fields in which ``got`` (the header received from ``sender``) differs from the one this rank
    expected from it (``mine``, with ``sender`` as its rank), most telling first; empty if none."""
    expected = list(mine)
    expected[2] = sender
    if got[0] & ~0xFF != _MAGIC or (got[0] & 0xFF) not in _KINDS:
        return ["no header"]
    if got[0] != expected[0]:  # another kind of collective: the rest of its words mean other things
        return [name for name, a, b in zip(_FIELDS[:4], got, expected) if a != b and name != "rank"]
    return [name for name, a, b in zip(_FIELDS, got, expected) if a != b]


def _value(field: str, word: int) -> str:
    if field == "kind":
        return _KINDS.get(word & 0xFF, "?")
    if field == "operation":
        return _OP_NAMES.get(word, "?")
    if field == "dtype":
        return _DTYPE_NAMES.get(word, "dtypes")
    if field in ("check setting",):
        return "checked" if word else "unchecked"
    if field == "rank":
        return str(word)
    return f"digest {word:x}"


def describe_mismatch(op: str, rank: int, bad: dict[int, tuple[list[str], Sequence[int]]],
                      mine: Sequence[int], call: dict[str, Any] | None = None) -> str:
    """The error message for the senders in ``bad`` (``{sender: (fields, received header)}``); ``call``:
    this rank's arguments, listed where the digest of the arguments differs."""
    parts = []
    for sender, (fields, got) in sorted(bad.items()):
        if fields == ["no header"]:
            parts.append(f"rank {sender} sent no cpshard header (a different collective, or fewer bytes: "
                         "its plan, dtype or row shape differs, or it skipped this call)")
            continue
        shown = [f"{f} ({_value(f, got[_FIELDS.index(f)])} there, {_value(f, mine[_FIELDS.index(f)])} here)"
                 if f in ("kind", "operation", "check setting") or (f == "dtype" and got[5] in _DTYPE_NAMES)
                 else f for f in fields]
        parts.append(f"rank {sender} differs in {', '.join(shown)}")
    rest = {k: v for k, v in (call or {}).items() if k not in _SHAPE_KEYS}
    if rest and any(_FIELDS[7] in fields for fields, _ in bad.values()):
        parts[-1] += f" (this rank passed {', '.join(f'{k}={v}' for k, v in rest.items())})"
    return (f"{op}: the ranks of the context-parallel group disagree about this call (this is rank {rank}): "
            f"{'; '.join(parts)}. Its result would be wrong, so no rank returns it. Fix: call it on every rank "
            "with the same plan (built from the same lengths), dtype, row shape, shifts and fill values, and "
            "set checks alike on every rank (check=, set_checks, CPSHARD_CHECK in every process or none); "
            "check=True on every rank names both plans.")


# -- stamped reductions (Note [Stamped reductions]) ---------------------------------------------------

_DIGEST_BITS = 48  # of the call's digest folded into a reduction: chance 2**-48 that two calls look alike
_MAX_CHUNK = 24


_PRECISION = {torch.float64: 53, torch.float32: 24, torch.complex128: 53, torch.complex64: 24, torch.int64: 63,
              torch.int32: 31}


def _precision(dtype: torch.dtype) -> int:
    """The bits of the integers ``dtype`` holds exactly (0: a dtype reduced in a wider one)."""
    return _PRECISION.get(dtype, 0)


def reduction_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction of ``dtype`` values runs in: itself where it holds a trailer, else float64
    (floating, complex: their real view) or int64 (integers, bool)."""
    if _precision(dtype) >= 24:
        return dtype
    return torch.float64 if dtype.is_floating_point or dtype.is_complex else torch.int64


def _chunks(word: int, dtype: torch.dtype, ranks: int, op: str) -> list[int]:
    p = _precision(dtype)
    bits = min(_MAX_CHUNK, (p - ranks.bit_length() - 1) // 2) if op == "sum" else min(_DIGEST_BITS, p - 2)
    k = -(-_DIGEST_BITS // bits)
    word &= (1 << _DIGEST_BITS) - 1  # the digest's 48 bits, whatever the chunks
    return [((word >> (i * bits)) & ((1 << bits) - 1)) + 1 for i in range(k)]  # 1 .. 2**bits: never zero


def trailer(word: int, dtype: torch.dtype, ranks: int, op: str, failed: bool) -> list[int]:
    """This rank's trailer for a reduction (``op``: ``"sum"`` or ``"max"``) of ``dtype`` values over
    ``ranks`` ranks, for the call whose digest is ``word`` (Note [Stamped reductions])."""
    c = _chunks(word, dtype, ranks, op)
    if failed:  # the digest is unknown on a rank that rejected its input: only the failure word counts
        return [1] + [0] * (2 * len(c))
    return [0, *c, *(x * x if op == "sum" else -x for x in c)]


def trailer_mismatch(got: Sequence[float], mine: Sequence[int], ranks: int, op: str) -> str | None:
    """What the reduced trailer ``got`` says, against this rank's ``mine``: ``"failed"`` (a rank
    rejected its input), ``"differs"`` (some rank reduced another call), or None (every rank alike)."""
    if got[0] != 0:
        return "failed"
    scale = ranks if op == "sum" else 1
    if any(g != scale * m for g, m in zip(got[1:], mine[1:])):
        return "differs"
    return None
