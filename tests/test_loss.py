"""cpshard.loss in one process (cp = 1): against the naive reference, zero-token cases, errors.

The multi-rank exactness (cp 2 and 4, DP x CP) is in tests/test_loss_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import cpshard
from cpshard import BshdPlan, GradReduction, ShardPlan, shard, unshard
from cpshard.loss import sequence_mean, token_mean, token_sum, token_sum_and_count
from reference import ref_sequence_mean, ref_token_count, ref_token_mean, ref_token_sum
from strategies import props

F64 = torch.float64


def _close(a, b):
    # the terms are O(1) (standard normal values, weights up to 3), so a sum that cancels to near zero
    # differs from the reference's order of summation by a few ulps of the terms, not of the result:
    # atol=1e-300 failed about once in ten CI runs on such a token_mean
    return torch.allclose(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), rtol=1e-12, atol=1e-12)


LOSSES = {
    "token_mean": (lambda x, m, p: token_mean(x, m, p, None), ref_token_mean),
    "token_sum": (lambda x, m, p: token_sum(x, m, p, None), ref_token_sum),
    "sequence_mean": (lambda x, m, p: sequence_mean(x, m, p, None), ref_sequence_mean),
    "seq-mean-token-sum": (lambda x, m, p: sequence_mean(x, m, p, None, token_reduction="sum"),
                           lambda ls, ms: ref_sequence_mean(ls, ms, "sum")),
}


@st.composite
def _cases(draw):
    lens = draw(st.lists(st.integers(0, 12), min_size=1, max_size=6))
    bshd = draw(st.booleans())
    tp = draw(st.sampled_from([1, 2, 3]))
    padding = draw(st.sampled_from(["aligned", "minimal"]))
    if bshd:
        plan = BshdPlan.build(lens, cp_size=1, tp_size=tp)
    else:
        plan = ShardPlan.build(lens, cp_size=1, tp_size=tp, padding=padding)
    seed = draw(st.integers(0, 2**31 - 1))
    weighted = draw(st.booleans())
    return plan, lens, seed, weighted


@props(60)
@given(_cases(), st.sampled_from(sorted(LOSSES)))
def test_cp1_equals_the_naive_reference(case, name):
    """Loss and gradient of every function at cp = 1, THD or BSHD, any tp and padding, 0/1 or weighted
    masks, against the reference; unlabelled rows hold inf and are never read."""
    plan, lens, seed, weighted = case
    fn, ref = LOSSES[name]
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(n, generator=g, dtype=F64) for n in lens]
    masks = [(torch.rand(n, generator=g) < 0.6).to(F64) for n in lens]
    if weighted:
        masks = [m * torch.rand(n, generator=g, dtype=F64) * 3 for m, n in zip(masks, lens)]
    rows = shard(values, plan, 0, pad_value=float("inf")).requires_grad_(True)
    mask_rows = shard(masks, plan, 0, pad_value=1.0)  # a mask that is 1 on pad rows: they must not count
    got = fn(rows, mask_rows, plan)
    got.backward()
    leaf = rows.detach().clone().requires_grad_(True)
    # the reference reads the token rows only (by the plan's token mask): pad rows never enter it
    per_seq = [s for s in unshard([torch.where(plan.token_mask(0), leaf, 0.0)], plan).unbind()]
    want = ref(per_seq, masks)
    assert _close(got.detach(), want.detach()), (name, got, want)
    if want.requires_grad:
        want.backward()
    want_grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    assert torch.allclose(rows.grad, want_grad, rtol=1e-12, atol=1e-15), name
    assert torch.isfinite(rows.grad).all()


@props(30)
@given(_cases())
def test_megatron_form_is_the_rank_sum_and_its_own_count(case):
    plan, lens, seed, _ = case
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(n, generator=g, dtype=F64) for n in lens]
    masks = [(torch.rand(n, generator=g) < 0.6).to(F64) for n in lens]
    rows, mask_rows = shard(values, plan, 0), shard(masks, plan, 0)
    loss_sum, num_tokens = token_sum_and_count(rows, mask_rows, plan, None)
    assert _close(loss_sum, ref_token_sum(values, masks))
    assert num_tokens.dtype == torch.int and int(num_tokens) == ref_token_count(masks)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("lens", [[0], [1], [0, 1, 0], [5, 3]])
def test_no_labelled_token_is_zero_loss_and_zero_gradient(name, lens):
    """An all-padding micro-batch, or one whose mask is all 0: 0, never NaN, even with NaN per-token values."""
    plan = ShardPlan.build(lens, cp_size=1, tp_size=2)
    rows = torch.full((plan.local_len,), float("nan"), dtype=F64, requires_grad=True)
    mask = plan.label_mask(0) if sum(lens) <= 1 or lens == [0, 1, 0] else torch.zeros(plan.local_len)
    loss = LOSSES[name][0](rows, mask, plan)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(rows.grad, torch.zeros_like(rows))


def test_local_shape_forms_and_bool_masks():
    """Megatron's [1, L] rows and a bool mask give the same loss as (L,) rows and a float mask."""
    plan = ShardPlan.build([4, 2, 7], cp_size=1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(plan.local_len, generator=g, dtype=F64)
    m = plan.label_mask(0)
    for fn, _ in LOSSES.values():
        assert torch.equal(fn(x.view(1, -1), m.view(1, -1), plan), fn(x, m.to(F64), plan))


def test_grad_reduction_is_a_named_value_at_the_top():
    assert cpshard.GradReduction is GradReduction is cpshard.loss.GradReduction
    assert GradReduction.parse("SUM") is GradReduction.SUM and str(GradReduction.MEAN) == "mean"
    plan = ShardPlan.build([3], cp_size=1)
    x, m = torch.ones(3, dtype=F64), torch.ones(3)
    # at cp = 1 both conventions are the same loss: the factor is cp (times dp)
    assert token_mean(x, m, plan, None, grad_reduction="sum") == token_mean(x, m, plan, None) == 1.0


def test_bad_input_is_named_with_its_fix():
    plan = ShardPlan.build([3, 2], cp_size=1)
    x, m = torch.zeros(5, dtype=F64), torch.ones(5)
    with pytest.raises(ValueError, match=r"grad_reduction='avg': is not a gradient reduction \(valid: 'mean', "
                                         r"'sum'\)\. Fix: pass one of"):
        token_mean(x, m, plan, None, grad_reduction="avg")
    with pytest.raises(ValueError, match=r"per_token=tensor of shape \(4,\): must hold one value per local row, "
                                         r"local_shape = \(5,\)"):
        token_mean(x[:4], m, plan, None)
    with pytest.raises(ValueError, match=r"loss_mask=tensor of shape \(6,\)"):
        sequence_mean(x, torch.ones(6), plan, None)
    with pytest.raises(TypeError, match=r"per_token=a torch.int64 tensor: must be floating point"):
        token_sum(torch.zeros(5, dtype=torch.long), m, plan, None)
    with pytest.raises(TypeError, match=r"per_token=list: must be a torch.Tensor"):
        token_mean([0.0] * 5, m, plan, None)
    with pytest.raises(ValueError, match=r"token_reduction='max': must be 'mean'"):
        sequence_mean(x, m, plan, None, token_reduction="max")
    with pytest.raises(TypeError, match=r"plan=str: must be a ShardPlan or BshdPlan|plan="):
        token_mean(x, m, "plan", None)
    two = ShardPlan.build([3, 2], cp_size=2)  # cp = 2 needs a process group: named before any collective
    with pytest.raises(ValueError, match=r"group=None: needs an initialized torch.distributed process group"):
        token_mean(torch.zeros(two.local_len, dtype=F64), torch.ones(two.local_len), two, None)


def test_mtp_grad_reduction_applies_to_global_counts_only():
    import torch.nn.functional as F

    from cpshard.mtp import mtp_loss

    plan = ShardPlan.build([4, 3], cp_size=1)
    g = torch.Generator().manual_seed(0)  # not the global generator: other tests' data depend on it
    w = torch.randn(5, 2, dtype=F64, generator=g)
    chunks = [torch.randn(plan.local_len, 2, dtype=F64, generator=g) for _ in range(2)]
    labels = torch.zeros(plan.local_len, dtype=torch.long)
    kw = dict(output_layer=lambda h: h @ w.T, loss_fn=lambda y, z: F.cross_entropy(z, y, reduction="none"))
    with pytest.raises(ValueError, match=r"grad_reduction='sum': does not apply to counts='local'.*"
                                         r"Fix: drop grad_reduction, or pass counts='global'"):
        mtp_loss(chunks, labels, None, plan, None, counts="local", grad_reduction="sum", **kw)
    with pytest.raises(ValueError, match=r"grad_reduction='total'"):
        mtp_loss(chunks, labels, None, plan, None, grad_reduction="total", **kw)
    # at cp = 1 every convention gives the same loss and gradient
    a = mtp_loss(chunks, labels, None, plan, None, grad_reduction="sum", **kw)
    b = mtp_loss(chunks, labels, None, plan, None, **kw)
    assert torch.equal(a.losses, b.losses)


def test_verl_agg_loss_modes_at_cp1():
    """verl 0.9.1's agg_loss on the padded (B, S) batch, one process: each mode equals the README's row
    (seq-mean-token-mean to 1e-7: verl adds 1e-8 to each sequence's count, cpshard divides exactly)."""
    try:
        from cpshard.megatron import import_megatron

        import_megatron("parallel_state")  # verl imports Megatron: the triton-free import first
    except ImportError:
        pass
    try:
        from verl.trainer.ppo.core_algos import agg_loss
    except ImportError as exc:
        pytest.skip(f"verl is not importable ({exc})")
    modes = {"token-mean": (token_mean, {}, 1e-12), "token-sum": (token_sum, {}, 1e-12),
             "seq-mean-token-mean": (sequence_mean, {}, 1e-7),
             "seq-mean-token-sum": (sequence_mean, {"token_reduction": "sum"}, 1e-12)}
    g = torch.Generator().manual_seed(5)
    nan_seen = False
    for _ in range(20):
        lens = torch.randint(0, 9, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        values = [torch.randn(n, generator=g, dtype=F64) for n in lens]
        masks = [(torch.rand(n, generator=g) < 0.6).to(F64) for n in lens]
        width = max(lens + [1])
        loss_mat = torch.zeros(len(lens), width, dtype=F64)
        mask_mat = torch.zeros(len(lens), width, dtype=F64)
        for i, (v, m) in enumerate(zip(values, masks)):
            loss_mat[i, :len(v)], mask_mat[i, :len(m)] = v, m
        plan = ShardPlan.build(lens, cp_size=1, tp_size=2)
        rows, mask_rows = shard(values, plan, 0), shard(masks, plan, 0)
        for mode, (fn, kw, tol) in modes.items():
            theirs = agg_loss(loss_mat, mask_mat, mode)
            ours = fn(rows, mask_rows, plan, None, **kw)
            if mask_mat.sum() == 0 and mode != "token-sum":  # no labelled token: verl divides 0 by 0
                assert ours == 0 and torch.isnan(theirs), (mode, ours, theirs)
                nan_seen = True
                continue
            assert torch.allclose(ours, theirs.to(F64), rtol=tol, atol=1e-300), (mode, lens, ours, theirs)
    assert nan_seen  # the batches include one without a labelled token


def test_counts_known_before_the_step():
    """num_tokens / num_seqs replace the counting (verl's batch_num_tokens / global_batch_size)."""
    plan = ShardPlan.build([4, 2, 7], cp_size=1)
    g = torch.Generator().manual_seed(2)
    values = [torch.randn(n, generator=g, dtype=F64) for n in (4, 2, 7)]
    masks = [torch.tensor([1.0, 0, 1, 0]), torch.zeros(2), torch.tensor([1.0, 1, 0, 1, 1, 0, 0])]
    x, m = shard(values, plan, 0), shard(masks, plan, 0)
    assert _close(token_mean(x, m, plan, None, num_tokens=40), ref_token_sum(values, masks) / 40)
    assert _close(token_mean(x, m, plan, None, num_tokens=torch.tensor(40)), ref_token_sum(values, masks) / 40)
    assert _close(sequence_mean(x, m, plan, None, num_seqs=5), ref_sequence_mean(values, masks) * 2 / 5)
    assert _close(sequence_mean(x, m, plan, None, token_reduction="sum", num_seqs=5),
                  ref_sequence_mean(values, masks, "sum") * 2 / 5)
    assert token_mean(x, torch.zeros_like(m), plan, None, num_tokens=0) == 0
    with pytest.raises(ValueError, match=r"num_tokens=-1: must be a count >= 0\. Fix: pass num_tokens as the total"):
        token_mean(x, m, plan, None, num_tokens=-1)
    with pytest.raises(TypeError, match=r"num_seqs='5': must be a number or a one-element tensor"):
        sequence_mean(x, m, plan, None, num_seqs="5")
    with pytest.raises(TypeError, match=r"num_tokens=True"):
        token_mean(x, m, plan, None, num_tokens=True)


def test_a_count_below_the_tokens_present_is_refused():
    """``num_tokens=0`` while the mask holds tokens returned the plain sum (a zero count is taken as
    one); any count below this rank's labelled tokens is refused, naming both (the rows on the CPU:
    read there; on a device it is a device-side assertion, no host sync)."""
    plan = ShardPlan.build([4, 3], cp_size=1)
    x = torch.arange(7, dtype=F64)
    for mask in (torch.tensor([1, 0, 1, 1, 1, 1, 0]).bool(), torch.tensor([1, 0, 1, 1, 1, 1, 0]),
                 torch.tensor([1.0, 0, 1, 1, 1, 1, 0])):
        for given in (0, 4, torch.tensor(4.0), 4.5):
            with pytest.raises(ValueError, match=rf"^num_tokens={float(given):g}: must count at least this rank's "
                                                 r"labelled tokens \(5, from the loss mask over its token rows\)"):
                token_mean(x, mask, plan, None, num_tokens=given)
        assert float(token_mean(x, mask, plan, None, num_tokens=5)) == float(x[mask.bool()].sum()) / 5
    # weights summed in another order may round a little below the mask's own float64 sum
    weights = torch.full((7,), 0.1, dtype=F64)
    summed = float(weights.float().sum())  # float32, 0.70000005 against float64's 0.7000000000000001
    assert float(token_mean(x, weights, plan, None, num_tokens=summed * (1 - 1e-7))) > 0
    with pytest.raises(ValueError, match=r"^num_tokens=0.6: must count at least"):
        token_mean(x, weights, plan, None, num_tokens=0.6)
    # num_seqs: at least the sequences holding a labelled token here (both of them; then only one)
    for token_reduction in ("mean", "sum"):
        with pytest.raises(ValueError, match=r"^num_seqs=1: must count at least this rank's labelled sequences "
                                             r"\(2, from the loss mask"):
            sequence_mean(x, torch.ones(7), plan, None, num_seqs=1, token_reduction=token_reduction)
        one = torch.tensor([1.0, 1, 1, 1, 0, 0, 0])
        assert float(sequence_mean(x, one, plan, None, num_seqs=1, token_reduction=token_reduction)) > 0


@pytest.mark.parametrize("value", [torch.tensor(-5.0), torch.tensor(float("nan")), -5, float("nan")])
def test_a_count_given_as_a_tensor_is_checked_like_a_number(value):
    """``num_tokens=torch.tensor(-5.)`` (and NaN) returned the raw sum before; the plain int was refused."""
    plan = ShardPlan.build([3, 2], cp_size=1)
    x, m = torch.arange(5, dtype=F64), torch.ones(5)
    with pytest.raises(ValueError, match=r"^num_tokens=(tensor\()?(-5|nan)(\.0)?\)?: must be a count >= 0\. Fix: "):
        token_mean(x, m, plan, None, num_tokens=value)
    with pytest.raises(ValueError, match=r"^num_seqs=.*must be a count >= 0"):
        sequence_mean(x, m, plan, None, num_seqs=value)
    meta = torch.tensor(3.0, device="meta")
    with pytest.raises(TypeError, match=r"^num_tokens=.*must be a number or a one-element tensor"):
        token_mean(x, m, plan, None, num_tokens=meta)
    assert float(token_mean(x, m, plan, None, num_tokens=torch.tensor(5.0))) == float(x.sum()) / 5
