"""Valid and near-valid input that once crashed or gave an unclear error (an adversarial list).

Each case either works exactly as its ordinary counterpart does or raises the project's error,
naming the argument, the rule and the fix.
"""

from __future__ import annotations

import math
import re
import threading

import pytest
import torch

import cpshard
from cpshard import BshdPlan, ShardPlan, from_padded, shard, to_padded, unshard
from cpshard.cli import main as cli_main
from reference import ref_shard


def _nested(lens, dtype=torch.int64):
    values = torch.arange(sum(lens)).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


# -- inference mode (log-prob and value passes run there) ------------------------------------


def test_everything_works_under_inference_mode():
    lens = [5, 0, 9, 3]
    nt = _nested(lens)
    with torch.no_grad():
        plan, values = ShardPlan.from_nested(nt, cp_size=2, tp_size=2)
        want_parts = [shard(nt, plan, r, shift=1, fill=-1) for r in range(2)]
        want = unshard([shard(values, plan, r) for r in range(2)], plan)
        want_shift = cpshard.shift(nt, plan, 2, fill=-1)
    with torch.inference_mode():
        nt_inf = _nested(lens)
        plan_inf = ShardPlan.build(nt_inf, cp_size=2, tp_size=2)
        plan_inf2, values_inf = ShardPlan.from_nested(nt_inf, cp_size=2, tp_size=2)
        parts = [shard(nt_inf, plan_inf, r, shift=1, fill=-1) for r in range(2)]
        back = unshard([shard(values_inf, plan_inf2, r) for r in range(2)], plan_inf2)
        shifted = cpshard.shift(nt_inf, plan_inf, 2, fill=-1)
        again = shard(back, plan_inf, 0)  # a nested tensor made in inference mode, sharded again
    assert plan_inf == plan == plan_inf2
    assert all(torch.equal(a, b) for a, b in zip(parts, want_parts))
    assert torch.equal(back.values(), want.values()) and torch.equal(shifted.values(), want_shift.values())
    assert torch.equal(again, shard(values, plan, 0))


# -- a plan is an immutable value: safe to share between threads ------------------------------


