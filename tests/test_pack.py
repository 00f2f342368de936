"""cpshard.pack: coverage, budget, the reported works against a naive per-rank recount, and the bound
against exhaustive search (Note [Why no packing beats the bound])."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpshard import ShardPlan
from cpshard.packing.pack import Packing, pack, packing_bound


def naive_work(plan: ShardPlan) -> list[int]:
    """Per rank, sum(position + 1) over its token rows, row by row from the plan's own views."""
    out = []
    for r in range(plan.cp_size):
        pos, tok = plan.position_ids(r).tolist(), plan.token_mask(r).tolist()
        out.append(sum(p + 1 for p, t in zip(pos, tok) if t))
    return out


def naive_ratio(packing: Packing, lens: list[int], cp: int) -> float:
    total = sum(n * (n + 1) // 2 for n in lens)
    step = max(sum(max(naive_work(p)) for p in rank) for rank in packing.plans)
    return 1.0 if total == 0 else step * len(packing.plans) * cp / total


def check(packing: Packing, lens: list[int], cp: int, max_tokens: int) -> None:
    seen = sorted(i for rank in packing.micro_batches for mb in rank for i in mb)
    assert seen == list(range(len(lens)))
    for rank_mbs, rank_plans, rank_work in zip(packing.micro_batches, packing.plans, packing.work):
        assert len(rank_mbs) == len(rank_plans) == len(rank_work)
        for mb, plan, work in zip(rank_mbs, rank_plans, rank_work):
            assert mb, "a micro-batch holds at least one sequence"
            assert plan.input_seqlens_py == tuple(lens[i] for i in mb)
            assert plan.total_len <= max_tokens
            assert list(work) == naive_work(plan)
    assert packing.step_ratio == pytest.approx(naive_ratio(packing, lens, cp), rel=1e-12)
    assert packing.lower_bound <= packing.step_ratio + 1e-12
    assert packing.num_micro_batches == tuple(len(r) for r in packing.micro_batches)


configs = st.fixed_dictionaries({
    "cp": st.sampled_from([1, 2, 3, 4]), "tp": st.sampled_from([1, 2, 8]), "dp": st.sampled_from([1, 2]),
    "layout": st.sampled_from(["zigzag", "contiguous"]), "padding": st.sampled_from(["aligned", "minimal"]),
    "reorder": st.booleans(), "slack": st.integers(0, 300),
})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=2, max_size=24), configs)
def test_coverage_budget_and_works(lens, c):
    first = ShardPlan.build([max(lens)], cp_size=c["cp"], tp_size=c["tp"], layout=c["layout"], padding=c["padding"])
    max_tokens = max(1, first.total_len) + c["slack"]
    reorder = "balanced" if c["reorder"] and c["layout"] == "contiguous" else None
    if len(lens) < c["dp"]:
        return
    try:
        p = pack(lens, max_tokens=max_tokens, cp_size=c["cp"], tp_size=c["tp"], layout=c["layout"], dp_size=c["dp"],
                 padding=c["padding"], reorder=reorder)
    except ValueError as exc:  # the same count on every DP rank needs more micro-batches than sequences
        assert c["dp"] > 1 and "cannot fill" in str(exc), exc
        return
    check(p, lens, c["cp"], max_tokens)
    assert p == pack(lens, max_tokens=max_tokens, cp_size=c["cp"], tp_size=c["tp"], layout=c["layout"],
                     dp_size=c["dp"], padding=c["padding"], reorder=reorder)  # deterministic


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]
        yield [[first]] + part


def _best_cost(lens, mb, cp, layout, padding):
    """The cheapest slowest rank of one micro-batch over every order of its sequences."""
    orders = itertools.permutations(mb) if layout == "contiguous" and cp > 1 else [tuple(mb)]
    best = None
    for order in orders:
        plan = ShardPlan.build([lens[i] for i in order], cp_size=cp, layout=layout, padding=padding)
        best = (max(naive_work(plan)), plan.total_len) if best is None else min(best, (max(naive_work(plan)),
                                                                                    plan.total_len))
    return best


