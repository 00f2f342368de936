"""cpshard.compat.verl.rearrange_micro_batches against verl 0.9.1's own (structure, restore order, budget)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    import tensordict
    from verl.utils import seqlen_balancing as sb
except Exception as exc:  # noqa: BLE001  (verl's import chain pulls many packages)
    pytest.skip(f"verl 0.9.1 cannot be imported ({exc}); run scripts/setup.sh", allow_module_level=True)

from cpshard import ShardPlan
from cpshard.compat import verl as cv


def _batch(lens, width=None):
    width = width or max(lens)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    ids = torch.arange(len(lens) * width).view(len(lens), width)
    return tensordict.TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(lens)])


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp,tp", [(2, 1), (4, 2)])
def test_structure_restore_and_budget(layout, cp, tp):
    lens = [37, 5, 64, 12, 90, 3, 41, 77, 18, 60]
    batch = _batch(lens)
    want_mbs, want_idx = sb.rearrange_micro_batches(batch, max_token_len=128)
    mbs, idx = cv.rearrange_micro_batches(batch, 128, cp_size=cp, tp_size=tp, layout=layout)
    assert type(mbs) is type(want_mbs) and type(idx) is type(want_idx)
    assert all(type(m) is type(want_mbs[0]) for m in mbs)
    assert all(type(i) is list and all(type(j) is int for j in i) for i in idx)
    flat = list(itertools.chain(*idx))
    assert sorted(flat) == list(range(len(lens)))
    restore = torch.tensor(sb.get_reverse_idx(flat))
    stacked = torch.cat([m["input_ids"] for m in mbs])
    assert torch.equal(stacked[restore], batch["input_ids"])  # verl's restore_dynamic_batch convention
    assert torch.equal(sb.restore_dynamic_batch(stacked, idx), batch["input_ids"])
    for m, i in zip(mbs, idx):
        assert torch.equal(m["attention_mask"], batch["attention_mask"][i])
        plan = ShardPlan.build([lens[j] for j in i], cp_size=cp, tp_size=tp, layout=layout)
        assert plan.total_len <= 128
    assert len(mbs) <= len(want_mbs) + 1


def test_verl_overshoots_after_padding_and_the_drop_in_does_not():
    lens = [33] * 8  # 4 per 140-token micro-batch unpadded; 64 rows each after padding at cp=2, tp=8 (a=32)
    batch = _batch(lens)
    _, want = sb.rearrange_micro_batches(batch, max_token_len=140)
    assert max(ShardPlan.build([lens[j] for j in i], cp_size=2, tp_size=8).total_len for i in want) > 140
    _, idx = cv.rearrange_micro_batches(batch, 140, cp_size=2, tp_size=8)
    assert max(ShardPlan.build([lens[j] for j in i], cp_size=2, tp_size=8).total_len for i in idx) <= 140


def test_counts_and_errors():
    batch = _batch([10] * 12)
    mbs, idx = cv.rearrange_micro_batches(batch, 64, num_batches_divided_by=4, min_num_micro_batch=3, cp_size=2,
                                          tp_size=1)
    assert len(mbs) == 4
    with pytest.raises(ValueError, match="force_group_size=5: must divide the batch size"):
        cv.rearrange_micro_batches(batch, 64, force_group_size=5, cp_size=2, tp_size=1)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("group", [2, 3])
def test_force_group_size_keeps_groups_together(layout, group):
    """verl's reward-model pairs: every ``force_group_size`` consecutive samples share a micro-batch, in
    verl's structure (index lists restore the order), under the padded budget; verl's own keeps them too."""
    lens = [37, 5, 64, 12, 90, 3, 41, 77, 18, 60, 22, 9, 70, 33, 8, 51, 29, 66]
    batch = _batch(lens)
    want_mbs, want_idx = sb.rearrange_micro_batches(batch, max_token_len=256, force_group_size=group)
    mbs, idx = cv.rearrange_micro_batches(batch, 256, force_group_size=group, cp_size=2, tp_size=2, layout=layout)
    assert type(mbs) is type(want_mbs) and type(idx) is type(want_idx)
    for got in (want_idx, idx):
        assert sorted(itertools.chain(*got)) == list(range(len(lens)))
        assert all({j // group for j in i} == {j // group for j in i if j % group == 0} for i in got)
        assert all(len(i) % group == 0 for i in got)
    flat = list(itertools.chain(*idx))
    stacked = torch.cat([m["input_ids"] for m in mbs])
    assert torch.equal(sb.restore_dynamic_batch(stacked, idx), batch["input_ids"])
    for i in idx:
        assert ShardPlan.build([lens[j] for j in i], cp_size=2, tp_size=2, layout=layout).total_len <= 256
    assert torch.equal(stacked[torch.tensor(sb.get_reverse_idx(flat))], batch["input_ids"])


def test_a_group_over_the_budget_gets_a_micro_batch_of_its_own(caplog):
    """Named in the README: verl 0.9.1 refuses a group over ``max_token_len``, verl main places it among
    others (over the budget); the drop-in gives it a micro-batch alone, the fewest rows it can have."""
    lens = [40, 40, 1, 1, 20, 9, 30, 31]
    batch = _batch(lens)
    import verl

    if verl.__version__ == "0.9.1":
        with pytest.raises(ValueError, match="exceeds max_token_len"):  # verl 0.9.1's own
            sb.rearrange_micro_batches(batch, max_token_len=64, force_group_size=2)
    with caplog.at_level("WARNING", logger="cpshard.compat.verl"):
        mbs, idx = cv.rearrange_micro_batches(batch, 64, force_group_size=2, cp_size=2, tp_size=1)
    assert "samples 0..1 (40+40 tokens) pad to 80 rows" in caplog.text
    assert [0, 1] in idx and sorted(itertools.chain(*idx)) == list(range(8))
    assert all(ShardPlan.build([lens[j] for j in i], cp_size=2).total_len <= 64 for i in idx if i != [0, 1])
    stacked = torch.cat([m["input_ids"] for m in mbs])
    assert torch.equal(sb.restore_dynamic_batch(stacked, idx), batch["input_ids"])
    assert cv.rearrange_micro_batches(_batch([100, 90]), 64, cp_size=2, tp_size=1)[1] == [[0], [1]]
    with pytest.raises(ValueError, match="2 samples over the budget: cannot fill 3 micro-batches"):
        cv.rearrange_micro_batches(_batch([100, 90]), 64, cp_size=2, tp_size=1, min_num_micro_batch=3)
    with pytest.raises(ValueError, match=r"3 samples over the budget: cannot fill 4 micro-batches \(at least 1"):
        cv.rearrange_micro_batches(_batch([100, 90, 80]), 64, cp_size=2, tp_size=1, num_batches_divided_by=2)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.lists(st.integers(1, 60), min_size=1, max_size=8), st.integers(40, 160),
       st.sampled_from(["zigzag", "contiguous"]), st.sampled_from([(1, 1), (2, 1), (2, 2)]),
       st.sampled_from([None, 2, 3]), st.sampled_from([None, 2]))
def test_any_batch_of_groups_in_verls_structure(group, groups_lens, budget, layout, sizes, least, by):
    """Every sample once, in verl's restore convention; groups whole; every micro-batch within the budget
    but those holding one group that alone exceeds it; the count at least ``min_num_micro_batch`` and a
    multiple of ``num_batches_divided_by``, or a ValueError saying it cannot be filled."""
    cp, tp = sizes
    lens = [(n * (j + 5)) % 61 + 1 for n in groups_lens for j in range(group)]
    batch = _batch(lens)
    try:
        mbs, idx = cv.rearrange_micro_batches(batch, budget, force_group_size=group, cp_size=cp, tp_size=tp,
                                              layout=layout, min_num_micro_batch=least, num_batches_divided_by=by)
    except ValueError as exc:
        assert "cannot fill" in str(exc) and (least or 1) * (by or 1) > 1, exc
        return
    assert len(idx) >= (least or 1) and len(idx) % (by or 1) == 0
    assert sorted(itertools.chain(*idx)) == list(range(len(lens)))
    stacked = torch.cat([m["input_ids"] for m in mbs])
    assert torch.equal(sb.restore_dynamic_batch(stacked, idx), batch["input_ids"])
    for i in idx:
        assert len(i) % group == 0 and {j // group for j in i} == {j // group for j in i if j % group == 0}
        rows = ShardPlan.build([lens[j] for j in i], cp_size=cp, tp_size=tp, layout=layout).total_len
        assert rows <= budget or len(i) == group, (i, rows)


def test_the_count_where_ceil_tokens_over_the_budget_overshoots_it():
    """Named in the README: verl main's count is ``ceil(tokens / max_token_len)`` and its partition of this
    rank (from verl main's own ``test_seqlen_balancing_distributed_params``) then holds 318 tokens in one
    micro-batch of 300; verl 0.9.1 raises its count until the partition fits, and so does the drop-in."""
    lens = [64, 50, 53, 86, 87, 88, 60, 60, 63, 70, 83, 69, 80, 70, 54, 79, 77, 56, 60, 62, 83, 85, 87, 67, 62]
    batch = _batch(lens, 100)
    six = sb.get_seqlen_balanced_partitions(sb.calculate_workload(torch.tensor(lens)).tolist(), 6, equal_size=False)
    assert -(-sum(lens) // 300) == 6 and max(sum(lens[i] for i in p) for p in six) > 300
    _, want = sb.rearrange_micro_batches(batch, max_token_len=300)
    _, got = cv.rearrange_micro_batches(batch, 300, cp_size=1, tp_size=1)
    assert len(got) == len(want) == 7
    assert max(sum(lens[i] for i in p) for p in got) <= 300


def test_parallel_sizes_from_megatron_when_initialized_else_one(monkeypatch):
    """verl's FSDP engines call ``prepare_micro_batches`` too: without Megatron's parallel state the
    drop-in packs as cp = tp = 1 (verl's unpadded budget); with it, it reads the sizes from there."""
    lens = [37, 5, 64, 12, 90, 3, 41, 77, 18, 60]
    batch = _batch(lens)
    _, alone = cv.rearrange_micro_batches(batch, 128)
    assert alone == cv.rearrange_micro_batches(batch, 128, cp_size=1, tp_size=1)[1]
    try:
        from cpshard.megatron import import_megatron

        mpu = import_megatron("parallel_state")
    except ImportError:
        pytest.skip("megatron-core is not installed")
    monkeypatch.setattr(mpu, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(mpu, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(mpu, "get_context_parallel_world_size", lambda: 4)
    _, read = cv.rearrange_micro_batches(batch, 128)
    assert read == cv.rearrange_micro_batches(batch, 128, cp_size=4, tp_size=2)[1] != alone


def _dp_rank(rank, world, cases):
    """Each case on every rank: this rank's lengths through the drop-in with the WORLD group as DP group;
    the index lists, or the error's message."""
    import torch.distributed as dist

    out = []
    for per_rank, kw in cases:
        lens = per_rank[rank]
        try:
            _, idx = cv.rearrange_micro_batches(_batch(lens), 64, dp_group=dist.group.WORLD, cp_size=2, tp_size=1, **kw)
            out.append(idx)
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_the_dp_group_agrees_on_the_count_and_raises_together():
    """On gloo ranks: the count is the largest over the DP group (one all_reduce), and a rank that cannot
    take it, or cannot pack its batch, makes every rank raise (none waits in a collective)."""
    from cpshard.spawn import run_ranks

    few, many = [30, 20, 10, 5], [60, 50, 40, 30, 20, 10, 9, 8]
    cases = [([few, many], {}),  # rank 1 needs more micro-batches: rank 0 takes as many
             ([few[:2], many], {}),  # rank 0 holds two samples, fewer than the agreed count
             ([few, many], {"min_num_micro_batch": 5})]  # rank 0 cannot fill five micro-batches
    res = run_ranks(_dp_rank, 2, cases, timeout=180)
    alone = [len(cv.rearrange_micro_batches(_batch(lens), 64, cp_size=2, tp_size=1)[1]) for lens in (few, many)]
    assert alone[0] < alone[1]
    for r, lens in enumerate((few, many)):
        idx = res[r][0]
        assert len(idx) == alone[1] and sorted(itertools.chain(*idx)) == list(range(len(lens)))
        assert all(ShardPlan.build([lens[j] for j in i], cp_size=2).total_len <= 64 for i in idx)
    assert all(f"agreed on {alone[1]} micro-batches a rank" in res[r][1] and "holds only 2 samples" in res[r][1]
               for r in (0, 1)), res
    assert "cannot fill 5 micro-batches" in res[0][2], res[0][2]
    assert "another DP rank could not pack its batch" in res[1][2], res[1][2]


def test_patch_covers_it():
    import verl.utils.seqlen_balancing as mod

    original = mod.rearrange_micro_batches
    with cv.patch() as p:
        assert mod.rearrange_micro_batches is cv.rearrange_micro_batches
        assert "verl.utils.seqlen_balancing.rearrange_micro_batches" in p.bound
    assert mod.rearrange_micro_batches is original


def test_patch_leaves_a_site_with_other_parameters_alone(monkeypatch, caplog):
    import logging
    import sys
    import types

    def changed(data, max_token_len):
        return None

    module = types.ModuleType("verl.workers.engine.utils")
    module.rearrange_micro_batches = changed
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with caplog.at_level(logging.WARNING, logger="cpshard.compat.verl"), cv.patch() as p:
        assert module.rearrange_micro_batches is changed
        site = "verl.workers.engine.utils.rearrange_micro_batches"
        assert site not in p.bound and site not in p.skipped
        assert p.refused[site].startswith("takes (data, max_token_len), not verl 0.9.1's (batch, max_token_len, ")
        assert "verl.utils.seqlen_balancing.rearrange_micro_batches" in p.bound
    assert f"refused {site}: takes (data, max_token_len), not verl 0.9.1's" in caplog.text



def _failing_rank(rank, world, cases):
    return [_failing_case(rank, case) for case in cases]


def _failing_case(rank, case):
    """Rank 1 raises before the count agreement (``case``); rank 0's batch is fine. What each rank
    saw: ("ok", indices) or ("raised", type name, message, seconds)."""
    import time

    import torch.distributed as dist

    batch, kw = _batch([30, 20, 10, 5]), {}
    if rank == 1:
        mask = batch["attention_mask"]
        if case == "group size":
            batch = _batch([30, 20, 10])
            kw = {"force_group_size": 2}
        elif case == "nan mask":
            batch["attention_mask"] = mask.double().masked_fill(mask == 0, float("nan"))
        elif case == "1-D mask":
            batch = tensordict.TensorDict({"input_ids": batch["input_ids"][0], "attention_mask": mask[0]},
                                          batch_size=[])
        elif case == "float mask":  # verl accepts a floating 0/1 mask: not an error
            batch["attention_mask"] = mask.float()
        elif case == "seed":
            kw = {"seed": -1}
    start = time.monotonic()
    try:
        _, idx = cv.rearrange_micro_batches(batch, 64, dp_group=dist.group.WORLD, cp_size=2, tp_size=1, **kw)
    except (ValueError, TypeError) as exc:
        return ("raised", type(exc).__name__, str(exc), time.monotonic() - start)
    return ("ok", idx)


_FAILING = {"group size": r"^force_group_size=2: must divide the batch size \(3\)",
            "nan mask": r"^batch\['attention_mask'\]=a torch.float64 mask holding nan: must hold only 0 and 1",
            "1-D mask": r"^batch\['attention_mask'\]=tensor of shape \(30,\): must be a 2-D",
            "seed": r"^seed=-1: must be >= 0"}


def test_a_rank_that_raises_before_the_count_agreement_does_not_leave_its_peers_waiting():
    """Before: the peer stayed in the all_reduce until the failing rank exited (an error that is not a
    ValueError, or one raised before the agreement); a float 0/1 mask was refused naming seqlens."""
    import re

    from cpshard.spawn import run_ranks

    cases = [*_FAILING, "float mask"]
    seen = run_ranks(_failing_rank, 2, cases, timeout=240, collective_timeout=60)
    for i, case in enumerate(cases):
        peer_saw, rank_saw = seen[0][i], seen[1][i]
        if case == "float mask":
            assert peer_saw[0] == rank_saw[0] == "ok" and peer_saw[1] == rank_saw[1]
            continue
        (_, _, peer, peer_s), (_, _, mine, mine_s) = peer_saw, rank_saw
        assert re.match(_FAILING[case], mine), mine
        assert peer.startswith("dp_group=a DP group: another DP rank could not pack its batch"), peer
        assert peer_s < 20 and mine_s < 20  # each call, timed in its rank: far below the collective timeout


def test_batch_errors_name_the_mask_and_the_batch():
    with pytest.raises(ValueError, match=r"^batch=0 samples: must hold at least one sample"):
        cv.rearrange_micro_batches(tensordict.TensorDict({"input_ids": torch.zeros(0, 4, dtype=torch.long),
                                                          "attention_mask": torch.zeros(0, 4)}, batch_size=[0]), 64)
    floats = _batch([30, 20, 10, 5])
    floats["attention_mask"] = floats["attention_mask"].float()
    assert cv.rearrange_micro_batches(floats, 64)[1] == cv.rearrange_micro_batches(_batch([30, 20, 10, 5]), 64)[1]
