"""Behaviour of the public API beyond the reference comparisons: host syncs, autograd, layout choice, CLI."""

from __future__ import annotations

import re
import types

import pytest
import torch

import cpshard
from cpshard import (
    BshdPlan,
    Layout,
    ShardPlan,
    layout_for,
    register_layout_rule,
    shard,
    unregister_layout_rule,
    unshard,
)
from cpshard.cli import main as cli_main
from reference import ref_shard


def _jagged(lens, trailing=()):
    values = torch.arange(sum(lens) * max(1, int(torch.tensor(trailing).prod()) if trailing else 1))
    values = values.view(sum(lens), *trailing)
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


class _CountToList:
    """Counts host copies of the batch's lengths: ``tolist`` of the given nested tensors' offsets.

    (The plan's own index math may read the small CPU tensors it builds from Python ints; those are
    no device-to-host copy and are not counted.)
    """

    def __init__(self, monkeypatch, *batches):
        self.calls = 0
        original = torch.Tensor.tolist
        storages = {b.offsets().untyped_storage().data_ptr() for b in batches}

        def counted(t):
            if t.untyped_storage().data_ptr() in storages:
                self.calls += 1
            return original(t)
        monkeypatch.setattr(torch.Tensor, "tolist", counted)


def test_one_host_copy_of_lengths_per_batch(monkeypatch):
    """``from_nested`` reads the lengths once; sharding its values and unsharding read nothing."""
    nt = _jagged([5, 0, 9, 3])
    counter = _CountToList(monkeypatch, nt)
    plan, values = ShardPlan.from_nested(nt, cp_size=2, tp_size=2)
    assert counter.calls == 1
    assert values is nt.values() or torch.equal(values, nt.values())
    for r in range(2):
        for k in (0, 1, 2):
            shard(values, plan, r, shift=k, fill=-1)
    parts = [shard(values, plan, r) for r in range(2)]
    back = unshard(parts, plan)
    assert counter.calls == 1
    assert plan.seqlens_py == (5, 0, 9, 3) and plan == ShardPlan.build([5, 0, 9, 3], cp_size=2, tp_size=2)
    assert torch.equal(back.values(), nt.values())


def test_nested_input_is_checked_on_every_call(monkeypatch):
    """A nested tensor passed to shard is checked against the plan each time: one host copy a call."""
    plan = ShardPlan.build([2, 3], cp_size=2)
    good = _jagged([2, 3])
    counter = _CountToList(monkeypatch, good)
    shard(good, plan, 0)
    shard(good, plan, 1)
    assert counter.calls == 2
    with pytest.raises(ValueError, match="must match the plan's seqlens"):
        shard(_jagged([3, 2]), plan, 0)


