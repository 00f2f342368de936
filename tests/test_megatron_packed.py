"""cpshard.megatron.packed against megatron-core's real PackedSeqParams (installed by scripts/setup.sh)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpshard import ShardPlan
from cpshard.megatron import (
    ParallelContext,
    import_megatron,
    install_cpu_stand_ins,
    megatron_version,
    packed_seq_params,
    packed_seq_params_with_layout,
    parallel_context,
    plan_for_mtp,
    plan_from_packed_seq_params,
    plan_from_parallel_state,
    supports_cp_partition_mode,
)
from strategies import props

try:
    _PSP_MODULE = import_megatron("packed_seq_params")
except ImportError as exc:  # scripts/setup.sh installs it; CI always runs these tests
    pytest.skip(f"megatron-core cannot be imported ({exc}); run scripts/setup.sh", allow_module_level=True)

PackedSeqParams = _PSP_MODULE.PackedSeqParams


@dataclasses.dataclass
class PackedSeqParamsWithMode(PackedSeqParams):
    """What a megatron-core with the CP partition mode looks like (Megatron-LM dev, verl's fork)."""

    cp_partition_mode: str = "zigzag"


@pytest.fixture
def with_mode(monkeypatch):
    monkeypatch.setattr(_PSP_MODULE, "PackedSeqParams", PackedSeqParamsWithMode)
    return PackedSeqParamsWithMode


def _build(data, layouts):
    cp = data.draw(st.integers(1, 5), "cp")
    tp = data.draw(st.integers(1, 4), "tp")
    layout = data.draw(st.sampled_from(layouts), "layout")
    lens = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=6), "lens")
    fp8 = data.draw(st.booleans(), "fp8")
    mlr = data.draw(st.none() | st.integers(0, 30), "min_local_rows")
    bucket = data.draw(st.none() | st.integers(1, 50), "length_bucket")
    return ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout, fp8=fp8, min_local_rows=mlr,
                           length_bucket=bucket)


def _check_fields(psp, plan):
    cu = plan.cu_seqlens_padded
    assert psp.qkv_format == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        value = getattr(psp, name)
        assert value.dtype == torch.int32 and torch.equal(value, cu), name
    assert psp.max_seqlen_q == psp.max_seqlen_kv == plan.max_seqlen


@props(60)
@given(st.data())
def test_zigzag_round_trip_with_the_installed_class(data):
    plan = _build(data, ["zigzag"])
    psp = packed_seq_params(plan)
    assert type(psp) is PackedSeqParams
    _check_fields(psp, plan)
    back = plan_from_packed_seq_params(psp, cp_size=plan.cp_size, tp_size=plan.tp_size, seqlens=plan.seqlens_py,
                                       fp8=plan.fp8)
    assert back == plan and back.padded_seqlens_py == plan.padded_seqlens_py
    # without seqlens the real lengths packed_seq_params remembered come back: the round trip is the plan
    assert plan_from_packed_seq_params(psp, cp_size=plan.cp_size, tp_size=plan.tp_size, fp8=plan.fp8) == plan
    # a PackedSeqParams built elsewhere with both fields padded (as verl fills them) says nothing of which rows
    # are padding: every padded row counts as a token
    verl_style = PackedSeqParams(qkv_format="thd", cu_seqlens_q=psp.cu_seqlens_q, cu_seqlens_kv=psp.cu_seqlens_kv,
                                 cu_seqlens_q_padded=psp.cu_seqlens_q_padded,
                                 cu_seqlens_kv_padded=psp.cu_seqlens_kv_padded, max_seqlen_q=psp.max_seqlen_q,
                                 max_seqlen_kv=psp.max_seqlen_kv)
    blind = plan_from_packed_seq_params(verl_style, cp_size=plan.cp_size, tp_size=plan.tp_size)
    assert blind.seqlens_py == blind.padded_seqlens_py == plan.padded_seqlens_py
    assert [blind.global_rows(r).tolist() for r in range(plan.cp_size)] == \
        [plan.global_rows(r).tolist() for r in range(plan.cp_size)]


