"""Bad input raises ValueError/TypeError naming the argument, the value, the rule and the fix."""

from __future__ import annotations

import re

import pytest
import torch

import cpshard
from cpshard import BshdPlan, ShardPlan, from_padded, shard, to_padded, unshard


def _raises(kind, *fragments):
    """``pytest.raises(kind, match=...)`` where the message must hold every fragment and a "Fix:"."""
    pattern = "(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in (*fragments, "Fix:"))
    return pytest.raises(kind, match=pattern)


@pytest.mark.parametrize("layout", ["ring", "Zig-zag", 3, None])
def test_unknown_layout(layout):
    with _raises(ValueError, "layout=", repr(layout), "'zigzag'", "'contiguous'"):
        ShardPlan.build([4], cp_size=2, layout=layout)


@pytest.mark.parametrize("cp", [0, -1])
def test_cp_below_one(cp):
    with _raises(ValueError, f"cp_size={cp}", ">= 1"):
        ShardPlan.build([4], cp_size=cp)


def test_tp_below_one():
    with _raises(ValueError, "tp_size=0", ">= 1"):
        ShardPlan.build([4], cp_size=2, tp_size=0)


@pytest.mark.parametrize("cp", [2.0, True, "2"])
def test_non_integer_cp(cp):
    with _raises(TypeError, "cp_size=", "integer"):
        ShardPlan.build([4], cp_size=cp)


def test_negative_length():
    with _raises(ValueError, "seqlens[1]=-3", ">= 0"):
        ShardPlan.build([4, -3], cp_size=2)


@pytest.mark.parametrize("bad", [[4, 2.5], [True], ["3"]])
def test_non_integer_length(bad):
    with _raises(TypeError, "seqlens[", "integer"):
        ShardPlan.build(bad, cp_size=2)


def test_float_length_tensor():
    with _raises(TypeError, "seqlens=", "float32", "integer"):
        ShardPlan.build(torch.tensor([3.0, 4.0]), cp_size=2)


def test_empty_batch():
    with _raises(ValueError, "seqlens=[]", "B >= 1"):
        ShardPlan.build([], cp_size=2)


def test_two_dim_length_tensor():
    with _raises(ValueError, "seqlens=", "1-D"):
        ShardPlan.build(torch.ones(2, 2, dtype=torch.int64), cp_size=2)


@pytest.mark.parametrize("rank", [-1, 2, 7])
def test_rank_out_of_range(rank):
    plan = ShardPlan.build([5, 3], cp_size=2)
    with _raises(ValueError, f"cp_rank={rank}", "[0, 2)"):
        shard(torch.arange(8), plan, rank)
    with _raises(ValueError, f"cp_rank={rank}"):
        plan.global_rows(rank)


def test_flat_rows_disagree_with_plan():
    plan = ShardPlan.build([5, 3], cp_size=2)
    with _raises(ValueError, "x=tensor of shape (9,)", "sum(seqlens) = 8"):
        shard(torch.arange(9), plan, 0)


def test_list_lengths_disagree_with_plan():
    plan = ShardPlan.build([5, 3], cp_size=2)
    with _raises(ValueError, "x[1]=", "seqlens[1] = 3"):
        shard([torch.arange(5), torch.arange(4)], plan, 0)
    with _raises(ValueError, "x=list of 3 tensors", "2 sequences"):
        shard([torch.arange(5), torch.arange(3), torch.arange(1)], plan, 0)


def test_list_dtypes_disagree():
    plan = ShardPlan.build([2, 2], cp_size=1)
    with _raises(ValueError, "x[1]=", "dtype"):
        shard([torch.arange(2), torch.zeros(2)], plan, 0)


def test_nested_lengths_disagree_with_plan():
    plan = ShardPlan.build([5, 3], cp_size=2)
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(8), torch.tensor([0, 4, 8]))
    with _raises(ValueError, "lengths [4, 4]", "[5, 3]"):
        shard(nt, plan, 0)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_strided_nested_rejected():
    plan = ShardPlan.build([2, 2], cp_size=1)
    nt = torch.nested.nested_tensor([torch.arange(2), torch.arange(2)])
    with _raises(TypeError, "layout=torch.jagged"):
        shard(nt, plan, 0)


def test_shift_out_of_range():
    """Negative shifts look back (SPEC, Shifts); a shift beyond any int32 sequence is refused."""
    plan = ShardPlan.build([5, 3], cp_size=2)
    with _raises(ValueError, f"shift={-2**31}", f">= {-(2**31 - 1)}"):
        shard(torch.arange(8), plan, 0, shift=-2**31)
    with _raises(ValueError, f"shift={2**31}", f"<= {2**31 - 1}"):
        shard(torch.arange(8), plan, 0, shift=2**31)


