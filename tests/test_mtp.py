"""Multi-token prediction loss in one process: the halo exchange for all ranks, the native loss against a
naive oracle, and the Megatron drop-in against megatron-core itself at ``cp = 1`` (float64).

The Megatron tests skip, naming the reason, when megatron-core is not importable; CI installs it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from cpshard import BshdPlan, Layout, ShardPlan, shard
from cpshard.index import halo as _halo
from cpshard.index.shift import all_to_all_in_process
from cpshard.megatron import import_megatron, megatron_version, mtp_loss_impl, plan_for_mtp, process_mtp_loss
from cpshard.megatron import mtp as megatron_mtp
from cpshard.mtp import MtpLossAutoScaler, mtp_loss, mtp_targets
from cpshard.plan import halo_exchange, shift_exchange
from reference import ref_crossing_halo_rows, ref_shard
from strategies import props

F64 = torch.float64


# -- the halo exchange, every rank in one process -------------------------------------------------


def emulate_multi_shift(shards, plan, shifts, pad_value, fill):
    """Apply every rank's HaloExchange to its rows, the all-to-all run in one process."""
    cp = plan.cp_size
    mss = [halo_exchange(plan, r, tuple(shifts), torch.device("cpu")) for r in range(cp)]
    rows = [s.reshape(-1) for s in shards]
    for r, ms in enumerate(mss):
        assert ms.send_splits[r] == 0 and ms.recv_splits[r] == 0
        assert sum(ms.send_splits) == ms.send_rows.numel()
        assert all(mss[s].send_splits[r] == ms.recv_splits[s] for s in range(cp))  # senders and receiver agree
    received = all_to_all_in_process(rows, [ms.send_rows for ms in mss], [ms.send_splits for ms in mss])
    return [ms.apply(rows[d], received[d], pad_value, fill) for d, ms in enumerate(mss)], mss


@props(150)
@given(
    lens=st.lists(st.sampled_from([0, 1, 2, 3, 5, 7, 8, 9, 17, 40]), min_size=1, max_size=7),
    cp=st.integers(1, 6),
    tp=st.integers(1, 2),
    layout=st.sampled_from(list(Layout)),
    shifts=st.lists(st.integers(-6, 6), min_size=1, max_size=4, unique=True),
    padding=st.sampled_from(["aligned", "none"]),
)
def test_halo_exchange_equals_shifted_shard(lens, cp, tp, layout, shifts, padding):
    """Every shift of one exchange equals SPEC's shard(shift(x, k)) (the naive reference), on every rank;
    also with ``padding="none"`` (zigzag chunks of unequal sizes)."""
    plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout, padding=padding)
    seqs = [torch.arange(n) * 10 + i + 1 for i, n in enumerate(lens)]
    shards = [shard(seqs, plan, r, pad_value=0) for r in range(cp)]
    outs, mss = emulate_multi_shift(shards, plan, shifts, pad_value=-1, fill=-7)
    for r in range(cp):
        for s, k in enumerate(shifts):
            expected = ref_shard(seqs, lens, cp, tp, layout.value, r, shift=k, pad_value=-1, fill=-7,
                                 padding=padding)
            assert torch.equal(outs[r][s], expected), (r, k, outs[r][s], expected)
    # each boundary moves at most max(shifts) rows ahead and -min(shifts) back: one halo per segment and side
    halo = max(max(shifts), 0) + max(-min(shifts), 0)
    assert sum(ms.send_rows.numel() for ms in mss) <= 2 * len(lens) * cp * halo


@props(60)
@given(
    lens=st.lists(st.sampled_from([0, 1, 2, 3, 6, 11, 30]), min_size=1, max_size=6),
    cp=st.integers(2, 5),
    tp=st.integers(1, 2),
    balanced=st.booleans(),
    shifts=st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True),
)
def test_halo_exchange_minimal_padding_and_reordered_plans(lens, cp, tp, balanced, shifts):
    """padding="minimal" and reorder="balanced" (contiguous): still shard(shift(x, k)) for every shift."""
    layout = "contiguous" if balanced else "zigzag"
    plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout, padding="minimal",
                           reorder="balanced" if balanced else None)
    seqs = [torch.arange(n) * 10 + i + 1 for i, n in enumerate(lens)]
    shards = [shard(seqs, plan, r, pad_value=0) for r in range(cp)]
    outs, _ = emulate_multi_shift(shards, plan, shifts, pad_value=-1, fill=-7)
    for r in range(cp):
        for s, k in enumerate(shifts):
            assert torch.equal(outs[r][s], shard(seqs, plan, r, shift=k, pad_value=-1, fill=-7)), (r, k)