@props(60)
@given(st.data())
def test_both_layouts_round_trip_where_the_field_exists(data):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_PSP_MODULE, "PackedSeqParams", PackedSeqParamsWithMode)
        plan = _build(data, ["zigzag", "contiguous"])
        psp = packed_seq_params(plan)
    assert isinstance(psp, PackedSeqParamsWithMode) and psp.cp_partition_mode == plan.layout.value
    _check_fields(psp, plan)
    # the layout comes from the field
    assert plan_from_packed_seq_params(psp, cp_size=plan.cp_size, tp_size=plan.tp_size,
                                       seqlens=plan.seqlens, fp8=plan.fp8) == plan


def test_installed_release_has_no_partition_mode_and_contiguous_is_refused():
    assert megatron_version() == "0.19.2"
    assert not supports_cp_partition_mode()
    plan = ShardPlan.build([5, 3], cp_size=2, layout="contiguous")
    with pytest.raises(ValueError, match=r"plan=a contiguous plan at cp_size=2: .*megatron-core 0\.19\.2's "
                                         r"PackedSeqParams has no such field.*Fix: install .*cp_partition_mode"):
        packed_seq_params(plan)
    # cp = 1: every layout is the identity, nothing to tell the kernels
    one = ShardPlan.build([5, 3], cp_size=1, layout="contiguous")
    _check_fields(packed_seq_params(one), one)


def test_partition_mode_detection(with_mode):
    assert supports_cp_partition_mode()
    assert supports_cp_partition_mode(PackedSeqParamsWithMode)
    assert not supports_cp_partition_mode(PackedSeqParams)

    class Duck:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    assert supports_cp_partition_mode(Duck)


def test_megatron_convention_real_and_padded_offsets():
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 5, 8], dtype=torch.int32),
                          cu_seqlens_q_padded=torch.tensor([0, 8, 12], dtype=torch.int32))
    plan = plan_from_packed_seq_params(psp, cp_size=2)
    assert plan == ShardPlan.build([5, 3], cp_size=2)
    # no padded field: cu_seqlens_q is both
    only_q = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8, 12], dtype=torch.int32))
    assert plan_from_packed_seq_params(only_q, cp_size=2).seqlens_py == (8, 4)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_real_lengths_beside_the_padded_offsets(layout, with_mode):
    """real_lengths=True: cu_seqlens_q/kv hold the tokens, the *_padded fields the rows, and
    pad_between_seqs says so (what TransformerEngine needs to skip pad rows); read back exactly."""
    plan = ShardPlan.build([5, 0, 3, 9], cp_size=2, tp_size=2, layout=layout, reorder=None)
    psp = packed_seq_params(plan, real_lengths=True)
    want_real = [0, 5, 5, 8, 17]
    assert psp.cu_seqlens_q.tolist() == want_real and psp.cu_seqlens_kv.tolist() == want_real
    assert psp.cu_seqlens_q_padded.tolist() == list(plan.cu_seqlens_padded_py)
    assert psp.cu_seqlens_kv_padded.tolist() == list(plan.cu_seqlens_padded_py)
    assert psp.cu_seqlens_q.dtype == torch.int32 and psp.pad_between_seqs is True
    assert psp.max_seqlen_q == plan.max_seqlen
    assert plan_from_packed_seq_params(psp, cp_size=2, tp_size=2) == plan
    assert packed_seq_params(plan).pad_between_seqs is None  # verl's form: every field padded
    on_device = packed_seq_params(plan, device="cpu", real_lengths=True)
    assert on_device.cu_seqlens_q.tolist() == want_real
    with pytest.raises(TypeError, match=r"real_lengths=1: must be a bool"):
        packed_seq_params(plan, real_lengths=1)


def test_padding_the_builder_does_not_produce_is_kept():
    # another framework padded the first sequence further; the rows stay exactly those
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q_padded=torch.tensor([0, 16, 20], dtype=torch.int32))
    plan = plan_from_packed_seq_params(psp, cp_size=2, seqlens=[5, 3])
    assert plan.padded_seqlens_py == (16, 4) and plan.seqlens_py == (5, 3)
    assert plan.global_rows(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 19]


def test_device_and_dynamic_cp_fields():
    plan = ShardPlan.build([5, 3], cp_size=2)
    sentinel = object()
    psp = packed_seq_params(plan, device="cpu", cp_group=sentinel, local_cp_size=2)
    assert psp.cp_group is sentinel and psp.local_cp_size == 2
    with pytest.raises(ValueError, match=r"local_cp_size=3: must equal the plan's cp_size \(2\)"):
        packed_seq_params(plan, local_cp_size=3)
    with pytest.raises(TypeError, match="must be a THD ShardPlan"):
        packed_seq_params("plan")