def exhaustive(lens, cp, dp, layout, padding, max_tokens, counts=None):
    """The least step time over every partition, DP split and order (``counts``: micro-batches per DP rank)."""
    best = None
    cache = {}
    for part in _set_partitions(list(range(len(lens)))):
        costs = []
        for mb in part:
            key = tuple(sorted(mb))
            if key not in cache:
                cache[key] = _best_cost(lens, key, cp, layout, padding)
            costs.append(cache[key])
        if any(rows > max_tokens for _, rows in costs):
            continue
        for owner in itertools.product(range(dp), repeat=len(part)):
            per = [[c for c, d in zip(costs, owner) if d == r] for r in range(dp)]
            if counts is not None and tuple(len(x) for x in per) != counts:
                continue
            t = max(sum(c for c, _ in x) for x in per)
            best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp,dp", [(2, 1), (2, 2), (3, 1), (4, 1)])
def test_bound_below_exhaustive_optimum_and_pack_near_it(layout, cp, dp):
    import random

    gaps = []
    for seed in range(6):
        rng = random.Random(seed * 31 + cp)
        lens = [rng.choice([rng.randint(1, 12), rng.randint(20, 60)]) for _ in range(5)]
        first = ShardPlan.build([max(lens)], cp_size=cp, layout=layout)
        max_tokens = max(first.total_len, sum(lens) // 2)
        total = sum(n * (n + 1) // 2 for n in lens)
        opt = exhaustive(lens, cp, dp, layout, "aligned", max_tokens)
        bound = packing_bound(lens, max_tokens=max_tokens, cp_size=cp, layout=layout, dp_size=dp)
        assert bound <= opt * dp * cp / total + 1e-12, (lens, max_tokens)
        p = pack(lens, max_tokens=max_tokens, cp_size=cp, layout=layout, dp_size=dp)
        check(p, lens, cp, max_tokens)
        same_count = exhaustive(lens, cp, dp, layout, "aligned", max_tokens, counts=p.num_micro_batches)
        gaps.append(p.step_ratio / (same_count * dp * cp / total))
        assert p.step_ratio >= same_count * dp * cp / total - 1e-12
    assert sum(gaps) / len(gaps) <= 1.10, gaps


def test_lower_bound_is_found_when_first_read_and_kept():
    """``Packing.lower_bound`` is :func:`packing_bound` of the same batch and settings, found when first read
    (``pack`` does not pay for it) and then kept; a pickled packing still answers it."""
    import pickle
    import random

    rng = random.Random(3)
    lens = [rng.randint(1, 3000) for _ in range(60)]
    for layout, cp in (("contiguous", 4), ("zigzag", 2)):
        kw = {"max_tokens": 8192, "cp_size": cp, "layout": layout, "dp_size": 2, "tp_size": 2}
        p = pack(lens, **kw)
        assert "lower_bound" not in vars(p)
        copy = pickle.loads(pickle.dumps(p))
        assert p.lower_bound == packing_bound(lens, **kw) <= p.step_ratio
        assert vars(p)["lower_bound"] == p.lower_bound == copy.lower_bound
        assert copy == p and "_problem" not in repr(p)


def _groups_intact(packing: Packing, group: int) -> bool:
    """Every micro-batch holding a member of group ``k`` holds all of ``k * group .. k * group + group - 1``."""
    return all(set(mb) == {k * group + j for k in {i // group for i in mb} for j in range(group)}
               for rank in packing.micro_batches for mb in rank)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 3), st.lists(st.integers(0, 120), min_size=1, max_size=8), configs)
def test_group_size_keeps_groups_together(group, groups_lens, c):
    lens = [(n * (j + 3)) % 151 for n in groups_lens for j in range(group)]  # unequal members
    max_tokens = max(1, max(ShardPlan.build(lens[k:k + group], cp_size=c["cp"], tp_size=c["tp"], layout=c["layout"],
                                            padding=c["padding"]).total_len
                            for k in range(0, len(lens), group))) + c["slack"]
    reorder = "balanced" if c["reorder"] and c["layout"] == "contiguous" else None
    kw = dict(max_tokens=max_tokens, cp_size=c["cp"], tp_size=c["tp"], layout=c["layout"], dp_size=c["dp"],
              padding=c["padding"], reorder=reorder, group_size=group)
    try:
        p = pack(lens, **kw)
    except ValueError as exc:  # the same count on every DP rank needs more micro-batches than groups
        assert c["dp"] > 1 and f"{len(groups_lens)} groups of {group}" in str(exc), exc
        return
    check(p, lens, c["cp"], max_tokens)
    assert _groups_intact(p, group)
    assert p == pack(lens, **kw)


def test_group_size_one_is_the_default_and_errors_name_the_group():
    lens = [30, 7, 55, 12, 3, 41, 9, 26]
    for layout in ("zigzag", "contiguous"):
        assert pack(lens, max_tokens=96, cp_size=2, layout=layout, group_size=1) == pack(
            lens, max_tokens=96, cp_size=2, layout=layout)
    with pytest.raises(ValueError, match=r"group_size=3: must divide the number of sequences \(8\)"):
        pack(lens, max_tokens=96, cp_size=2, group_size=3)
    with pytest.raises(ValueError, match=r"seqlens\[2:4\]=\[55, 12\]: is group 1 \(group_size=2\).*68 rows"):
        pack(lens, max_tokens=64, cp_size=2, group_size=2)
    with pytest.raises(TypeError, match="group_size"):
        pack(lens, max_tokens=96, cp_size=2, group_size=2.0)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_group_size_against_the_exhaustive_grouped_optimum(layout):
    """Pairs as units: the bound stays below the grouped optimum, and pack within 25% of it on average."""
    import random

    gaps = []
    for seed in range(5):
        rng = random.Random(seed)
        lens = [rng.randint(1, 40) for _ in range(8)]
        cp, max_tokens = 2, max(ShardPlan.build(lens[k:k + 2], cp_size=2, layout=layout).total_len
                                for k in range(0, 8, 2)) * 2
        total = sum(n * (n + 1) // 2 for n in lens)
        p = pack(lens, max_tokens=max_tokens, cp_size=cp, layout=layout, group_size=2)
        check(p, lens, cp, max_tokens)
        assert _groups_intact(p, 2)
        assert p.num_micro_batches[0] >= 2  # so no micro-batch of the search holds more than six sequences
        best = None  # every partition of the four pairs into that many micro-batches (orders inside: all)
        for part in _set_partitions(list(range(4))):
            if len(part) != p.num_micro_batches[0]:
                continue
            costs = [_best_cost(lens, [2 * k + j for k in mb for j in (0, 1)], cp, layout, "aligned") for mb in part]
            if all(rows <= max_tokens for _, rows in costs):
                t = sum(c for c, _ in costs)
                best = t if best is None else min(best, t)
        assert best is not None
        opt = best * cp / total
        assert p.lower_bound <= opt + 1e-12 and p.step_ratio >= opt - 1e-12
        gaps.append(p.step_ratio / opt)
    assert sum(gaps) / len(gaps) <= 1.25, gaps


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 12)), min_size=1, max_size=7), st.integers(0, 12))
def test_crowded_excess_is_below_every_split_into_micro_batches(items, extra):
    """Part (3) of Note [Why no packing beats the bound]: ``_crowded`` is at most ``sum_m max_{i in m} e_i``
    over every split of the sequences into micro-batches of at most ``C`` rows, and at least the
    fractional ``sum_i e_i P_i / C`` it replaced."""
    import numpy as np

    from cpshard.packing.bound import crowded

    e = np.array([float(x) for x, _ in items])
    rows = np.array([r for _, r in items], dtype=np.int64)
    capacity = int(rows.max()) + extra
    got = crowded(e, rows, capacity)
    best = min(sum(max(e[i] for i in mb) for mb in part) for part in _set_partitions(list(range(len(items))))
               if all(sum(int(rows[i]) for i in mb) <= capacity for mb in part))
    assert got <= best + 1e-9
    assert got >= float((e * rows).sum()) / capacity - 1e-9


