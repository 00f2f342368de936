"""Sequence orders that balance causal-attention work under the contiguous layout (interim).

``balanced_order`` here is a placeholder (longest first); the measured algorithm replaces it.
"""

from __future__ import annotations

from collections.abc import Sequence


def balanced_order(seqlens: Sequence[int], padded: Sequence[int], cp_size: int) -> tuple[int, ...]:
    """A permutation of the sequences (buffer position -> the caller's index): longest first."""
    return tuple(sorted(range(len(seqlens)), key=lambda i: (-padded[i], i)))
