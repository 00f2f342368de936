"""pack's parts whose cost grows with the batch, against naive references: the first-fit-decreasing
count (equal sizes placed a run at a time) against first fit item by item; and the bounded move
step of a large batch, which must still keep every sequence once and the budget."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from cpshard import pack
from cpshard.packing.search import RoomTree, ffd_count
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
    """Few distinct sizes, many items (equal sizes placed a run at a time), and any sizes in small batches."""
    palette = data.draw(st.lists(st.integers(0, capacity) | st.sampled_from([0, 1, capacity]), min_size=1, max_size=4))
    sizes = data.draw(st.lists(st.sampled_from(palette), min_size=1, max_size=400)
                      | st.lists(st.integers(0, capacity), min_size=1, max_size=80))
    assert ffd_count(np.array(sizes, dtype=np.int64), capacity) == naive_ffd_count(sizes, capacity)


def test_a_large_batch_of_one_token_sequences_packs_whole():
    """6,000 one-token sequences under max_tokens=16 (375 micro-batches: past the move step's 2**16 cells
    and the fill's window of 256): the move step scores only the heaviest units of the slowest rank (its
    memory bounded), and the packing is still whole and fits."""
    p = pack([1] * 6000, max_tokens=16, cp_size=1, dp_size=1)
    ids = sorted(i for mb in p.micro_batches[0] for i in mb)
    assert ids == list(range(6000))
    assert p.num_micro_batches == (375,)
    assert all(plan.total_len <= 16 for plan in p.plans[0])


@given(data=st.data())
@props(200)
def test_room_tree_finds_the_leftmost_bin_with_room_as_a_scan_does(data):
    """``RoomTree.first`` after any takes: the leftmost bin whose free rows are at least ``s`` (-1: none)."""
    room = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=70))
    tree = RoomTree(np.array(room, dtype=np.int64))
    free = list(room)
    for _ in range(data.draw(st.integers(1, 60))):
        s = data.draw(st.integers(0, 45))
        want = next((b for b, r in enumerate(free) if r >= s), -1)
        assert tree.first(s) == want
        if want >= 0:
            tree.take(want, s)
            free[want] -= s


def naive_fill(prob, counts: list[int], group_vectors, contiguous: bool, window: int) -> list[int]:
    """The fill, scanned: unit ``j`` (longest first) scores every micro-batch of its window (``j mod G``,
    micro-batch ``b`` in window ``b mod G``) with room: the DP rank's time plus the micro-batch's raise;
    ties by the raise, the DP rank's time, the rows, the index. Units no window held go last, scored
    over every micro-batch. Python ints throughout."""
    vec, heavy, p = group_vectors
    cp, cap = prob.cp, prob.capacity
    owner = [d for d, c in enumerate(counts) for _ in range(c)]
    k = len(owner)
    acc = [[0] * len(vec[0]) for _ in range(k)]
    h1, rows, cost, times = [0] * k, [0] * k, [0] * k, [0] * len(counts)
    where = [-1] * len(p)
    key = heavy if contiguous else [max(v) for v in vec]
    order = sorted(range(len(p)), key=lambda i: (-key[i], -p[i], i))
    g = -(-k // window)

    def new_cost(b: int, i: int) -> int:
        if contiguous:
            return max(-(-(acc[b][0] + vec[i][0]) // cp), h1[b], heavy[i])
        return max(a + v for a, v in zip(acc[b], vec[i]))

    def place(units: list[int], bins: list[int]) -> list[int]:
        missed = []
        for i in units:
            cands = [b for b in bins if rows[b] + p[i] <= cap]
            if not cands:
                missed.append(i)
                continue
            b = min(cands, key=lambda b: (times[owner[b]] + new_cost(b, i) - cost[b], new_cost(b, i) - cost[b],
                                          times[owner[b]], rows[b], b))
            raise_ = new_cost(b, i) - cost[b]
            times[owner[b]] += raise_
            cost[b] += raise_
            acc[b] = [a + v for a, v in zip(acc[b], vec[i])]
            h1[b], rows[b], where[i] = max(h1[b], heavy[i]), rows[b] + p[i], b
        return missed

    left = [i for w in range(g) for i in place(order[w::g], list(range(w, k, g)))]
    place(sorted(left), list(range(k)))
    return where


@given(cp=st.sampled_from([1, 2, 4]), layout=st.sampled_from(["zigzag", "contiguous"]), dp=st.integers(1, 3),
       data=st.data())
@props(12)
def test_the_windowed_fill_equals_the_scanned_fill(cp, layout, dp, data):
    """Batches of 300..700 micro-batches (two or three windows of 256): the fill's placement of every unit
    is the scanned reference's (``naive_fill``)."""
    from cpshard.base.layout import Layout, Padding
    from cpshard.packing.problem import make_problem
    from cpshard.packing.search import FILL_WINDOW, Search, micro_batch_counts

    n = data.draw(st.integers(2400, 4200))
    seed = data.draw(st.integers(0, 1000))
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 3 * cp + 1, size=n).tolist()
    max_tokens = 16 * cp
    prob = make_problem(lens, max_tokens, cp, 1, Layout.parse(layout), Padding.ALIGNED)
    counts = micro_batch_counts(ffd_count(prob.p, prob.capacity), dp, 1, 1, True, n)
    search = Search(prob, counts, 0)
    ok = search.fill()
    want = naive_fill(prob, counts, (search.vec.tolist(), search.heavy.tolist(), search.p.tolist()),
                      search.contiguous, FILL_WINDOW)
    assert sum(counts) > FILL_WINDOW
    assert ok == (min(want) >= 0)
    if ok:
        assert search.where.tolist() == want