def test_gradients_flow_through_shard_and_unshard():
    plan = ShardPlan.build([7, 2, 0, 5], cp_size=3, layout="contiguous")
    x = torch.randn(14, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(14, 4, dtype=torch.float64)
    parts = [shard(x, plan, r, shift=1) for r in range(3)]
    (unshard(parts, plan).values() * w).sum().backward()
    # d/dx of sum(shift(x, 1) * w): token p+1 receives w at token p, within each sequence
    expected = torch.zeros_like(x)
    start = 0
    for n in plan.seqlens_py:
        expected[start + 1:start + n] = w[start:start + n - 1]
        start += n
    assert torch.equal(x.grad, expected)


def test_index_cache_is_per_device_and_reused():
    plan = ShardPlan.build([5, 3], cp_size=2)
    cpu = torch.device("cpu")
    a = plan.indices().shard(0, 1, cpu)
    assert plan.indices().shard(0, 1, cpu) is a
    assert plan.indices().shard(0, 2, cpu) is not a
    assert ShardPlan.build([5, 3], cp_size=2).indices().shard(0, 1, cpu) is not a  # not shared


def test_device_tensors_are_copied_once():
    plan = ShardPlan.build([5, 0, 3], cp_size=2)
    dev = plan.device_tensors("cpu")
    assert plan.device_tensors(torch.device("cpu")) is dev
    assert dev.seqlens.tolist() == [5, 0, 3] and dev.cu_seqlens.tolist() == [0, 5, 5, 8]
    assert dev.cu_seqlens_padded.tolist() == [0, 8, 8, 12]
    assert all(t.dtype == torch.int32 for t in (dev.seqlens, dev.cu_seqlens, dev.cu_seqlens_padded))
    bshd = BshdPlan.build([5, 3], cp_size=2).device_tensors("cpu")
    assert bshd.cu_seqlens_padded.tolist() == [0, 8, 16] and bshd.cu_seqlens.tolist() == [0, 5, 8]


def test_plans_are_values():
    a = ShardPlan.build([5, 3], cp_size=2)
    b = ShardPlan.build(torch.tensor([5, 3]), cp_size=2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != ShardPlan.build([5, 3], cp_size=2, layout="contiguous")
    assert a != BshdPlan.build([5, 3], cp_size=2)
    with pytest.raises(AttributeError, match="cannot assign to field 'cp_size'"):
        a.cp_size = 4  # frozen


def test_layout_for_config():
    assert layout_for(types.SimpleNamespace(experimental_attention_variant="dsv4_hybrid")) is Layout.CONTIGUOUS
    assert layout_for(types.SimpleNamespace(experimental_attention_variant=None)) is Layout.ZIGZAG
    assert layout_for(object()) is Layout.ZIGZAG


@pytest.mark.parametrize("field", ["cp_partition_mode", "attention_cp_layout"])
def test_layout_for_reads_the_layout_the_config_declares(field):
    """Megatron-LM dev's TransformerConfig.cp_partition_mode (and attention_cp_layout) decide, except
    that DeepSeek-V4's dsv4_hybrid is contiguous whatever they say (zigzag corrupts it)."""
    assert layout_for(types.SimpleNamespace(**{field: "contiguous"})) is Layout.CONTIGUOUS
    assert layout_for(types.SimpleNamespace(**{field: "zigzag"})) is Layout.ZIGZAG
    assert layout_for(types.SimpleNamespace(**{field: None})) is Layout.ZIGZAG
    dsv4 = types.SimpleNamespace(experimental_attention_variant="dsv4_hybrid", **{field: "zigzag"})
    assert layout_for(dsv4) is Layout.CONTIGUOUS
    with pytest.raises(ValueError, match=rf"^config\.{field}='ring': is not a known layout"):
        layout_for(types.SimpleNamespace(**{field: "ring"}))


def test_registered_layout_rule_wins():
    @register_layout_rule
    def ring_only(config):
        return "contiguous" if getattr(config, "name", "") == "my-kernel" else None

    try:
        assert layout_for(types.SimpleNamespace(name="my-kernel")) is Layout.CONTIGUOUS
        assert layout_for(types.SimpleNamespace(name="other")) is Layout.ZIGZAG
    finally:
        unregister_layout_rule(ring_only)
    assert layout_for(types.SimpleNamespace(name="my-kernel")) is Layout.ZIGZAG


def test_cli_plan_prints_spec_picture(capsys):
    assert cli_main(["plan", "--lengths", "5,3", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 : s0p0 s0p1 | pad  pad  | s1p0 | pad" in out
    assert "rank 1 : s0p2 s0p3 | s0p4 pad  | s1p1 | s1p2" in out
    assert "padded_seqlens = [8, 4]" in out and "padding overhead = 50.0%" in out


def test_cli_plan_reports_bad_input(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", "--lengths", "5,-3", "--cp", "2"])
    assert exit_info.value.code == 2 and "argument --lengths: '5,-3': length 2 is -3" in capsys.readouterr().err


def test_cli_balance_zigzag_beats_contiguous(capsys):
    """The balance table shows why zigzag exists: causal work is spread evenly."""
    cli_main(["plan", "--lengths", "4096", "--cp", "4"])
    zigzag = capsys.readouterr().out
    cli_main(["plan", "--lengths", "4096", "--cp", "4", "--layout", "contiguous"])
    contiguous = capsys.readouterr().out

    def ratio(text):
        return float(text.split("causal work max/mean = ")[1].split()[0])
    assert ratio(zigzag) == 1.0 and ratio(contiguous) > 1.5


# -- found in review: caches, aliasing, odd inputs ------------------------------------------------


def test_replace_gives_a_fresh_cache():
    import dataclasses

    p = ShardPlan.build([6, 2], cp_size=2)
    shard(torch.arange(8), p, 0)
    q = dataclasses.replace(p, layout="contiguous")
    assert shard(torch.arange(8), q, 0).tolist() == [0, 1, 2, 3, 4, 5]
    b = BshdPlan.build([6, 2], cp_size=2)
    shard([torch.arange(6), torch.arange(2)], b, 0)
    c = dataclasses.replace(b, layout="contiguous")
    assert c.columns(0).tolist() == [0, 1, 2, 3]


def test_plans_pickle_after_use():
    import pickle

    nt = _jagged([5, 3])
    plan = ShardPlan.build(nt, cp_size=2)
    unshard([shard(nt, plan, r) for r in range(2)], plan)
    clone = pickle.loads(pickle.dumps(plan))
    assert clone == plan and torch.equal(shard(nt, clone, 1), shard(nt, plan, 1))


def test_views_cannot_change_the_plan():
    plan = ShardPlan.build([5, 3], cp_size=2)
    mask = plan.token_mask(0).clone()
    plan.position_ids(0).clamp_(max=1)
    plan.global_rows(0).zero_()
    assert plan.cu_seqlens_padded is plan.cu_seqlens_padded  # built once per plan (shared, read-only by contract)
    plan.cu_seqlens_padded[1] = 0  # editing the shared offsets anyway cannot change the plan's value or indices
    assert torch.equal(plan.token_mask(0), mask)
    assert plan.cu_seqlens_padded_py == (0, 8, 12) and plan == ShardPlan.build([5, 3], cp_size=2)
    assert shard(torch.arange(8), plan, 1).tolist() == [2, 3, 4, 0, 6, 7]
    out = unshard([shard(torch.arange(8), plan, r) for r in range(2)], plan)
    out.offsets()[1] = 1  # the caller's tensor; the plan keeps its own
    assert cpshard.shift(torch.arange(8), plan, 1).tolist() == [1, 2, 3, 4, 0, 6, 7, 0]


def test_offsets_edited_in_place_are_read_again():
    off = torch.tensor([0, 5, 8])
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(8), offsets=off)
    plan = ShardPlan.build(nt, cp_size=2)
    off[1] = 2
    nt2 = torch.nested.nested_tensor_from_jagged(torch.arange(8) + 50, offsets=off)
    with pytest.raises(ValueError, match=r"lengths \[2, 6\]"):
        shard(nt2, plan, 0)


def test_offsets_must_start_at_zero():
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(100, 110), offsets=torch.tensor([2, 7, 10]))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        ShardPlan.build(nt, cp_size=2)
    with pytest.raises(ValueError, match="offsets starting at 2"):
        shard(nt, ShardPlan.build([5, 3], cp_size=2), 0)


def test_transposed_nested_is_rejected():
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(128.0).reshape(8, 16), offsets=torch.tensor([0, 5, 8]))
    with pytest.raises(ValueError, match="ragged dimension at 2"):
        shard(nt.transpose(1, 2), ShardPlan.build([5, 3], cp_size=2), 0)


@pytest.mark.parametrize(("dtype", "name", "value", "kind"), [
    (torch.bool, "fill", -100, ValueError),
    (torch.uint8, "fill", -100, ValueError),
    (torch.int64, "pad_value", 1.7, ValueError),
    (torch.int8, "pad_value", 300, ValueError),
    (torch.float32, "fill", None, TypeError),
    (torch.float32, "fill", 1j, ValueError),
])
def test_fill_values_must_fit_the_dtype(dtype, name, value, kind):
    plan = ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(kind, match=f"{name}="):
        shard(torch.zeros(8, dtype=dtype), plan, 1, shift=1, **{name: value})


def test_fill_values_that_fit_are_accepted():
    plan = ShardPlan.build([5, 3], cp_size=2)
    assert shard(torch.ones(8, dtype=torch.bool), plan, 1, shift=1, fill=0).tolist() == \
        [True, True, False, False, True, False]
    assert shard(torch.zeros(8, dtype=torch.int64), plan, 1, pad_value=-100.0).tolist()[3] == -100


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_rows(dtype):
    plan = ShardPlan.build([5, 3], cp_size=2)
    x = (torch.arange(8, dtype=torch.float32) / 4).to(dtype)
    out = shard(x, plan, 1, shift=1, fill=-2.0, pad_value=0.5)
    want = torch.tensor([0.75, 1.0, -2.0, 0.5, 1.75, -2.0]).to(dtype)
    assert out.dtype == dtype and torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    back = unshard([shard(x, plan, r) for r in range(2)], plan)
    assert torch.equal(back.values().view(torch.uint8), x.view(torch.uint8))


def test_all_empty_batch_keeps_the_graph():
    plan = ShardPlan.build([0, 0], cp_size=2, min_local_rows=4)
    x = torch.zeros(0, 3, requires_grad=True)
    out = shard(x, plan, 0)
    assert out.shape == (4, 3) and out.requires_grad
    out.sum().backward()
    assert x.grad.shape == (0, 3)


def test_odd_length_inputs():
    import numpy as np

    assert ShardPlan.build(np.array([5, 3]), cp_size=2) == ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(ValueError, match="meta device"):
        ShardPlan.build(torch.tensor([5, 3], device="meta"), cp_size=2)


def test_meta_lengths_and_sizes_are_refused_by_name():
    """Lengths as meta scalars, sizes, ranks and shifts on the meta device crashed with
    ``Tensor.item() cannot be called on meta tensors``; each is refused, named, with its fix."""
    from cpshard import pack

    def meta(v):
        return torch.tensor(v, device="meta")

    nested = torch.nested.nested_tensor([torch.zeros(5), torch.zeros(3)], layout=torch.jagged).to("meta")
    plan = ShardPlan.build([5, 3], cp_size=2)
    cases = [(lambda: ShardPlan.build([meta(5), meta(3)], cp_size=2), "seqlens[0]"),
             (lambda: BshdPlan.build([meta(5)], cp_size=2), "seqlens[0]"),
             (lambda: pack([5, meta(3)], max_tokens=16, cp_size=2), "seqlens[1]"),
             (lambda: ShardPlan.build([5, 3], cp_size=meta(2)), "cp_size"),
             (lambda: ShardPlan.build([5, 3], cp_size=2, tp_size=meta(1)), "tp_size"),
             (lambda: ShardPlan.from_nested(nested, cp_size=2), "nt"),
             (lambda: shard(torch.arange(8.0), plan, meta(0)), "cp_rank"),
             (lambda: shard(torch.arange(8.0), plan, 0, shift=meta(1)), "shift")]
    for call, name in cases:
        with pytest.raises(ValueError, match=rf"^{re.escape(name)}=a tensor of shape .* on the meta device: must "
                                             rf"hold real values .*Fix: pass {re.escape(name)} on a real device"):
            call()
    with pytest.raises(ValueError, match="below 2\\*\\*31"):
        ShardPlan.build([2**30, 2**30], cp_size=1)


def test_shift_with_bshd_plan_and_plain_tensor_is_refused():
    plan = BshdPlan.build([1, 1], cp_size=1)
    with pytest.raises(ValueError, match="padded \\(B, S, ...\\) batch"):
        cpshard.shift(torch.zeros(2, 4), plan, 1)


def test_cli_rejects_empty_length(capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--lengths", "5,,3"])
    assert "expected comma-separated ints" in capsys.readouterr().err


def test_cli_bshd_columns(capsys):
    assert cli_main(["plan", "--bshd", "--lengths", "5,3", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 : columns [0, 1, 6, 7]" in out and "rank 1 : columns [2, 3, 4, 5]" in out
    assert "row 1  : t0 t1 .  .  | t2 .  .  ." in out
    assert cli_main(["plan", "--bshd", "--lengths", "5,3", "--cp", "2", "--max-seqlen", "4"]) == 2
    assert "--max-seqlen=4" in capsys.readouterr().err


@pytest.mark.parametrize(("dtype", "ok", "bad"), [
    (torch.uint8, (0, 255), (-1, 256)),
    (torch.int8, (-128, 127), (-129, 128)),
])
def test_fill_values_at_the_edges_of_the_range(dtype, ok, bad):
    plan = ShardPlan.build([5, 3], cp_size=2)
    for v in ok:
        out = shard(torch.zeros(8, dtype=dtype), plan, 1, shift=1, fill=v, pad_value=v)
        assert out.tolist() == [0, 0, v, v, 0, v]
    for v in bad:
        with pytest.raises(ValueError, match="outside the range"):
            shard(torch.zeros(8, dtype=dtype), plan, 1, shift=1, fill=v)


def test_every_shift_reads_one_index():
    """A shift reads the unshifted index from a shifted view of the input: the cached indices of a rank
    do not grow with the number of shifts (MTP depths), and the rows a view cannot serve are fill rows."""
    plan = ShardPlan.build([7, 2, 0, 5], cp_size=3, layout="contiguous")
    cpu = torch.device("cpu")
    for r in range(3):
        base = plan.indices().shard(r, 0, cpu).source
        assert all(plan.indices().shard(r, k, cpu).source is base for k in (1, 2, 3))
    seqs = [torch.arange(n) + 10 * i for i, n in enumerate([7, 2, 0, 5])]
    for r in range(3):  # rank 2 holds the input's last tokens: its gather skips them (fill rows)
        for k in (1, 2, 3):
            want = ref_shard(seqs, [7, 2, 0, 5], 3, 1, "contiguous", r, shift=k, fill=-1)
            assert torch.equal(shard(torch.cat(seqs), plan, r, shift=k, fill=-1), want)
    tiny = ShardPlan.build([2], cp_size=1)
    assert shard(torch.tensor([5, 6]), tiny, 0, shift=3, fill=-1).tolist() == [-1, -1]  # every source is past the end


def test_import_cpshard_is_the_index_math_alone():
    """``import cpshard`` loads no communication (the CLI's summary and figure are imported on use)."""
    import subprocess
    import sys
    code = ("import sys, cpshard; assert 'cpshard.distributed' not in sys.modules, sorted(sys.modules); "
            "assert callable(cpshard.describe_plan) and callable(cpshard.draw_plans); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    with pytest.raises(AttributeError, match="module 'cpshard' has no attribute 'nothing'"):
        cpshard.nothing  # noqa: B018


def test_a_dropped_plan_is_freed_at_once():
    """No reference cycle between a plan and its index service: dropping the last reference frees its
    indices at once, not when the cyclic collector next runs (inside some later step's timing)."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.disable()
    try:
        plan = ShardPlan.build([5, 3, 9], cp_size=2)
        shard(torch.arange(17), plan, 1, shift=1)
        unshard([shard(torch.arange(17), plan, r) for r in range(2)], plan)
        ref = weakref.ref(plan)
        del plan
        assert ref() is None
    finally:
        if enabled:
            gc.enable()


def test_layer_layouts_of_hybrid_configs():
    """Megatron-LM main's attention_cp_layout / linear_cp_layout decide each kind of layer; absent names
    take layout_for's choice; linear layers under zigzag are refused."""
    from types import SimpleNamespace

    from cpshard.layout import LayerLayouts, layer_layouts

    plain = layer_layouts(SimpleNamespace())
    assert plain == LayerLayouts(Layout.ZIGZAG, Layout.ZIGZAG) and not plain.hybrid
    dsv4 = layer_layouts(SimpleNamespace(experimental_attention_variant="dsv4_hybrid"))
    assert dsv4 == LayerLayouts(Layout.CONTIGUOUS, Layout.CONTIGUOUS)
    qwen = layer_layouts(SimpleNamespace(attention_cp_layout="zigzag", linear_cp_layout="contiguous"))
    assert qwen == LayerLayouts(Layout.ZIGZAG, Layout.CONTIGUOUS) and qwen.hybrid
    plan = ShardPlan.build([5, 3], cp_size=2, layout=qwen.attention)
    assert plan.twin(qwen.linear).layout is Layout.CONTIGUOUS
    with pytest.raises(ValueError, match="config.linear_cp_layout='zigzag'.*Fix: set linear_cp_layout='contiguous'"):
        layer_layouts(SimpleNamespace(linear_cp_layout="zigzag"))
    with pytest.raises(ValueError, match="config.attention_cp_layout='ring'"):
        layer_layouts(SimpleNamespace(attention_cp_layout="ring"))