@pytest.mark.parametrize("kwargs, field, message", [
    (dict(cu_seqlens_q_padded=torch.tensor([0, 8, 7])), "psp.cu_seqlens_q_padded", "never decrease"),
    (dict(cu_seqlens_q_padded=torch.tensor([1, 8])), "psp.cu_seqlens_q_padded", "start at 0"),
    (dict(cu_seqlens_q_padded=torch.tensor([0.0, 8.0])), "psp.cu_seqlens_q_padded", "1-D integer"),
    (dict(cu_seqlens_q_padded=torch.tensor([0, 9])), "psp.cu_seqlens_q_padded", "split into cp_size=2"),
    (dict(cu_seqlens_q_padded=torch.tensor([0, 6, 12])), "psp.cu_seqlens_q_padded", "2 \\* cp_size = 4"),
    (dict(), "psp", "must carry cu_seqlens_q_padded"),
])
def test_bad_packed_seq_params_are_clear_errors(kwargs, field, message):
    psp = PackedSeqParams(qkv_format="thd", **kwargs)
    with pytest.raises(ValueError, match=f"^{field}=.*{message}.*Fix: "):
        plan_from_packed_seq_params(psp, cp_size=2)


def test_lengths_and_layout_must_fit(with_mode):
    psp = packed_seq_params(ShardPlan.build([5, 3], cp_size=2, layout="contiguous"))
    with pytest.raises(ValueError, match=r"layout='zigzag': contradicts psp.cp_partition_mode='contiguous'"):
        plan_from_packed_seq_params(psp, cp_size=2, layout="zigzag")
    with pytest.raises(ValueError, match=r"psp.cu_seqlens_q_padded\[0\]=6: must be >= the sequence length 9.*"
                                         r"Fix: .*the real token counts as seqlens"):
        plan_from_packed_seq_params(psp, cp_size=2, seqlens=[9, 3])


# -- parallel state -------------------------------------------------------------------------------

class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def test_parallel_context_prefers_what_is_given(monkeypatch):
    mpu = import_megatron("parallel_state")
    monkeypatch.setattr(mpu, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(mpu, "get_context_parallel_world_size", lambda: 4)
    monkeypatch.setattr(mpu, "get_context_parallel_rank", lambda: 3)
    monkeypatch.setattr(mpu, "get_context_parallel_group", lambda: "world-cp")
    assert parallel_context() == ParallelContext(2, 4, 3, "world-cp")
    assert parallel_context(tp_size=1, cp_size=2, cp_rank=0, need_group=False) == ParallelContext(1, 2, 0, None)
    pgs = types.SimpleNamespace(tp=_Group(4, 1), cp=_Group(3, 2))
    assert parallel_context(pg_collection=pgs) == ParallelContext(4, 3, 2, pgs.cp)
    group = _Group(5, 4)
    assert parallel_context(cp_group=group) == ParallelContext(2, 5, 4, group)
    with pytest.raises(ValueError, match=r"cp_size=3: contradicts local_cp_size=2"):
        parallel_context(cp_size=3, local_cp_size=2)
    with pytest.raises(TypeError, match=r"pg_collection.cp=NoneType: must be a process group"):
        parallel_context(pg_collection=types.SimpleNamespace(tp=_Group(1, 0), cp=None))


def test_dynamic_cp_groups_on_every_megatron(monkeypatch):
    """verl's dynamic CP: Megatron-LM dev's get_dynamic_data_context_parallel_groups, else main's and
    the releases' get_hybrid_data_context_parallel_groups; the rank read through
    torch.distributed.get_rank(group=) as verl reads it (here faked: torch does not know the group)."""
    mpu = import_megatron("parallel_state")
    monkeypatch.setattr(mpu, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1 if group == ("hybrid", 2) else -7)
    monkeypatch.delattr(mpu, "get_dynamic_data_context_parallel_groups", raising=False)
    monkeypatch.setattr(mpu, "get_hybrid_data_context_parallel_groups", lambda group_size: ("hybrid", group_size),
                        raising=False)
    assert parallel_context(local_cp_size=2) == ParallelContext(1, 2, 1, ("hybrid", 2))
    monkeypatch.setattr(mpu, "get_dynamic_data_context_parallel_groups", lambda group_size: ("dev", group_size),
                        raising=False)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0 if group == ("dev", 2) else -7)
    assert parallel_context(local_cp_size=2) == ParallelContext(1, 2, 0, ("dev", 2))
    monkeypatch.delattr(mpu, "get_dynamic_data_context_parallel_groups")
    monkeypatch.delattr(mpu, "get_hybrid_data_context_parallel_groups")
    with pytest.raises(ValueError, match=r"^local_cp_size=2: needs a dynamic context-parallel group.*neither "
                                         r"get_dynamic_data_context_parallel_groups nor get_hybrid"):
        parallel_context(local_cp_size=2)