@given(costs=st.lists(st.integers(0, 50), min_size=2, max_size=24), dp=st.integers(2, 4), data=st.data())
@props(300)
def test_best_swap_reaches_the_least_largest_sum_of_every_pair(costs, dp, data):
    """``best_swap`` (two neighbours per rank by ``searchsorted``) leaves the largest rank sum as low as
    the best of every (slowest rank's, other rank's) pair, and returns None exactly when no pair lowers it."""
    from cpshard.packing.assign import best_swap

    owner = np.array(data.draw(st.lists(st.integers(0, dp - 1), min_size=len(costs), max_size=len(costs))))
    c = np.array(costs, dtype=np.int64)
    sums = np.bincount(owner, weights=c, minlength=dp).astype(np.int64)
    slow = int(np.argmax(sums))
    best = None
    for u in np.flatnonzero(owner == slow).tolist():
        for v in np.flatnonzero(owner != slow).tolist():
            new = sums.copy()
            new[slow] -= c[u] - c[v]
            new[owner[v]] += c[u] - c[v]
            best = int(new.max()) if best is None else min(best, int(new.max()))
    got = best_swap(c, owner, sums, slow)
    if best is None or best >= sums[slow]:
        assert got is None
        return
    assert got is not None
    u, v, diff = got
    assert owner[u] == slow and owner[v] != slow and diff == c[u] - c[v]
    new = sums.copy()
    new[slow] -= diff
    new[owner[v]] += diff
    assert int(new.max()) == best


def test_a_batch_past_the_fill_window_and_the_exchange_partners_packs_exactly():
    """3,000 short sequences under the contiguous layout at cp=2 (over 256 micro-batches: two fill windows,
    exchange rounds over a bounded set of partners, the DP split's bounded swaps): every sequence once,
    every plan within the budget, and every micro-batch's reported work the plan's, token by token."""
    from test_pack import check

    rng = np.random.default_rng(5)
    lens = rng.integers(1, 40, size=3000).tolist()
    p = pack(lens, max_tokens=128, cp_size=2, layout="contiguous", dp_size=2)
    assert sum(p.num_micro_batches) > 256
    check(p, lens, 2, 128)


@given(capacity=st.integers(120, 2000), data=st.data())
@props(100)
def test_ffd_count_with_many_distinct_sizes_equals_first_fit_item_by_item(capacity, data):
    """Many distinct sizes in a small batch: ``ffd_count`` places items one by one through a ``RoomTree``
    (the cheaper way there), still first fit's count."""
    sizes = data.draw(st.lists(st.integers(0, capacity), min_size=100, max_size=300, unique=True))
    sizes += data.draw(st.lists(st.sampled_from(sizes), max_size=50))
    assert ffd_count(np.array(sizes, dtype=np.int64), capacity) == naive_ffd_count(sizes, capacity)