def test_count_rules():
    lens = [100] * 12
    p = pack(lens, max_tokens=400, cp_size=2, dp_size=2, divisible_by=2, min_micro_batches=3)
    assert p.num_micro_batches == (4, 4)
    p = pack([100] * 10, max_tokens=400, cp_size=2, dp_size=2, same_count_across_dp=False)
    # ten sequences of 100 padded rows fit three micro-batches of 400 (first-fit decreasing: 4, 4, 2);
    # without the same count on every DP rank the three are split as evenly as divisible_by=1 allows
    assert sorted(p.num_micro_batches) == [1, 2]
    check(p, [100] * 10, 2, 400)


def test_a_too_long_sequence_is_named():
    with pytest.raises(ValueError, match=r"seqlens\[2\]=30.*pads to 32 rows.*max_tokens=24"):
        pack([4, 5, 30], max_tokens=24, cp_size=2)
    with pytest.raises(ValueError, match="reorder"):
        pack([4, 5], max_tokens=64, cp_size=2, reorder="balanced")
    with pytest.raises(TypeError, match="max_tokens"):
        pack([4, 5], max_tokens=6.5, cp_size=2)
    with pytest.raises(ValueError, match="cannot fill 4 micro-batches"):
        pack([4, 5, 6], max_tokens=64, cp_size=2, min_micro_batches=4)