def test_parts_wrong_count_and_rows():
    plan = ShardPlan.build([5, 3], cp_size=2)
    parts = [shard(torch.arange(8), plan, r) for r in range(2)]
    with _raises(ValueError, "parts=list of 1 tensors", "cp_size=2"):
        unshard(parts[:1], plan)
    with _raises(ValueError, "parts[1]=tensor of shape (5,)", "local_shape = (6,)"):
        unshard([parts[0], parts[1][:5]], plan)
    with _raises(TypeError, "parts=Tensor"):
        unshard(torch.stack(parts), plan)
    with _raises(ValueError, "parts[1]=", "dtype"):
        unshard([parts[0], parts[1].float()], plan)


def test_bshd_errors():
    with _raises(ValueError, "max_seqlen=4", ">= the longest sequence (5)"):
        BshdPlan.build([5, 3], cp_size=2, max_seqlen=4)
    plan = BshdPlan.build([5, 3], cp_size=2)
    with _raises(ValueError, "x=tensor of shape (2, 4)", "S >= 5"):
        shard(torch.zeros(2, 4), plan, 0)
    parts = [shard(torch.zeros(2, 5), plan, r) for r in range(2)]
    with _raises(ValueError, "parts[0]=tensor of shape (2, 3)", "local_shape = (2, 4)"):
        unshard([parts[0][:, :3], parts[1]], plan)


def test_padded_errors():
    x = torch.arange(8).view(2, 4)
    holes = torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    with _raises(ValueError, "attention_mask=row 0", "one contiguous run"):
        from_padded(x, holes)
    with _raises(ValueError, "attention_mask=shape (2, 3)", "(B, S)"):
        from_padded(x, torch.ones(2, 3, dtype=torch.bool))
    with _raises(TypeError, "attention_mask=dtype torch.float32"):
        from_padded(x, torch.ones(2, 4))
    nt = from_padded(x, torch.ones(2, 4, dtype=torch.bool))
    with _raises(ValueError, "length=3", ">= the longest sequence (4)"):
        to_padded(nt, length=3)
    with _raises(ValueError, "padding_side='middle'"):
        to_padded(nt, padding_side="middle")


def test_plan_type_checked():
    with _raises(TypeError, "plan=dict"):
        shard(torch.arange(3), {}, 0)


def test_hand_built_plan_is_validated():
    with _raises(ValueError, "padded_seqlens_py=(6,)", "divide by 2 * cp_size = 4"):
        ShardPlan((5,), (6,), cp_size=2, tp_size=1, layout="zigzag", alignment=2)
    with _raises(ValueError, "padded_seqlens_py[0]=6", "a multiple of alignment=4"):
        ShardPlan((5,), (6,), cp_size=2, tp_size=1, layout="zigzag")  # the derived alignment
    with _raises(ValueError, "must be >= the sequence length 5"):
        ShardPlan((5,), (4,), cp_size=1)


def test_hand_built_bshd_plan_is_validated():
    with _raises(ValueError, "max_seqlen=6", "must divide by 4"):
        BshdPlan((5, 3), 6, 2)
    assert BshdPlan((5, 3), 6, 2, layout="contiguous").local_len == 3


def test_errors_leave_outputs_untouched():
    """A failing call writes nothing: the caller's tensors are unchanged."""
    plan = ShardPlan.build([5, 3], cp_size=2)
    x = torch.arange(8)
    before = x.clone()
    with pytest.raises(ValueError, match="cp_rank=5"):
        shard(x, plan, 5)
    assert torch.equal(x, before)
    assert cpshard.alignment(2, 2, "zigzag") == 8


def test_a_loss_without_a_process_group_is_told_how_to_run():
    """A cp = 2 loss in one process, torch.distributed not initialized: the fix is to start the ranks and
    pass the CP group, or to take the loss of the whole batch with a cp = 1 plan (before: only
    "use cpshard.unshard in one process", which does not compute a loss)."""
    from cpshard.loss import token_mean

    two = ShardPlan.build([3, 2], cp_size=2)
    with _raises(ValueError, "group=None: needs an initialized torch.distributed process group",
                 "start the ranks with torchrun or cpshard.spawn.run_ranks", "pass the CP group",
                 "a loss or a collective runs on the whole batch with a cp_size=1 plan and group=None"):
        token_mean(torch.zeros(two.local_len, dtype=torch.float64), torch.ones(two.local_len), two, None)
