"""Losses that are exact under context parallelism, in one gradient convention: the reductions
(``reductions``, public as ``cpshard.loss``) and the multi-token prediction loss (``mtp``, public as
``cpshard.mtp``)."""

from cpshard.loss.reductions import (
    GradReduction,
    masked_rows,
    rank_of,
    sequence_mean,
    token_mean,
    token_sum,
    token_sum_and_count,
)

__all__ = ["GradReduction", "masked_rows", "rank_of", "sequence_mean", "token_mean", "token_sum",
           "token_sum_and_count"]