def test_a_plan_shared_by_threads():
    lens = [37, 5, 120, 1, 64, 0, 9]
    x = torch.arange(sum(lens))
    fresh = ShardPlan.build(lens, cp_size=4, tp_size=2)
    want = {(r, k): shard(x, fresh, r, shift=k, fill=-1) for r in range(4) for k in range(4)}
    plan = ShardPlan.build(lens, cp_size=4, tp_size=2)  # a cold cache, filled by the threads at once
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def work(t: int) -> None:
        try:
            barrier.wait()
            for i in range(40):
                r, k = (t + i) % 4, (t * i) % 4
                assert torch.equal(shard(x, plan, r, shift=k, fill=-1), want[r, k])
                assert torch.equal(unshard([shard(x, plan, q) for q in range(4)], plan).values(), x)
                assert torch.equal(plan.label_mask(r, k), fresh.label_mask(r, k))
                cpshard.shift_exchange(plan, r, k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# -- lengths and hand-built plans ------------------------------------------------------------


@pytest.mark.parametrize("bad", [torch.tensor(5.7), torch.tensor(True), torch.tensor([5])])
def test_zero_dim_float_or_bool_lengths_are_refused(bad):
    with pytest.raises(TypeError, match=r"seqlens\[1\]=tensor of shape .* must be a whole number"):
        ShardPlan.build([torch.tensor(3), bad], cp_size=2)
    assert ShardPlan.build([torch.tensor(3), torch.tensor(5)], cp_size=2) == ShardPlan.build([3, 5], cp_size=2)


@pytest.mark.parametrize(("field", "kwargs"), [
    ("seqlens_py[0]", dict(seqlens_py=(5.0, 3), padded_seqlens_py=(8, 4))),
    ("seqlens_py[1]", dict(seqlens_py=(5, True), padded_seqlens_py=(8, 4))),
    ("padded_seqlens_py[0]", dict(seqlens_py=(5, 3), padded_seqlens_py=(8.0, 4))),
    ("alignment", dict(seqlens_py=(5, 3), padded_seqlens_py=(8, 4), alignment=4.0)),
    ("cp_size", dict(seqlens_py=(5, 3), padded_seqlens_py=(8, 4), cp_size=2.0)),
])
def test_hand_built_plans_refuse_non_integers(field, kwargs):
    kwargs.setdefault("cp_size", 2)
    with pytest.raises(TypeError, match=rf"{field.replace('[', '.').replace(']', '.')}=.*must be an integer"):
        ShardPlan(**kwargs)


def test_alignment_is_derived_and_part_of_the_value():
    built = ShardPlan.build([5, 3], cp_size=2)
    assert ShardPlan((5, 3), (8, 4), 2) == built and ShardPlan((5, 3), (8, 4), 2).alignment == 4
    assert ShardPlan((5, 3), (8, 4), 2, alignment=2) != built  # a different value, though the rows agree
    assert ShardPlan.build([5, 3], cp_size=2, fp8=True).fp8 and ShardPlan.build([5, 3], cp_size=2, fp8=True) != built
    assert hash(ShardPlan((5, 3), (8, 4), 2)) == hash(built)
    with pytest.raises(ValueError, match="with fp8 the total"):
        ShardPlan((5, 3), (16, 16), 2, fp8=True)


def test_bshd_lengths_past_int32():
    with pytest.raises(ValueError, match=r"fewer than 2\*\*31 padded positions"):
        BshdPlan.build([2**31], cp_size=1)
    with pytest.raises(ValueError, match=r"fewer than 2\*\*31 padded positions"):
        BshdPlan.build([2**30, 5, 5], cp_size=1)


# -- dtypes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_rows_move_like_any_other(dtype):
    plan = ShardPlan.build([5, 3], cp_size=2)
    top = torch.iinfo(dtype).max
    x = torch.tensor([0, 1, 2, 3, top, 10, 11, 12], dtype=torch.int64 if dtype != torch.uint64 else dtype)
    x = x.to(dtype)
    out = shard(x, plan, 1, shift=1, fill=top, pad_value=7)
    assert out.dtype == dtype and out.tolist() == [3, top, top, 7, 12, top]
    back = unshard([shard(x, plan, r) for r in range(2)], plan)
    assert back.values().dtype == dtype and back.values().tolist() == x.tolist()
    assert cpshard.shift(x, plan, 1).tolist() == [1, 2, 3, top, 0, 11, 12, 0]
    with pytest.raises(ValueError, match="outside the range"):
        shard(x, plan, 0, shift=1, fill=-100)


@pytest.mark.parametrize("dtype,trailing", [(torch.float32, ()), (torch.bfloat16, (2,)), (torch.float64, (1,)),
                                             (torch.float16, (2, 2)), (torch.int8, (4,)), (torch.bool, ()),
                                             (torch.float32, (3,)), (torch.bfloat16, ()), (torch.complex64, ())])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("contiguous_input", [True, False])
def test_rows_move_bit_for_bit(dtype, trailing, layout, contiguous_input):
    # Rows of 1, 2, 4 or 8 bytes are gathered as one integer each (ops.as_packed): NaN payloads,
    # signalling NaNs and -0.0 must come through unchanged, from an input that starts mid-storage
    # (a shifted view) or is not contiguous (the unpacked path), for every shift.
    lens = [5, 3, 9, 1, 6]
    n, width = sum(lens), dtype.itemsize * math.prod(trailing)
    g = torch.Generator().manual_seed(7)
    raw = torch.randint(-128, 128, ((n + 1) * width,), generator=g, dtype=torch.int8)
    if dtype == torch.bool:
        raw &= 1
    if dtype == torch.float32:
        raw.view(torch.int32)[:4] = torch.tensor([0x7FA00001, 0x7FC12345, -(2**31), 0xFF800001 - 2**32])
    whole = raw.view(dtype).view(n + 1, *trailing)
    x = whole[1:]  # a storage offset of one row
    if not contiguous_input:
        x = torch.stack([x, x], -1)[..., 0]
        assert not x.is_contiguous()
    byte_rows = x.contiguous().view(torch.int8).view(n, width)
    seqs = list(byte_rows.split(lens))
    for cp, tp in ((2, 1), (3, 2)):
        plan = ShardPlan.build(lens, cp_size=cp, tp_size=tp, layout=layout)
        for r in range(cp):
            for k in (0, 1, 2):
                got = shard(x, plan, r, shift=k, pad_value=0, fill=0)
                want = ref_shard(seqs, lens, cp, tp, layout, r, shift=k, pad_value=0, fill=0)
                assert got.dtype == dtype and got.shape == (plan.local_len, *trailing)
                assert torch.equal(got.contiguous().view(torch.int8).view(plan.local_len, width), want), (cp, r, k)
        back = unshard([shard(x, plan, r) for r in range(cp)], plan).values()
        assert torch.equal(back.contiguous().view(torch.int8).view(n, width), byte_rows)


def test_to_padded_checks_pad_value_and_moves_fp8():
    nt = _nested([5, 3], torch.uint8)
    with pytest.raises(ValueError, match=r"pad_value=-100: is outside the range of torch.uint8"):
        to_padded(nt, pad_value=-100)
    f8 = torch.nested.nested_tensor_from_jagged((torch.arange(8.0) / 4).to(torch.float8_e4m3fn),
                                                offsets=torch.tensor([0, 5, 8]))
    x, mask = to_padded(f8, pad_value=-2.0)
    assert x.dtype == torch.float8_e4m3fn
    assert x.float().tolist() == [[0.0, 0.25, 0.5, 0.75, 1.0], [1.25, 1.5, 1.75, -2.0, -2.0]]
    assert torch.equal(from_padded(x, mask).values().view(torch.uint8), f8.values().view(torch.uint8))


# -- the project's errors instead of bare ones ------------------------------------------------


@pytest.mark.parametrize("rows", [7, 9])
def test_nested_values_that_disagree_with_their_offsets(rows):
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(rows), offsets=torch.tensor([0, 5, 8]))
    with pytest.raises(ValueError, match=f"{rows} value rows and offsets ending at 8"):
        ShardPlan.build(nt, cp_size=2)
    with pytest.raises(ValueError, match=f"{rows} value rows and offsets ending at 8"):
        shard(nt, ShardPlan.build([5, 3], cp_size=2), 0)


