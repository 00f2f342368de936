"""The gradient convention's name: how the caller reduces parameter gradients over ranks after
backward (SPEC.md, "Losses and the gradient convention"), which every loss of ``cpshard.loss`` and
``cpshard.mtp`` takes and the ranks of a group must share.

Here, below the losses, because ``import cpshard`` hands it on without loading the communication
layer the losses sit on.
"""

from __future__ import annotations

from cpshard.base.choice import Choice

__all__ = ["GradReduction"]


class GradReduction(Choice, argument="grad_reduction", what="gradient reduction"):
    """How the caller reduces parameter gradients over ranks after backward (SPEC.md, "Losses and the
    gradient convention"; Note [Gradient convention] in ``loss/reductions.py``).

    ``MEAN`` (the default everywhere): gradients are averaged over the CP group, and over the DP
    group too, as Megatron-core's DDP and FSDP (and PyTorch's DDP) do; a loss then carries the
    factor ``cp`` (times ``dp`` where it is normalized over the DP group). ``SUM``: gradients are
    summed over the CP group (and over the DP group where the loss is normalized over it), no
    factor. Either way the reduced gradient equals the one computed on the whole micro-batch (or on
    the DP group's micro-batches) in one process at ``cp = 1``.
    """

    MEAN = "mean"
    SUM = "sum"