def test_the_package_exports_the_function():
    import cpshard

    assert cpshard.pack is pack and cpshard.Packing is Packing


# -- the refinement's closed forms (Note [Refining a packing]) against a rescan of the moved buffer ---

def _rescan(n, p, order, keep, cp):
    """Per-rank work of the padded sequences in ``order``, the total rounded up to ``keep`` rows: the
    extra rows pad the buffer's end, as the plan's extension of its last sequence does."""
    from cpshard.index.balance import rank_work

    rows = sum(p[i] for i in order)
    extra = -rows % keep
    lens = [n[i] for i in order] + [0]
    pads = [p[i] for i in order] + [extra]
    return rank_work(lens, pads, list(range(len(lens))), cp)


def _micro_batches(groups_lens, unit):
    """Sequence lengths, their padded lengths (multiples of ``unit``) and the micro-batches' index lists
    of lengths given per micro-batch."""
    n, groups = [], []
    for lens in groups_lens:
        groups.append(list(range(len(n), len(n) + len(lens))))
        n += lens
    return n, [-(-x // unit) * unit for x in n], groups


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=7), min_size=2, max_size=4),
       st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 4]), st.data())
def test_refinement_moves_score_exactly(groups_lens, cp, unit, data):
    import numpy as np

    from cpshard.packing.refine import Buffers

    keep = np.lcm(unit, cp)
    n, p, groups = _micro_batches(groups_lens, unit)
    capacity = max(sum(p[i] for i in g) for g in groups) + data.draw(st.integers(0, 12)) * keep
    capacity = -(-capacity // keep) * keep
    buf = Buffers(np.array(n, dtype=np.int64), np.array(p, dtype=np.int64), int(keep), cp, capacity, groups)
    for b, g in enumerate(groups):
        assert buf.works[b].tolist() == _rescan(n, p, g, keep, cp)
    # every swap and every move of one micro-batch
    b = data.draw(st.integers(0, len(groups) - 1))
    size = len(groups[b])
    for i in range(size):
        for j in range(size):
            if i == j:
                continue
            for swap in (True, False):
                order = list(groups[b])
                if swap:
                    order[i], order[j] = order[j], order[i]
                else:
                    order.insert(j, order.pop(i))
                got = buf._moved(np.array([b]), np.array([i]), np.array([j]), np.array([swap]))[0]
                assert got.tolist() == _rescan(n, p, order, keep, cp), (order, i, j, swap)
    # splicing a run of another micro-batch (or nothing) in place of a run of this one: the rows, and so
    # the boundaries, change
    other = data.draw(st.integers(0, len(groups) - 1).filter(lambda o: o != b))
    b1 = data.draw(st.integers(0, size))
    b2 = data.draw(st.integers(b1, size))
    s1 = data.draw(st.integers(0, len(groups[other])))
    s2 = data.draw(st.integers(s1, len(groups[other])))
    order = groups[b][:b1] + groups[other][s1:s2] + groups[b][b2:]
    rows = sum(p[i] for i in order)
    if order:
        got = buf._spliced(np.array([b]), np.array([b1]), np.array([b2]), np.array([other]), np.array([s1]),
                           np.array([s2]), np.array([rows]))[0]
        assert got.tolist() == _rescan(n, p, order, keep, cp), (order, b1, b2, s1, s2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 400), min_size=1, max_size=6), min_size=2, max_size=5),
       st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 8]), st.integers(0, 600), st.data())