def test_parallel_context_before_megatron_is_initialized():
    # Megatron answers cp = 0 before torch.distributed starts, and cannot answer tp at all
    with pytest.raises(ValueError, match=r"^get_tensor_model_parallel_world_size=.*AssertionError.*Fix: call "
                                         r"parallel_state.initialize_model_parallel"):
        parallel_context()
    assert parallel_context(tp_size=2) == ParallelContext(2, 1, 0, None)


def test_plan_from_parallel_state_takes_layout_and_fp8_from_the_config():
    pgs = types.SimpleNamespace(tp=_Group(2, 0), cp=_Group(2, 1))
    dsv4 = types.SimpleNamespace(experimental_attention_variant="dsv4_hybrid", fp8="e4m3")
    plan = plan_from_parallel_state([5, 3], config=dsv4, pg_collection=pgs, min_local_rows=64)
    assert plan == ShardPlan.build([5, 3], cp_size=2, tp_size=2, layout="contiguous", fp8=True, min_local_rows=64)
    plain = types.SimpleNamespace(fp8=None)
    assert plan_from_parallel_state([5, 3], config=plain, pg_collection=pgs) == \
        ShardPlan.build([5, 3], cp_size=2, tp_size=2)
    assert plan_from_parallel_state([5, 3], pg_collection=pgs, layout="contiguous").layout.value == "contiguous"


def test_offsets_must_be_whole_numbers():
    """``[0, 8.5, 12]`` was truncated to ``[0, 8, 12]`` before."""
    psp = types.SimpleNamespace(cu_seqlens_q=[0, 8.5, 12], cu_seqlens_q_padded=None)
    with pytest.raises(TypeError, match=r"^psp\.cu_seqlens_q\[1\]=8\.5: must be an integer offset\. Fix: "):
        plan_from_packed_seq_params(psp, cp_size=2)
    with pytest.raises(TypeError, match=r"^psp\.cu_seqlens_q=12: must be a 1-D integer tensor or a sequence"):
        plan_from_packed_seq_params(types.SimpleNamespace(cu_seqlens_q=12, cu_seqlens_q_padded=None), cp_size=2)
    whole = types.SimpleNamespace(cu_seqlens_q=[0, 8, 12], cu_seqlens_q_padded=None)
    assert plan_from_packed_seq_params(whole, cp_size=2) == ShardPlan.build([8, 4], cp_size=2)


# -- Megatron on a CPU box; 0.19.2's contiguous PackedSeqParams; what the round trip remembers ----------------


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


