"""What ``import cpshard`` needs besides torch, checked first so that a missing package is named with its fix.

NumPy runs the index math. torch's CPU wheel does not bring it, so ``pip install --no-deps`` of cpshard
into an environment that holds only torch leaves it out.
"""

from __future__ import annotations

try:
    import numpy  # noqa: F401
except ImportError as exc:
    raise ImportError(
        f"cpshard needs NumPy, which cannot be imported ({exc}). Install it: pip install 'numpy>=1.22'. "
        "(pip install --no-deps of cpshard leaves it out; a plain pip install of cpshard into an environment "
        "that has torch >= 2.4 installs NumPy and leaves torch as it is. README, Install.)") from None