def test_one_for_one_swaps_are_those_within_a_rank_of_rows(groups_lens, cp, unit, slack, data):
    """The exchange round's one-for-one swaps (Note [Refining a packing], **Near swaps**) against every
    pair of sequences: a sequence of a top micro-batch ``u`` for one of another micro-batch, exactly when
    both stay within the budget and the rows change by at most ``u``'s rows per rank."""
    import numpy as np

    from cpshard.packing.refine import Buffers

    keep = int(np.lcm(unit, cp))
    n, p, groups = _micro_batches(groups_lens, unit)
    capacity = -(-(max(sum(p[i] for i in g) for g in groups) + slack) // keep) * keep
    buf = Buffers(np.array(n, dtype=np.int64), np.array(p, dtype=np.int64), keep, cp, capacity, groups)
    top = np.array(sorted(data.draw(st.sets(st.integers(0, len(groups) - 1), min_size=1))), dtype=np.int64)
    buf._room(int(buf.size.max()) + 1)
    u, u1, u2, v, v1, v2, _, _ = buf._exchanges(top)
    one = (u2 - u1 == 1) & (v2 - v1 == 1)
    got = sorted(zip(u[one].tolist(), u1[one].tolist(), v[one].tolist(), v1[one].tolist()))
    rows = [sum(p[i] for i in g) for g in groups]
    want = []
    for a in top.tolist():
        per_rank = -(-rows[a] // keep) * keep // cp
        for x, i in enumerate(groups[a]):
            for b, g in enumerate(groups):
                for y, j in enumerate(g):
                    if (b != a and rows[a] - p[i] + p[j] <= capacity and rows[b] - p[j] + p[i] <= capacity
                            and abs(p[j] - p[i]) <= per_rank):
                        want.append((a, x, b, y))
    assert got == sorted(want)


def test_refinement_descends_and_exchanges_to_exact_works():
    """After the refinement every micro-batch's stored works equal a rescan of its final order, no
    micro-batch went over the budget, and the sum of the slowest ranks did not rise."""
    import random

    import numpy as np

    from cpshard.packing.refine import Buffers

    rng = random.Random(7)
    n = [min(4000, int(rng.expovariate(1 / 600)) + 1) for _ in range(120)]
    p = [-(-x // 2) * 2 for x in n]
    cp, keep, capacity = 4, 4, 8192
    groups, rows, cur = [], 0, []
    for i in sorted(range(len(n)), key=lambda i: -n[i]):
        if rows + p[i] > capacity:
            groups.append(cur)
            cur, rows = [], 0
        cur.append(i)
        rows += p[i]
    groups.append(cur)
    buf = Buffers(np.array(n), np.array(p), keep, cp, capacity, groups)
    buf.start()
    first = int(buf.costs().sum())
    buf.descend(np.arange(len(groups)), 1 << 20)
    descended = int(buf.costs().sum())
    buf.exchange(20, 1 << 20)
    assert int(buf.costs().sum()) <= descended <= first
    orders = buf.orders()
    assert sorted(i for o in orders for i in o) == list(range(len(n)))
    for b, order in enumerate(orders):
        assert sum(p[i] for i in order) <= capacity
        assert buf.works[b].tolist() == _rescan(n, p, order, keep, cp)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=12), min_size=1, max_size=5),
       st.sampled_from([1, 2, 8]), st.sampled_from([1, 3, 8, 16]), st.integers(0, 4096), st.data())
def test_work_prefix_lookups_match_a_walk_of_the_buffer(groups_lens, unit, cp, slack, data):
    """``G_b(x)``, the work of micro-batch ``b``'s first ``x`` buffer rows (``Buffers._g``: one lookup in the
    position tables of every micro-batch), against a walk of the buffer token by token: at rows inside,
    at the ends of and past a micro-batch's sequences, before and after the tables are rebuilt (new
    orders everywhere) and re-indexed in place (a few micro-batches changed)."""
    import numpy as np

    from cpshard.packing.refine import Buffers

    keep = int(np.lcm(unit, cp))
    n, p, groups = _micro_batches(groups_lens, unit)
    capacity = -(-(max(sum(p[i] for i in g) for g in groups) + slack) // keep) * keep
    buf = Buffers(np.array(n, dtype=np.int64), np.array(p, dtype=np.int64), keep, cp, capacity, groups)

    def walk(order, x):
        work = row = 0
        for i in order:
            for t in range(p[i]):
                if row >= x:
                    return work
                work += t + 1 if t < n[i] else 0
                row += 1
        return work

    def check():
        b = np.array(data.draw(st.lists(st.integers(0, len(groups) - 1), min_size=1, max_size=30)))
        x = np.array(data.draw(st.lists(st.integers(0, 2 * capacity), min_size=b.size, max_size=b.size)))
        got = buf._g(b, x)
        orders = buf.orders()
        assert got.tolist() == [walk(orders[bi], xi) for bi, xi in zip(b.tolist(), x.tolist())]

    check()
    buf.start()  # new orders everywhere: the table is built again
    check()
    if len(groups) > 1:
        buf.descend(np.arange(len(groups)), 1 << 12)  # a few micro-batches re-indexed in place
        buf.exchange(2, 1 << 12)
        check()


@pytest.mark.parametrize("lens", [[363, 5], [1449, 67, 49, 2258, 545, 98, 34, 13, 1302, 626, 5, 183, 133, 194, 363]])
def test_zigzag_minimal_padding_works_count_the_extended_last_sequence(lens):
    """Minimal padding may extend a zigzag micro-batch's last sequence past its own padding (to keep it
    a multiple of 2 cp), which moves its chunks: the works reported are the plan's, not the per-sequence
    closed form's (a fuzz found the second batch reported off by 1474 pairs a rank)."""
    p = pack(lens, max_tokens=1 << 16, cp_size=2, tp_size=8, layout="zigzag", padding="minimal")
    check(p, lens, 2, 1 << 16)
    plan = p.plans[0][0]
    assert plan.padded_seqlens_py[-1] > -(-lens[p.micro_batches[0][0][-1]] // 4) * 4  # the extension happened


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6), min_size=1, max_size=4),
       st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 4]), st.data())