@props(60)
@given(
    lens=st.lists(st.integers(0, 20), min_size=1, max_size=5),
    cp=st.integers(1, 4),
    layout=st.sampled_from(list(Layout)),
    shifts=st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True),
)
def test_halo_exchange_bshd(lens, cp, layout, shifts):
    plan = BshdPlan.build(lens, cp_size=cp, layout=layout)
    seqs = [torch.arange(n) * 10 + i + 1 for i, n in enumerate(lens)]
    shards = [shard(seqs, plan, r, pad_value=0) for r in range(cp)]
    outs, _ = emulate_multi_shift(shards, plan, shifts, pad_value=-1, fill=-7)
    for r in range(cp):
        for s, k in enumerate(shifts):
            expected = shard(seqs, plan, r, shift=k, pad_value=-1, fill=-7)
            assert torch.equal(outs[r][s].view(expected.shape), expected), (r, k)


def test_halo_covers_segments_shorter_than_the_largest_shift():
    """Why one halo and not shift_sharded's exchange for k = N: a one-row segment needs every halo row.

    Lengths [8] at cp = 4 zigzag give one-row chunks; depth 1 reads the next row, depth 3 the third
    one. The exchange of shift 3 alone moves only the rows depth 3 reads.
    """
    plan = ShardPlan.build([8], cp_size=4)
    seq = [torch.arange(1, 9)]
    shards = [shard(seq, plan, r, pad_value=0) for r in range(4)]
    outs, mss = emulate_multi_shift(shards, plan, [1, 2, 3], pad_value=-1, fill=-7)
    for r in range(4):
        for s, k in enumerate([1, 2, 3]):
            assert torch.equal(outs[r][s], shard(seq, plan, r, shift=k, pad_value=-1, fill=-7))
    three_only = sum(len(shift_exchange(plan, r, 3).send_rows) for r in range(4))
    assert sum(ms.send_rows.numel() for ms in mss) > three_only