def test_to_padded_offsets_not_starting_at_zero():
    nt = torch.nested.nested_tensor_from_jagged(torch.arange(10), offsets=torch.tensor([2, 7, 10]))
    with pytest.raises(ValueError, match=r"offsets \[2, ..., 10\] over 10 value rows: its offsets must start at 0"):
        to_padded(nt)


def test_empty_from_padded():
    with pytest.raises(ValueError, match=r"attention_mask=shape \(0, 4\): must hold at least one row"):
        from_padded(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool))


@pytest.mark.parametrize(("kwargs", "kind", "message"), [
    (dict(fill=10**400), ValueError, "fill=.*too large for any floating dtype"),
    (dict(pad_value=-(10**400)), ValueError, "pad_value=.*too large for any floating dtype"),
    (dict(shift=2**70), ValueError, r"shift=1180591620717411303424: must be <= 2147483647"),
    (dict(fill=2**63), ValueError, None),  # float rows take it, rounded as float32 rounds
])
def test_values_beyond_every_range(kwargs, kind, message):
    plan = ShardPlan.build([5, 3], cp_size=2)
    x = torch.zeros(8)
    if message is None:
        assert shard(x, plan, 1, shift=1, **kwargs)[2] == float(2**63)
        return
    with pytest.raises(kind, match=message):
        shard(x, plan, 1, shift=1, **kwargs) if "shift" not in kwargs else shard(x, plan, 1, **kwargs)
    with pytest.raises(ValueError, match="outside the range of torch.int64"):
        shard(torch.zeros(8, dtype=torch.int64), plan, 1, shift=1, fill=2**63)


