"""Type aliases shared by every module that moves data (one definition each)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch

__all__ = ["Group", "Scalar", "TokenRows"]

Scalar = Union[int, float, bool]
"""A pad or fill value: any real number the tensor's dtype can hold (``cpshard.base.dtypes.check_fill``)."""

TokenRows = Union[torch.Tensor, Sequence[torch.Tensor]]
"""A batch's token rows: the flat ``(sum(seqlens), ...)`` tensor, a list of ``(n_i, ...)`` tensors or a
jagged nested tensor."""

Group = Any
"""A ``torch.distributed`` process group, or None (the default group; at ``cp_size == 1`` no group)."""