def test_pack_unpack_rows_roundtrip():
    a = torch.arange(6, dtype=torch.int64)
    b = torch.tensor([0.5, 1, 0, 1, 0, 0.25], dtype=torch.float32)
    c = torch.tensor([True, False, True, True, False, False])
    d = torch.randn(6, 2, 3, dtype=torch.bfloat16)
    packed = _halo.pack_rows([a, b, c, d])
    assert packed.dtype == torch.uint8 and packed.shape == (6, 8 + 4 + 1 + 12)
    for got, want in zip(_halo.unpack_rows(packed, [a, b, c, d]), [a, b, c, d]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # one received row (found by cpshard verify --dtype float32: int64 labels + float32 mask, 12 bytes a row)
    for got, want in zip(_halo.unpack_rows(packed[2:3], [a, b, c, d]), [a, b, c, d]):
        assert got.dtype == want.dtype and torch.equal(got, want[2:3])


# -- the native loss at cp = 1 against a naive oracle ---------------------------------------------


def oracle_mtp(seqs_labels, seqs_mask, hidden_depths, weight, n, scale, per_token, derived):
    """Per sequence and token, in Python: SPEC's MTP loss on unsharded sequences (cp = 1)."""
    def shifted(seq, k, fill):
        return [seq[p + k] if p + k < len(seq) else fill for p in range(len(seq))]

    base = 1 if derived else 0
    orig = sum(sum(shifted(m, base, 0.0)) for m in seqs_mask)
    total = torch.zeros((), dtype=F64)
    for d in range(1, n + 1):
        num, acc, row = 0.0, torch.zeros((), dtype=F64), 0
        for lab, mask in zip(seqs_labels, seqs_mask):
            labs, ms = shifted(lab, base + d, 0), shifted(mask, base + d, 0.0)
            for p in range(len(lab)):
                num += ms[p]
                if ms[p]:
                    logits = hidden_depths[d][row] @ weight.T
                    acc = acc + ms[p] * F.cross_entropy(logits[None], torch.tensor([labs[p]]))
                row += 1
        coef = scale / n * ((orig / max(num, 1)) if per_token else 1 / max(num, 1))
        total = total + coef * acc
    return total


@props(40)
@given(
    lens=st.lists(st.integers(0, 7), min_size=1, max_size=4),
    n=st.integers(1, 3),
    per_token=st.booleans(),
    derived=st.booleans(),
    global_form=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_loss_equals_oracle(lens, n, per_token, derived, global_form, seed):
    g = torch.Generator().manual_seed(seed)
    plan = ShardPlan.build(lens, cp_size=1)
    vocab, h = 7, 3
    ids = [torch.randint(0, vocab, (k,), generator=g) for k in lens]
    masks = [torch.randint(0, 2, (k,), generator=g).to(F64) for k in lens]
    weight = torch.randn(vocab, h, generator=g, dtype=F64, requires_grad=True)
    hidden = [torch.randn(plan.local_len, h, generator=g, dtype=F64, requires_grad=True) for _ in range(n + 1)]
    tokens = ids if global_form else shard(ids, plan, 0, pad_value=0)
    mask = masks if global_form else shard(masks, plan, 0, pad_value=0)
    out = mtp_loss(hidden, None if derived else tokens, mask, plan, None,
                   output_layer=lambda x: x @ weight.T,
                   loss_fn=lambda y, z: F.cross_entropy(z, y, reduction="none"),
                   scaling_factor=0.3, normalization="per_token" if per_token else "mean",
                   input_ids=tokens if derived else None)
    out.hidden.sum().backward()
    got = [weight.grad.clone()] + [x.grad.clone() if x.grad is not None else torch.zeros_like(x) for x in hidden]
    for x in [weight, *hidden]:
        x.grad = None
    # derived: labels = shift(input_ids, 1), so the oracle shifts the input ids by 1 + d
    ref = oracle_mtp([t.tolist() for t in ids], [m.tolist() for m in masks], hidden, weight, n, 0.3, per_token,
                     derived)
    (sum(x.sum() for x in hidden[:1]) + ref).backward()
    want = [x.grad if x.grad is not None else torch.zeros_like(x) for x in [weight, *hidden]]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert torch.isfinite(out.losses).all()


def test_targets_match_shard_of_shift():
    lens = [5, 0, 3, 1]
    plan = ShardPlan.build(lens, cp_size=1)
    ids = [torch.arange(10 * i + 1, 10 * i + 1 + k) for i, k in enumerate(lens)]
    mask = [torch.ones(k) for k in lens]
    for derived in (False, True):
        labels_d, masks = mtp_targets(None if derived else ids, mask, plan, None, num_depths=3,
                                      input_ids=ids if derived else None, label_fill=-100)
        base = 1 if derived else 0
        for d in range(1, 4):
            assert torch.equal(labels_d[d - 1], shard(ids, plan, 0, shift=base + d, pad_value=-100, fill=-100))
        for d in range(4):
            assert torch.equal(masks[d], shard(mask, plan, 0, shift=base + d, pad_value=0, fill=0))


def test_no_valid_token_adds_exactly_zero():
    plan = ShardPlan.build([3, 2], cp_size=1)
    hidden = torch.randn(3 * plan.local_len, 4, dtype=F64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=F64, requires_grad=True)
    labels = torch.zeros(plan.local_len, dtype=torch.int64)
    for per_token in (False, True):
        out = mtp_loss(hidden, labels, torch.zeros(plan.local_len, dtype=F64), plan, None,
                       output_layer=lambda x: x @ weight.T,
                       # inf on every row (as a loss may be on ignored labels): 0 * inf would be NaN
                       loss_fn=lambda y, z: F.cross_entropy(z, y, reduction="none") + float("inf"),
                       num_depths=2, normalization="per_token" if per_token else "mean")
        out.hidden.sum().backward()
        assert torch.equal(out.losses, torch.zeros(2, dtype=F64)) and out.counts.tolist() == [0, 0, 0]
        assert torch.equal(weight.grad, torch.zeros_like(weight))
        assert torch.equal(hidden.grad[plan.local_len:], torch.zeros_like(hidden.grad[plan.local_len:]))
        hidden.grad = weight.grad = None


def test_autoscaler_scale_applies():
    plan = ShardPlan.build([4], cp_size=1)
    w = torch.randn(3, 2, dtype=F64, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def grad_with(scale):
        MtpLossAutoScaler.set_loss_scale(torch.tensor(scale))
        try:
            out = mtp_loss(torch.randn(8, 2, dtype=F64, generator=torch.Generator().manual_seed(0)),
                           torch.tensor([0, 1, 2, 1]), None, plan, None, output_layer=lambda x: x @ w.T,
                           loss_fn=lambda y, z: F.cross_entropy(z, y, reduction="none"), num_depths=1)
            out.hidden.requires_grad_(True)
            out.hidden.sum().backward()
        finally:
            MtpLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        g, w.grad = w.grad.clone(), None
        return g

    torch.testing.assert_close(grad_with(2.5), 2.5 * grad_with(1.0), rtol=1e-14, atol=0)


@pytest.mark.parametrize("call, match", [
    (lambda h, p: mtp_loss(h, torch.zeros(3), None, p, None, output_layer=id, loss_fn=id, num_depths=1),
     r"labels=tensor of shape \(3,\): must hold one value per local row"),
    (lambda h, p: mtp_loss(h, None, None, p, None, output_layer=id, loss_fn=id, num_depths=1),
     r"labels=None: needs input_ids"),
    (lambda h, p: mtp_loss(h, torch.zeros(4), None, p, None, output_layer=id, loss_fn=id),
     r"num_depths=None: is required"),
    (lambda h, p: mtp_loss(h[:7], torch.zeros(4), None, p, None, output_layer=id, loss_fn=id, num_depths=1),
     r"hidden_states=tensor of shape \(7, 2\): dim 0 must split into 1 \+ num_depths = 2"),
    (lambda h, p: mtp_loss(h, torch.zeros(4), None, p, None, output_layer=id, loss_fn=id, num_depths=1,
                           normalization="sum"),
     r"normalization='sum': is not a known normalization \(valid: 'mean', 'per_token'\)"),
    (lambda h, p: mtp_loss(h, torch.zeros(4), None, p, None, output_layer=id, loss_fn=id, num_depths=1,
                           counts="world"),
     r"counts='world': is not a known kind of counts \(valid: 'global', 'local'\)"),
    (lambda h, p: mtp_loss(h, torch.zeros(4, dtype=torch.int64), None, p, None, output_layer=lambda x: x,
                           loss_fn=lambda y, z: z, num_depths=1), r"loss_fn=.*must give one loss per local row"),
])
def test_errors_name_argument_rule_and_fix(call, match):
    plan = ShardPlan.build([4], cp_size=1)
    with pytest.raises((ValueError, TypeError), match=match) as info:
        call(torch.zeros(8, 2), plan)
    assert "Fix:" in str(info.value)


def test_plan_for_mtp_errors():
    psp = SimpleNamespace(cu_seqlens_q=torch.tensor([0, 5, 8]), cu_seqlens_q_padded=None)
    with pytest.raises(ValueError, match=r"every sequence must already be padded for cp = 2.*multiples of 4"):
        plan_for_mtp((1, 4), 2, psp)
    psp = SimpleNamespace(cu_seqlens_q=torch.tensor([0, 8, 12]), cu_seqlens_q_padded=None)
    with pytest.raises(ValueError, match=r"must hold this rank's 6 rows"):
        plan_for_mtp((1, 5), 2, psp)
    with pytest.raises(ValueError, match=r"local sequence length must be even"):
        plan_for_mtp((2, 3), 2, None)
    contiguous = SimpleNamespace(cu_seqlens_q=torch.tensor([0, 6, 8]), cu_seqlens_q_padded=None,
                                 cp_partition_mode="contiguous")
    assert plan_for_mtp((1, 4), 2, contiguous).layout is Layout.CONTIGUOUS


# -- the drop-in against megatron-core at cp = 1 --------------------------------------------------


def megatron_module():
    try:
        return import_megatron("transformer.multi_token_prediction")
    except ImportError as exc:
        pytest.skip(f"megatron-core is not importable ({exc}); CI installs it (scripts/setup.sh)")


class OutputLayer(torch.nn.Module):
    """Megatron's output layer calling convention: ``(hidden, weight=..., runtime_gather_output=...)``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        w = self.weight if weight is None else weight
        return hidden @ w.T, None


def language_model_loss(labels, logits):
    """GPTModel.compute_language_model_loss without TP: labels [b, s], logits [s, b, V] -> loss [b, s]."""
    s, b, v = logits.shape
    return F.cross_entropy(logits.transpose(0, 1).reshape(-1, v), labels.reshape(-1), reduction="none").view(b, s)


def make_case(seed, lens, packed, n, with_mask, derived, batch=2, vocab=11, h=4, mask_dtype=F64):
    """Inputs as Megatron's GPTModel hands them to process_mtp_loss at cp = 1."""
    g = torch.Generator().manual_seed(seed)
    if packed:
        b, s = 1, sum(lens)
        cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32)
        psp = import_megatron("packed_seq_params").PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
            max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
    else:
        b, s, psp = batch, max(lens), None
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.randint(0, 2, (b, s), generator=g).to(mask_dtype) if with_mask else None
    hidden = torch.randn((1 + n) * s, b, h, generator=g, dtype=F64)
    weight = torch.randn(vocab, h, generator=g, dtype=F64)
    upstream = torch.randn(s, b, h, generator=g, dtype=F64)
    return dict(ids=ids, labels=None if derived else labels, mask=mask, hidden=hidden, weight=weight, psp=psp,
                upstream=upstream)


def run_drop_in(fn, case, config, *, shared_weight, scale_logits=False, **kw):
    """Call ``fn`` (Megatron's or cpshard's process_mtp_loss) and back-propagate ``upstream`` from its output."""
    hidden = case["hidden"].clone().requires_grad_(True)
    layer = OutputLayer(case["weight"].clone())
    output_weight = layer.weight if shared_weight else None
    out = fn(hidden_states=hidden, labels=case["labels"], loss_mask=case["mask"], output_layer=layer,
             output_weight=output_weight, runtime_gather_output=None, is_training=False,
             compute_language_model_loss=language_model_loss, config=config,
             packed_seq_params=case["psp"], scale_logits_fn=(lambda x: 0.5 * x) if scale_logits else None,
             input_ids=case["ids"], **kw)
    (out * case["upstream"]).sum().backward()
    wgrad = layer.weight.grad if layer.weight.grad is not None else torch.zeros_like(layer.weight)
    return out.detach(), hidden.grad, wgrad


# Megatron's inputs at cp = 1: packed (THD) or BSHD, 1..3 depths, both loss modes, with or without a
# loss mask, labels given or derived from input ids
CASES = dict(
    lens=st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(lambda x: sum(x) > 0),
    packed=st.booleans(),
    n=st.integers(1, 3),
    per_token=st.booleans(),
    with_mask=st.booleans(),
    derived=st.booleans(),
)


def assert_same(a, b):
    out_a, h_a, w_a = a
    out_b, h_b, w_b = b
    assert torch.equal(out_a, out_b)
    torch.testing.assert_close(h_a, h_b, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(w_a, w_b, rtol=1e-12, atol=1e-14)


@props(60)
@given(
    **CASES,
    detach=st.booleans(),
    shared_weight=st.booleans(),
    scale_logits=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_drop_in_equals_megatron_process_mtp_loss(lens, packed, n, per_token, with_mask, derived, detach,
                                                  shared_weight, scale_logits, seed):
    mod = megatron_module()
    if not hasattr(mod, "process_mtp_loss"):
        pytest.skip(f"megatron-core {megatron_version()} has no process_mtp_loss (0.19 has); "
                    "test_drop_in_equals_loop_on_megatron_roll covers this version")
    # (dev reads cross_entropy_loss_fusion too; off, as on the CPU)
    config = SimpleNamespace(mtp_num_layers=n, mtp_loss_scaling_factor=0.3, calculate_per_token_loss=per_token,
                             mtp_detach_heads=detach, cross_entropy_loss_fusion=False)
    case = make_case(seed, lens, packed, n, with_mask, derived)
    kw = dict(shared_weight=shared_weight, scale_logits=scale_logits)
    theirs = {}
    if "sequence_roll_context" in inspect.signature(mod.process_mtp_loss).parameters:  # Megatron-LM dev
        theirs["sequence_roll_context"] = None  # what dev's GPTModel passes at cp = 1
    # the drop-in takes dev's context and does not need it: any value gives the same result
    assert_same(run_drop_in(process_mtp_loss, case, config, sequence_roll_context=_RollContext(), **kw),
                run_drop_in(mod.process_mtp_loss, case, config, **theirs, **kw))


class _RollContext:
    """A stand-in for Megatron-LM dev's MTPSequenceRollContext (nothing in it is read)."""

    def __getattr__(self, name):
        raise AssertionError(f"the drop-in read sequence_roll_context.{name}")


# process_mtp_loss's parameters in megatron-core 0.19.2 and in Megatron-LM dev (d48bd6b, 2026-08-21),
# which added sequence_roll_context; main (d98e8a6) and 0.19 have the first fourteen.
_DEV_PARAMS = ("hidden_states", "labels", "loss_mask", "output_layer", "output_weight", "runtime_gather_output",
               "is_training", "compute_language_model_loss", "config", "cp_group", "tp_group",
               "packed_seq_params", "scale_logits_fn", "input_ids", "sequence_roll_context")


def test_drop_in_takes_every_parameter_of_every_megatron():
    """Positional parameters in Megatron's order, so that a caller passing dev's fifteen (GPTModel,
    HybridModel) or a release's fourteen, by position or keyword, reaches the drop-in unchanged."""
    ours = [p.name for p in inspect.signature(process_mtp_loss).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert tuple(ours) == _DEV_PARAMS
    mod = megatron_module()
    if hasattr(mod, "process_mtp_loss"):  # the installed one (0.19.2 in CI; dev's tree by hand)
        theirs = [p.name for p in inspect.signature(mod.process_mtp_loss).parameters.values()]
        assert ours[:len(theirs)] == theirs


def megatron_loop(mod):
    """megatron-core 0.19's MTP loss recipe, built from the installed version's own roll_tensor and autoscaler.

    Lets the drop-in be compared with the Megatron that is installed where process_mtp_loss is
    missing (0.16: the loop lives in GPTModel; 0.14: roll_tensor has no packed_seq_params).
    """
    def run(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output, is_training,
            compute_language_model_loss, config, cp_group=None, packed_seq_params=None, scale_logits_fn=None,
            input_ids=None):
        def roll(x):
            kw = {"shifts": -1, "dims": -1, "cp_group": cp_group}
            if packed_seq_params is not None:
                kw["packed_seq_params"] = packed_seq_params
            if "tensors" in inspect.signature(mod.roll_tensor).parameters:  # Megatron-LM dev: a list in and out
                rolled = mod.roll_tensor([x], **kw)[0]
                return rolled, rolled.sum()
            return mod.roll_tensor(x, **kw)

        chunks = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)
        hidden = chunks[0]
        if labels is None:
            labels, _ = roll(input_ids)
            loss_mask = torch.ones_like(labels) if loss_mask is None else loss_mask
            loss_mask, _ = roll(loss_mask)
        elif loss_mask is None:
            loss_mask = torch.ones_like(labels)
        orig = loss_mask.sum()
        for i in range(config.mtp_num_layers):
            logits, _ = output_layer(chunks[i + 1], weight=output_weight, runtime_gather_output=runtime_gather_output)
            labels, _ = roll(labels)
            loss_mask, num = roll(loss_mask)
            loss = loss_mask * compute_language_model_loss(labels, logits)
            s = config.mtp_loss_scaling_factor / config.mtp_num_layers
            if config.calculate_per_token_loss:
                hidden = mod.MTPLossAutoScaler.apply(hidden, s * loss * (orig / num.clamp(min=1)))
            else:
                hidden = mod.MTPLossAutoScaler.apply(hidden, s * loss / num.clamp(min=1))
        return hidden
    return run


@props(30)
@given(
    **CASES,
    seed=st.integers(0, 2**16),
)
def test_drop_in_equals_loop_on_megatron_roll(lens, packed, n, per_token, with_mask, derived, seed):
    """On every installed version (0.14, 0.16, 0.19): the same recipe on Megatron's own roll_tensor."""
    mod = megatron_module()
    if packed and not hasattr(mod, "_roll_tensor_packed_seq"):
        packed = False  # 0.14/0.15: no packed roll to compare with
    config = SimpleNamespace(mtp_num_layers=n, mtp_loss_scaling_factor=0.3, calculate_per_token_loss=per_token,
                             cross_entropy_loss_fusion=False)
    case = make_case(seed, lens, packed, n, with_mask, derived)
    assert_same(run_drop_in(process_mtp_loss, case, config, shared_weight=True),
                run_drop_in(megatron_loop(mod), case, config, shared_weight=True))


def test_drop_in_uses_megatrons_autoscaler_scale():
    mod = megatron_module()
    config = SimpleNamespace(mtp_num_layers=2, mtp_loss_scaling_factor=0.3, calculate_per_token_loss=False,
                             cross_entropy_loss_fusion=False)
    case = make_case(3, [5, 4], True, 2, True, False)
    _, h1, w1 = run_drop_in(process_mtp_loss, case, config, shared_weight=True)
    saved = mod.MTPLossAutoScaler.main_loss_backward_scale
    mod.MTPLossAutoScaler.set_loss_scale(torch.tensor(4.0))
    try:
        _, h4, w4 = run_drop_in(process_mtp_loss, case, config, shared_weight=True)
    finally:
        mod.MTPLossAutoScaler.set_loss_scale(saved)
    torch.testing.assert_close(w4, 4 * w1, rtol=1e-13, atol=0)
    s = case["upstream"].shape[0]  # the main chunk's gradient is the upstream one, unscaled
    torch.testing.assert_close(h4[:s], h1[:s], rtol=0, atol=0)
    torch.testing.assert_close(h4[s:], 4 * h1[s:], rtol=1e-13, atol=0)


def test_training_logs_like_megatron(monkeypatch):
    """is_training: the same values reach Megatron's tracker (loss, and acceptance counts on 0.19)."""
    mod = megatron_module()
    if not hasattr(mod, "process_mtp_loss"):
        pytest.skip(f"megatron-core {megatron_version()} has no process_mtp_loss to compare the logging with")
    helper = mod.MTPLossLoggingHelper
    for per_token in (False, True):
        records = []
        for name in ("save_metrics_to_tracker", "save_loss_to_tracker"):  # whichever the version has and calls
            if hasattr(helper, name):
                def record(*a, _name=name, **k):
                    records.append((_name, a, k))
                monkeypatch.setattr(helper, name, staticmethod(functools.wraps(getattr(helper, name))(record)))
        parallel_state = import_megatron("parallel_state")
        monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda **k: "dp-cp-group")
        config = SimpleNamespace(mtp_num_layers=2, mtp_loss_scaling_factor=0.3, calculate_per_token_loss=per_token,
                                 mtp_detach_heads=False, cross_entropy_loss_fusion=False)
        case = make_case(5, [6, 1, 4], True, 2, True, False)
        for fn in (mod.process_mtp_loss, process_mtp_loss):
            hidden = case["hidden"].clone().requires_grad_(True)
            fn(hidden, case["labels"], case["mask"], OutputLayer(case["weight"]), None, None, True,
               language_model_loss, config, packed_seq_params=case["psp"], input_ids=case["ids"])
        assert len(records) == 4
        for (n_m, a_m, k_m), (n_c, a_c, k_c) in zip(records[:2], records[2:]):
            assert n_m == n_c and k_m.keys() == k_c.keys() and k_m["avg_group"] == k_c["avg_group"] == "dp-cp-group"
            for x, y in zip([*a_m, *k_m.values()], [*a_c, *k_c.values()], strict=True):
                if isinstance(x, torch.Tensor):
                    torch.testing.assert_close(y, x, rtol=1e-12, atol=0, check_dtype=False)
                else:
                    assert x == y


def test_fused_linear_cross_entropy_like_megatron(monkeypatch):
    """Megatron-LM dev, ``cross_entropy_loss_fusion`` with the "linear" implementation: each depth's loss
    comes from the output layer (``output_cross_entropy_loss=True``, no logits), and no acceptance
    counts are computed (there are no logits to count them from); the releases always build logits."""
    mod = megatron_module()
    if not megatron_mtp.fuses_linear_cross_entropy(
            mod, SimpleNamespace(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="linear")):
        pytest.skip(f"megatron-core {megatron_version()}'s process_mtp_loss builds logits whatever the fusion "
                    "(Megatron-LM dev fuses)")
    calls = []

    class FusedHead(OutputLayer):
        def forward(self, hidden, weight=None, runtime_gather_output=None, output_cross_entropy_loss=False,
                    labels=None):
            calls.append(output_cross_entropy_loss)
            logits, bias = super().forward(hidden, weight=weight, runtime_gather_output=runtime_gather_output)
            if not output_cross_entropy_loss:
                return logits, bias
            return language_model_loss(labels, logits)

    monkeypatch.setattr(mod, "_compute_mtp_acceptance_counts",
                        lambda *a, **k: pytest.fail("acceptance counted without logits"))
    config = SimpleNamespace(mtp_num_layers=2, mtp_loss_scaling_factor=0.3, calculate_per_token_loss=False,
                             mtp_detach_heads=False, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="linear")
    case = make_case(7, [5, 3, 4], True, 2, True, False)
    results = []
    for fn in (mod.process_mtp_loss, process_mtp_loss):
        hidden = case["hidden"].clone().requires_grad_(True)
        head = FusedHead(case["weight"].clone())
        out = fn(hidden, case["labels"], case["mask"], head, None, None, False, language_model_loss, config,
                 packed_seq_params=case["psp"], input_ids=case["ids"])
        (out * case["upstream"]).sum().backward()
        results.append((out.detach(), hidden.grad, head.weight.grad))
    assert calls == [True, True, True, True]
    assert_same(results[1], results[0])


def test_mtp_loss_impl_chooses_and_logs_once(caplog):
    mod = megatron_module()
    megatron_mtp.forget_logged_choices()
    with caplog.at_level(logging.INFO, logger="cpshard.megatron"):
        one, four = mtp_loss_impl(1), mtp_loss_impl(4)
        mtp_loss_impl(1)
    assert four.source == "cpshard" and four.fn is process_mtp_loss
    if hasattr(mod, "process_mtp_loss") and hasattr(mod, "_roll_tensor_packed_seq"):
        assert one.source == "megatron" and one.fn is mod.process_mtp_loss
        assert "cp = 4 > 1" in four.reason
    else:  # 0.14 / 0.16: cpshard's at every cp, for the same reason
        assert one == four and one.source == "cpshard" and megatron_version() in one.reason
    logged = [r.getMessage() for r in caplog.records if r.name == "cpshard.megatron"]
    expected = [f"MTP loss: using {c.source}'s process_mtp_loss ({c.reason})" for c in (one, four)]
    assert logged == (expected if one != four else expected[:1])  # once per distinct choice


def test_mtp_loss_impl_without_megatron(monkeypatch):
    monkeypatch.setattr(megatron_mtp, "megatron_mtp_module",
                        lambda: (None, "ModuleNotFoundError: No module named 'megatron'"))
    impl = mtp_loss_impl(1)
    assert impl.source == "cpshard" and "not importable" in impl.reason
    # and the drop-in still works, with cpshard's own autoscaler
    config = SimpleNamespace(mtp_num_layers=1, mtp_loss_scaling_factor=1.0, calculate_per_token_loss=False)
    psp = SimpleNamespace(cu_seqlens_q=torch.tensor([0, 3, 5]), cu_seqlens_q_padded=None)
    hidden = torch.randn(10, 1, 2, dtype=F64, requires_grad=True)
    out = process_mtp_loss(hidden, torch.tensor([[1, 2, 0, 1, 2]]), None, OutputLayer(torch.randn(3, 2, dtype=F64)),
                           None, None, False, language_model_loss, config, packed_seq_params=psp)
    out.sum().backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad[5:].abs().sum() > 0


def test_megatron_version_is_the_imported_one():
    mod = megatron_module()
    package_info = import_megatron("package_info")
    assert megatron_version() == package_info.__version__.split("+")[0]  # 0.19 appends the cwd's git hash
    assert mod.__file__.startswith(package_info.__file__.rsplit("/megatron/", 1)[0])


@props(150)
@given(
    lens=st.lists(st.integers(0, 9) | st.integers(0, 70), min_size=1, max_size=10),
    cp=st.integers(1, 9),
    tp=st.integers(1, 3),
    layout=st.sampled_from(list(Layout)),
    shifts=st.lists(st.integers(-7, 7), min_size=1, max_size=4, unique=True),
    kind=st.sampled_from(["aligned", "minimal", "none", "balanced", "bshd"]),
)
def test_crossing_halo_rows_counted_in_closed_form(lens, cp, tp, layout, shifts, kind):
    """Every rank's ``total_remote`` (a closed form over the sequences, no segment built) is the naive
    count of halo rows held by another rank; the ranks' receives add up to it."""
    if kind == "bshd":
        lens = lens[:6]
        plan = BshdPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout)
        padded = [plan.max_seqlen]
    else:
        balanced = kind == "balanced" and layout is Layout.CONTIGUOUS
        plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout, padding=kind if kind in ("minimal", "none")
                               else "aligned", reorder="balanced" if balanced else None)
        padded = list(plan.padded_seqlens_py)
    want = ref_crossing_halo_rows(plan.seqlens_py, padded, cp, layout, shifts, bshd=kind == "bshd")
    mss = [halo_exchange(plan, r, tuple(shifts)) for r in range(cp)]
    assert [ms.total_remote for ms in mss] == [want] * cp
    assert sum(sum(ms.recv_splits) for ms in mss) == want