def test_padded_batch_given_to_a_thd_plan_says_what_to_do():
    plan = ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(ValueError, match=r"cpshard.from_padded\(x, attention_mask\)"):
        shard(torch.zeros(2, 5), plan, 0)


# -- the CLI ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["--bshd", "--min-local-rows", "4"], "--min-local-rows does not apply with --bshd"),
    (["--bshd", "--length-bucket", "4"], "--length-bucket does not apply with --bshd"),
    (["--bshd", "--no-picture"], "--picture/--no-picture does not apply with --bshd"),
    (["--max-seqlen", "8"], "--max-seqlen does not apply without --bshd"),
])
def test_cli_refuses_flags_that_do_not_apply(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["plan", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_cli_output_stays_small_for_large_batches(capsys):
    lengths = ",".join(["300"] * 2000)
    assert cli_main(["plan", "--lengths", lengths, "--cp", "4"]) == 0
    out = capsys.readouterr().out
    assert len(out) < 4000 and "(2000 values)" in out and "(2001 values)" in out
    assert cli_main(["plan", "--bshd", "--lengths", "100000,5", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert len(out) < 2000 and "(50000 values)" in out


def test_cli_no_picture_gives_the_true_reason(capsys):
    assert cli_main(["plan", "--lengths", "5,3", "--no-picture"]) == 0
    out = capsys.readouterr().out
    assert "(picture omitted: --no-picture)" in out and "rows >" not in out


def test_cli_plans_minimal_padding_and_balanced_order(capsys):
    assert cli_main(["plan", "--lengths", "300,20,900,5,600", "--cp", "4", "--layout", "contiguous", "--reorder",
                     "--padding", "minimal", "--no-picture"]) == 0
    out = capsys.readouterr().out
    plan = ShardPlan.build([300, 20, 900, 5, 600], cp_size=4, layout="contiguous", padding="minimal",
                           reorder="balanced")
    assert f"order = {list(plan.order)}" in out and "padding='minimal', reordered" in out
    with pytest.raises(SystemExit):
        cli_main(["plan", "--reorder"])
    assert "--reorder balances the contiguous layout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["plan", "--bshd", "--padding", "minimal"])
    assert "--padding does not apply with --bshd" in capsys.readouterr().err


# -- inputs that once gave a silent wrong result or a crash -------------------------------------------

@pytest.mark.parametrize("stride", [2**31 - 8, 2**31, 2**32, 2**32 + 3])
def test_bshd_index_never_wraps_past_int32(stride):
    """A padded (B, S) input wider than the plan: row b starts at b * S, which passes 2**31 when the
    input is wide enough; the index must hold it (it wrapped in int32: rank 1's second row read the
    first row's data). Checked on the row stride alone, without allocating the input."""
    plan = BshdPlan.build([5, 3], cp_size=2)
    for rank in range(2):
        index = plan.indices().shard(rank, 0, torch.device("cpu"), stride)
        cols = plan.columns(rank).tolist()
        want = [b * stride + c for b in range(plan.num_seqs) for c in cols]
        token = plan.token_mask(rank).reshape(-1)
        assert index.source[token].tolist() == [w for w, t in zip(want, token.tolist()) if t]


@pytest.mark.parametrize("make, what", [
    (lambda n: torch.quantize_per_tensor(torch.randn(n), 0.1, 0, torch.qint8), "quantized tensor"),
    (lambda n: torch.randn(n, 2).to_sparse(), "layout torch.sparse_coo"),
])
def test_quantized_and_sparse_rows_are_refused(make, what):
    """A quantized tensor crashed the process inside index_select; a sparse one has no rows to move."""
    plan = ShardPlan.build([5, 3], cp_size=2)
    with pytest.raises(TypeError, match=rf"^x=.*{what}.*Fix: "):
        shard(make(8), plan, 0)
    with pytest.raises(TypeError, match=rf"^x\[1\]=.*{what}"):
        shard([torch.randn(5), make(3)], plan, 0)
    with pytest.raises(TypeError, match=rf"^parts\[0\]=.*{what}"):
        unshard([make(6), torch.zeros(6)], plan)


@pytest.mark.parametrize("cp, tp", [(2**62, 1), (2**40, 1), (2**20, 2**12), (10**20, 1)])
def test_parallel_sizes_past_int32_name_the_size(cp, tp):
    """cp_size * tp_size >= 2**31 cannot be planned: a clear error naming cp_size (it was NumPy's
    OverflowError, or a message about seqlens)."""
    for build in (ShardPlan.build, BshdPlan.build):
        with pytest.raises(ValueError, match=rf"^cp_size={cp}: with tp_size={tp} every padded batch has at least "
                                             r"cp_size \* tp_size rows, which must stay below 2\*\*31"):
            build([5, 3], cp_size=cp, tp_size=tp)


@pytest.mark.parametrize("dtype, value, ok", [
    (torch.float16, -1e9, False), (torch.float8_e4m3fn, -1000.0, False), (torch.float8_e5m2, 1e6, False),
    (torch.complex64, complex(0, 1e300), False), (torch.bfloat16, -1e9, True), (torch.float16, -65504.0, True),
    (torch.float16, float("-inf"), True), (torch.float32, -1e30, True),
])
def test_floating_fill_within_the_dtypes_range(dtype, value, ok):
    """One rule for every floating dtype: a finite fill or pad value must lie inside the dtype's
    finite range (float16 raised inside torch; fp8 saturated silently); inside it, it is rounded
    as the dtype rounds."""
    plan = ShardPlan.build([5, 3], cp_size=2)
    x = torch.zeros(8, dtype=dtype)
    if not ok:
        with pytest.raises(ValueError, match=rf"^fill={re.escape(repr(value))}: is outside the finite range of rows "):
            shard(x, plan, 0, shift=1, fill=value)
        with pytest.raises(ValueError, match=r"^pad_value=.*outside the finite range"):
            shard(x, plan, 0, pad_value=value)
        return
    got = shard(x, plan, 0, shift=1, fill=value)
    filled = got[~plan.label_mask(0, shift=1)]  # the last tokens and the pad rows
    want = torch.tensor([value], dtype=torch.float64).to(dtype).expand(filled.shape[0]).contiguous()
    assert torch.equal(filled.view(torch.uint8), want.view(torch.uint8))  # rounded as the dtype rounds


@pytest.mark.parametrize("call, message", [
    (lambda: ShardPlan.build([5, 3], cp_size=torch.tensor(2.0)),
     r"^cp_size=torch\.float32 tensor 2\.0: must be an integer"),
    (lambda: ShardPlan.build([5, 3], cp_size=2, tp_size=torch.tensor(True)), r"^tp_size=torch\.bool tensor True: must"),
    (lambda: ShardPlan.build([5, 3], cp_size=torch.tensor([2, 2])),
     r"^cp_size=tensor of shape \(2,\): must be one int"),
    (lambda: shard(torch.arange(8), ShardPlan.build([5, 3], cp_size=2), torch.tensor(1.0)),
     r"^cp_rank=torch\.float32 tensor 1\.0: must be an integer"),
    (lambda: ShardPlan(None, (8, 4), 2), r"^seqlens_py=None: must be a sequence of non-negative ints"),
    (lambda: shard(torch.zeros(8, dtype=torch.bits8), ShardPlan.build([5, 3], cp_size=2), 0),
     r"^x=tensor of dtype torch\.bits8: holds bits, not numbers.*Fix: pass x\.view\(torch\.uint8\)"),
])
def test_unclear_inputs_get_clear_type_errors(call, message):
    """0-d float and bool tensors as sizes and ranks, a plan of None, bits dtypes: each was a
    message from inside torch or Python; each names the argument now."""
    with pytest.raises(TypeError, match=message):
        call()
    assert ShardPlan.build([5, 3], cp_size=torch.tensor(2)).cp_size == 2  # an integer tensor is an integer
