"""By hand: ``local_padding_mask`` against verl main's dynamic-CP ``_local_padding_mask``, on random batches.

Run from the repository root with verl main first on the path (scripts/upstream/check.sh does; verl
0.9.1 has no dynamic CP). Where the two masks have the same rows they must be equal; where they do
not, verl's padded total must break a plan invariant (``cpshard.layout.total_problem``: ``cp`` equal
shares each a multiple of ``tp``, a zigzag last sequence a multiple of ``2 cp``), where verl's rows
lose tokens or leave rows to no rank (README, "Differences from verl", 2), and cpshard's mask counts
every token.
"""
import itertools
import random

import torch
from verl.utils.dynamic_cp_scheduler import _local_padding_mask

from cpshard import ShardPlan
from cpshard.compat.verl import local_padding_mask
from cpshard.layout import Layout, total_problem

rng = random.Random(0)
same = differ = 0
for _ in range(300):
    lens = [rng.choice([1, 2, 3, 5, 7, 16, 31, 64, 100, 257, 1000]) for _ in range(rng.randint(1, 5))]
    for cp, tp, layout, rows in itertools.product([1, 2, 3, 4, 8], [1, 2, 4], ["zigzag", "contiguous"],
                                                  [None, 1, 7, 64, 300]):
        kw = dict(cp_size=cp, tp_size=tp, cp_layout=layout, min_local_rows=rows)
        theirs = [_local_padding_mask(lens, cp_rank=r, **kw) for r in range(cp)]
        ours = [local_padding_mask(lens, cp_rank=r, **kw) for r in range(cp)]
        if theirs[0].shape == ours[0].shape:
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), (lens, kw)
            same += 1
        else:
            assert sum(int((~m).sum()) for m in ours) == sum(lens), (lens, kw)
            base = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout).total_len
            total = theirs[0].numel() * cp
            assert total_problem(total, total - base, cp, tp, Layout.parse(layout), False), (lens, kw)
            differ += 1
print(f"local_padding_mask: {same} configurations equal to verl's on every rank; {differ} where verl's padding "
      "breaks a plan invariant and cpshard's keeps every token")
