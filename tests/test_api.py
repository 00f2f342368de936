"""Behaviour of the public API beyond the reference comparisons: host syncs, autograd, layout choice, CLI."""

from __future__ import annotations

import types

import pytest
import torch

import cpshard
from cpshard import BshdPlan, Layout, ShardPlan, layout_for, register_layout_rule, shard, unshard
from cpshard.cli import main as cli_main


def _jagged(lens, trailing=()):
    values = torch.arange(sum(lens) * max(1, int(torch.tensor(trailing).prod()) if trailing else 1))
    values = values.view(sum(lens), *trailing)
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


class _CountToList:
    def __init__(self, monkeypatch):
        self.calls = 0
        original = torch.Tensor.tolist

        def counted(t):
            self.calls += 1
            return original(t)
        monkeypatch.setattr(torch.Tensor, "tolist", counted)


def test_one_host_copy_of_lengths_per_batch(monkeypatch):
    """Building the plan from the batch reads the lengths once; sharding it again reads nothing."""
    nt = _jagged([5, 0, 9, 3])
    counter = _CountToList(monkeypatch)
    plan = ShardPlan.build(nt, cp_size=2, tp_size=2)
    assert counter.calls == 1
    for r in range(2):
        for k in (0, 1, 2):
            shard(nt, plan, r, shift=k, fill=-1)
    parts = [shard(nt, plan, r) for r in range(2)]
    back = unshard(parts, plan)
    shard(back, plan, 0)  # unshard's output carries offsets the plan already knows
    assert counter.calls == 1
    assert plan.seqlens_py == (5, 0, 9, 3)


def test_nested_with_other_offsets_is_checked_once():
    plan = ShardPlan.build([2, 3], cp_size=2)
    good = _jagged([2, 3])
    shard(good, plan, 0)
    assert plan._offsets_known(good.offsets())
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
    a = plan._shard_index(0, 1, torch.device("cpu"))
    assert plan._shard_index(0, 1, torch.device("cpu")) is a
    assert plan._shard_index(0, 2, torch.device("cpu")) is not a


def test_plans_are_values():
    a = ShardPlan.build([5, 3], cp_size=2)
    b = ShardPlan.build(torch.tensor([5, 3]), cp_size=2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != ShardPlan.build([5, 3], cp_size=2, layout="contiguous")
    assert a != BshdPlan.build([5, 3], cp_size=2)
    with pytest.raises(AttributeError):
        a.cp_size = 4  # frozen


def test_layout_for_config():
    assert layout_for(types.SimpleNamespace(experimental_attention_variant="dsv4_hybrid")) is Layout.CONTIGUOUS
    assert layout_for(types.SimpleNamespace(experimental_attention_variant=None)) is Layout.ZIGZAG
    assert layout_for(object()) is Layout.ZIGZAG


def test_registered_layout_rule_wins(monkeypatch):
    monkeypatch.setattr(cpshard.layout, "_RULES", list(cpshard.layout._RULES))

    @register_layout_rule
    def ring_only(config):
        return "contiguous" if getattr(config, "name", "") == "my-kernel" else None

    assert layout_for(types.SimpleNamespace(name="my-kernel")) is Layout.CONTIGUOUS
    assert layout_for(types.SimpleNamespace(name="other")) is Layout.ZIGZAG


def test_cli_plan_prints_spec_picture(capsys):
    assert cli_main(["plan", "--lengths", "5,3", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 : s0p0 s0p1 | pad  pad  | s1p0 | pad" in out
    assert "rank 1 : s0p2 s0p3 | s0p4 pad  | s1p1 | s1p2" in out
    assert "padded_seqlens = [8, 4]" in out and "padding overhead = 50.0%" in out


def test_cli_plan_reports_bad_input(capsys):
    assert cli_main(["plan", "--lengths", "5,-3", "--cp", "2"]) == 2
    assert "seqlens[1]=-3" in capsys.readouterr().err


def test_cli_balance_zigzag_beats_contiguous(capsys):
    """The balance table shows why zigzag exists: causal work is spread evenly."""
    cli_main(["plan", "--lengths", "4096", "--cp", "4"])
    zigzag = capsys.readouterr().out
    cli_main(["plan", "--lengths", "4096", "--cp", "4", "--layout", "contiguous"])
    contiguous = capsys.readouterr().out

    def ratio(text):
        return float(text.split("causal work max/mean = ")[1].split()[0])
    assert ratio(zigzag) == 1.0 and ratio(contiguous) > 1.5