def test_whole_orders_score_exactly(groups_lens, cp, unit, data):
    """``Buffers._scored`` (the group exchange's scorer): any orders, with empty places anywhere, against
    the rescan."""
    import numpy as np

    from cpshard.packing.refine import Buffers

    keep = int(np.lcm(unit, cp))
    n, p, groups = _micro_batches(groups_lens, unit)
    capacity = -(-sum(p) // keep) * keep + keep
    buf = Buffers(np.array(n, dtype=np.int64), np.array(p, dtype=np.int64), keep, cp, capacity, groups)
    orders = []
    for _ in range(data.draw(st.integers(1, 4))):
        ids = data.draw(st.permutations(range(len(n))))
        ids = ids[:data.draw(st.integers(1, len(ids)))]
        holes = data.draw(st.lists(st.integers(0, len(ids)), max_size=3))
        row = list(ids)
        for h in sorted(holes, reverse=True):
            row.insert(h, buf.null)
        orders.append(row)
    width = max(map(len, orders))
    got, rows = buf._scored(np.array([o + [buf.null] * (width - len(o)) for o in orders], dtype=np.int64))
    for k, o in enumerate(orders):
        real = [i for i in o if i != buf.null]
        assert rows[k] == sum(p[i] for i in real)
        assert got[k].tolist() == _rescan(n, p, real, keep, cp), o
    none, no_rows = buf._scored(np.zeros((0, width), dtype=np.int64))  # a round whose filter left nothing
    assert none.shape == (0, cp) and no_rows.shape == (0,)


@pytest.mark.parametrize("group", [2, 3])
def test_group_exchanges_keep_groups_and_score_exactly(group):
    """After whole-group exchanges: every group in one micro-batch, every stored work a rescan of its
    final order, the budget kept, and the sum of the slowest ranks not raised."""
    import random

    import numpy as np

    from cpshard.packing.refine import Buffers

    rng = random.Random(group)
    n = [min(4000, int(rng.expovariate(1 / 500)) + 1) for _ in range(40 * group)]
    p = [-(-x // 2) * 2 for x in n]
    cp, keep, capacity = 4, 4, 8192
    groups, rows, cur = [], 0, []
    for k in sorted(range(len(n) // group), key=lambda k: -sum(n[k * group:(k + 1) * group])):
        ids = list(range(k * group, (k + 1) * group))
        if rows + sum(p[i] for i in ids) > capacity:
            groups.append(cur)
            cur, rows = [], 0
        cur += ids
        rows += sum(p[i] for i in ids)
    groups.append(cur)
    buf = Buffers(np.array(n), np.array(p), keep, cp, capacity, groups)
    buf.start()
    buf.descend(np.arange(len(groups)), 1 << 20)
    descended = int(buf.costs().sum())
    buf.exchange_groups(group, 20, 1 << 20)
    assert int(buf.costs().sum()) < descended  # it finds exchanges here (none would pass vacuously)
    orders = buf.orders()
    assert sorted(i for o in orders for i in o) == list(range(len(n)))
    for b, order in enumerate(orders):
        assert sum(p[i] for i in order) <= capacity
        assert buf.works[b].tolist() == _rescan(n, p, order, keep, cp)
    owner = {i: b for b, o in enumerate(orders) for i in o}
    assert all(owner[k * group + j] == owner[k * group] for k in range(len(n) // group) for j in range(group))


def test_input_is_refused_at_the_entry_naming_the_argument():
    """Huge integers, overflowing work, meta lengths and negative seeds: a clear error before any
    arithmetic (before: a negative total work and lower_bound, a raw OverflowError, a 32 GiB
    allocation and MemoryError, 'cannot be called on meta tensors', NumPy's seed message)."""
    cases = [
        (([2_000_000_000] * 5,), {"max_tokens": 2**31 - 2, "cp_size": 1}, ValueError,
         r"^seqlens=5 sequences of causal work 10000000005000000000: must have a work below 2\*\*62"),
        (([2**63, 3],), {"max_tokens": 16, "cp_size": 2}, ValueError,
         r"^seqlens\[0\]=9223372036854775808: must be below"),
        (([5, 3],), {"max_tokens": 2**63, "cp_size": 2}, ValueError, r"^max_tokens=9223372036854775808: must be below"),
        (([5, 3],), {"max_tokens": 2**40, "cp_size": 2**31}, ValueError, r"^cp_size=2147483648: with tp_size=1"),
        ((torch.tensor([5, 3], device="meta"),), {"max_tokens": 16, "cp_size": 2}, ValueError,
         r"^seqlens=a tensor on the meta device"),
        (([5, 3],), {"max_tokens": 16, "cp_size": 2, "seed": -1}, ValueError, r"^seed=-1: must be >= 0"),
        (([5, 3],), {"max_tokens": 16, "cp_size": 2, "seed": 2**32}, ValueError, r"^seed=4294967296: must be <="),
    ]
    for args, kw, kind, pattern in cases:
        with pytest.raises(kind, match=pattern):
            pack(*args, **kw)
        if "seed" not in kw:
            with pytest.raises(kind, match=pattern):
                packing_bound(*args, **{k: v for k, v in kw.items() if k != "seed"})
    # the largest batch it takes: lengths just below 2**31, work just below 2**62
    p = pack([2**31 - 2] * 1, max_tokens=2**31 - 1, cp_size=1)
    assert p.total_work == (2**31 - 2) * (2**31 - 1) // 2 and p.lower_bound > 0
