"""pack's parts whose cost grows with the batch, against naive references: the first-fit-decreasing
count (equal sizes placed a run at a time) against first fit item by item; and the bounded move
step of a large batch, which must still keep every sequence once and the budget."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from cpshard import pack
from cpshard.packing.search import ffd_count
from strategies import props


def naive_ffd_count(sizes: list[int], capacity: int) -> int:
    """First fit decreasing, item by item: each item into the leftmost open bin with room, else a new bin."""
    free: list[int] = []
    for size in sorted(sizes, reverse=True):
        for b, room in enumerate(free):
            if size <= room:
                free[b] = room - size
                break
        else:
            free.append(capacity - size)
    return max(1, len(free))


@given(capacity=st.integers(1, 64), data=st.data())
@props(300)
def test_ffd_count_equals_first_fit_item_by_item(capacity, data):
    sizes = data.draw(st.lists(st.integers(0, capacity) | st.sampled_from([0, 1, capacity]), min_size=1,
                               max_size=80))
    assert ffd_count(np.array(sizes, dtype=np.int64), capacity) == naive_ffd_count(sizes, capacity)


def test_a_large_batch_of_one_token_sequences_packs_whole():
    """6,000 one-token sequences under max_tokens=16 (375 micro-batches: past the move step's 2**20 cells
    and the fill's window of 256): the move step scores only the heaviest units of the slowest rank (its
    memory bounded), and the packing is still whole and fits."""
    p = pack([1] * 6000, max_tokens=16, cp_size=1, dp_size=1)
    ids = sorted(i for mb in p.micro_batches[0] for i in mb)
    assert ids == list(range(6000))
    assert p.num_micro_batches == (375,)
    assert all(plan.total_len <= 16 for plan in p.plans[0])