def test_install_cpu_stand_ins_lets_your_own_megatron_import_work_without_triton():
    alone = _fresh("import megatron.core")
    assert alone.returncode != 0 and "No module named 'triton'" in alone.stderr  # why the call exists
    proc = _fresh("import sys, cpshard.megatron as m\n"
                  "version = m.install_cpu_stand_ins(); assert m.install_cpu_stand_ins() == version\n"
                  "import megatron.core\n"
                  "from megatron.core.transformer.multi_token_prediction import roll_tensor\n"
                  "from megatron.core.packed_seq_params import PackedSeqParams\n"
                  "assert 'triton' not in sys.modules  # the stand-in is gone again\n"
                  "import importlib.util; assert importlib.util.find_spec('triton') is None\n"
                  "print(version)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == megatron_version() == "0.19.2"


def test_install_cpu_stand_ins_names_the_install_when_megatron_is_absent(monkeypatch):
    import cpshard.megatron._import as imp

    monkeypatch.setattr(imp, "megatron_version", lambda: None)
    with pytest.raises(ImportError, match=r"megatron-core is not installed.*pip install --no-deps"):
        install_cpu_stand_ins()


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_contiguous_packed_seq_params_on_the_installed_release(cp):
    """0.19.2's PackedSeqParams has no cp_partition_mode: packed_seq_params refuses a contiguous plan (its
    attention would take the rows as zigzag) and says what to use where the rows never reach it;
    packed_seq_params_with_layout records the layout on the instance, where cpshard's readers find it."""
    plan = ShardPlan.build([5, 3, 11], cp_size=cp, layout="contiguous")
    if cp > 1:
        with pytest.raises(ValueError, match=r"cpshard\.megatron\.packed_seq_params_with_layout\(plan\) sets the "
                                             r"layout on the instance"):
            packed_seq_params(plan)
    psp = packed_seq_params_with_layout(plan)
    assert type(psp) is PackedSeqParams and psp.cp_partition_mode == "contiguous"
    _check_fields(psp, plan)
    assert plan_from_packed_seq_params(psp, cp_size=cp) == plan
    assert plan_from_packed_seq_params(psp, cp_size=cp).layout.value == "contiguous"
    mtp = plan_for_mtp((1, plan.local_len), cp, psp)  # what process_mtp_loss shards by
    assert mtp.layout.value == "contiguous" and mtp.padded_seqlens_py == plan.padded_seqlens_py
    zigzag = ShardPlan.build([5, 3, 11], cp_size=cp)
    assert packed_seq_params_with_layout(zigzag).cp_partition_mode == "zigzag"


def test_with_layout_equals_packed_seq_params_where_the_field_exists(with_mode):
    for layout in ("zigzag", "contiguous"):
        plan = ShardPlan.build([5, 3], cp_size=2, layout=layout)
        a, b = packed_seq_params(plan), packed_seq_params_with_layout(plan)
        assert type(a) is type(b) is with_mode and a.cp_partition_mode == b.cp_partition_mode == layout
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("cu_seqlens_q", "cu_seqlens_q_padded"))


def test_with_layout_refuses_a_class_that_takes_no_attribute(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Frozen:  # a PackedSeqParams-like class without the field that takes no new attribute
        qkv_format: str | None = None
        cu_seqlens_q: torch.Tensor | None = None
        cu_seqlens_kv: torch.Tensor | None = None
        cu_seqlens_q_padded: torch.Tensor | None = None
        cu_seqlens_kv_padded: torch.Tensor | None = None
        max_seqlen_q: int | None = None
        max_seqlen_kv: int | None = None

    monkeypatch.setattr(_PSP_MODULE, "PackedSeqParams", Frozen)
    with pytest.raises(ValueError, match=r"plan=a contiguous plan: cannot be recorded on Frozen"):
        packed_seq_params_with_layout(ShardPlan.build([5, 3], cp_size=2, layout="contiguous"))


def test_remembered_lengths_only_while_the_offsets_are_the_ones_built():
    plan = ShardPlan.build([5, 3], cp_size=2)
    psp = packed_seq_params(plan)
    assert plan_from_packed_seq_params(psp, cp_size=2) == plan  # [5, 3], not the padded [8, 4]
    assert plan_from_packed_seq_params(psp, cp_size=2, seqlens=[6, 2]).seqlens_py == (6, 2)  # seqlens wins
    assert plan_from_packed_seq_params(dataclasses.replace(psp), cp_size=2).seqlens_py == (8, 4)  # a copy: not
    psp.cu_seqlens_q_padded = psp.cu_seqlens_kv_padded = torch.tensor([0, 4, 12], dtype=torch.int32)
    psp.cu_seqlens_q = psp.cu_seqlens_q_padded
    assert plan_from_packed_seq_params(psp, cp_size=2).seqlens_py == (4, 8)  # edited offsets: not either


def test_with_layout_takes_packed_seq_params_options_only():
    plan = ShardPlan.build([5, 3], cp_size=2, layout="contiguous")
    psp = packed_seq_params_with_layout(plan, real_lengths=True)
    # contiguous at cp=2 pads each sequence to a multiple of 2: 6 and 4 rows
    assert psp.cu_seqlens_q.tolist() == [0, 5, 8] and psp.cu_seqlens_q_padded.tolist() == [0, 6, 10]
    assert psp.pad_between_seqs is True
    with pytest.raises(TypeError, match=r"layout=given: is not an option of packed_seq_params"):
        packed_seq_params_with_layout(plan, layout="zigzag")
