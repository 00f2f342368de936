"""``cpshard.compat.hf`` in one process: the documents of a packed row from its position ids against the
naive reference, one rank's rows (R = U = 1) exactly, the ``"cpshard"`` attention's refusals, and a model
whose every kernel equals each document run alone. The ``R x U`` proofs run on gloo ranks
(tests/test_hf_distributed.py)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")

import cpshard.compat.hf as hf  # noqa: E402
from reference import ref_document_lengths, ref_two_axis_rows  # noqa: E402

LENGTHS = st.lists(st.integers(1, 9), min_size=1, max_size=6)
#: (layout, padding): zigzag's default "none" and its "minimal", contiguous's default "minimal" and its "none"
PLANS = st.sampled_from([("zigzag", "none"), ("zigzag", "minimal"), ("contiguous", "minimal"),
                         ("contiguous", "none")])


def _positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


@settings(max_examples=40, deadline=None)
@given(LENGTHS)
def test_document_lengths_are_the_runs_of_the_position_ids(lengths):
    pos = _positions(lengths)
    assert hf.document_lengths(pos) == ref_document_lengths(pos[0]) == lengths


@pytest.mark.parametrize(("pos", "rule"), [
    ([[1, 2, 3]], "at index 0"),
    ([[0, 1, 3]], "with 3 at index 2"),
    ([[0, 1, 1]], "with 1 at index 2"),
    ([[0, 1], [0, 1]], "must be one packed row"),
])
def test_position_ids_that_are_not_runs_are_refused(pos, rule):
    with pytest.raises(ValueError, match="position_ids=") as info:
        hf.document_lengths(torch.tensor(pos))
    assert rule in str(info.value)


def test_float_position_ids_are_refused():
    with pytest.raises(TypeError, match="position_ids=a torch.float32 tensor: must hold integers"):
        hf.document_lengths(torch.zeros(1, 3))


@settings(max_examples=20, deadline=None)
@given(LENGTHS, PLANS, st.integers(0, 2**16))
def test_one_rank_holds_the_whole_row_shifted_labels_included(lengths, plan, seed):
    layout, padding = plan
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (1, sum(lengths)), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.3] = -100
    batch = hf.SequenceParallel(layout=layout, padding=padding).shard(ids, _positions(lengths), labels)
    cut = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    docs = [slice(a, b) for a, b in zip(cut[:-1], cut[1:])]
    for got, x, shift, fill in ((batch.input_ids, ids, 0, 0), (batch.position_ids, _positions(lengths), 0, 0),
                                (batch.labels, labels, 1, -100)):
        want = ref_two_axis_rows([x[0, d] for d in docs], 1, 1, layout, 0, 0, shift=shift, fill=fill,
                                 padding=padding)
        assert torch.equal(got[0], want)
    assert torch.equal(batch.restore(batch.input_ids[..., None])[0, :, 0], ids[0])
    weights = torch.rand(1, sum(lengths), 2, generator=g)
    for shift in (0, 1, -2):
        want = ref_two_axis_rows([weights[0, d] for d in docs], 1, 1, layout, 0, 0, shift=shift, fill=7.0,
                                 padding=padding)
        assert torch.equal(batch.shard(weights, shift=shift, fill=7.0)[0], want)
    with pytest.raises(ValueError, match="x=tensor of shape"):
        batch.shard(weights[:, 1:])


@settings(max_examples=24, deadline=None)
@given(LENGTHS, st.integers(1, 3), st.sampled_from([1, 2, 4]), PLANS, st.booleans())
def test_shard_row_gives_every_rank_its_rows_without_groups(lengths, R, U, plan, default):
    """Every rank's ids, positions and shifted labels against the naive reference, both paddings; under
    ``"none"`` no document is padded and at most ``R * U - 1`` pad rows end the row. ``default``: the
    padding left out, the layout's default (zigzag ``"none"``, contiguous ``"minimal"``)."""
    layout, padding = plan
    if default:
        padding = "none" if layout == "zigzag" else "minimal"
    ids = torch.arange(100, 100 + sum(lengths))[None]
    pos = _positions(lengths)
    cut = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    docs = [ids[0, a:b] for a, b in zip(cut[:-1], cut[1:])]
    places = [d - d[0] for d in docs]
    for r in range(R):
        for u in range(U):
            batch = hf.shard_row(ids, pos, ids, ring_size=R, ulysses_size=U, ring_rank=r, ulysses_rank=u,
                                 layout=layout, **({} if default else {"padding": padding}))
            order = batch.plan.order
            assert batch.plan.padding.value == padding
            for got, seqs, shift, fill in ((batch.input_ids, docs, 0, 0), (batch.position_ids, places, 0, 0),
                                           (batch.labels, docs, 1, -100)):
                want = ref_two_axis_rows(seqs, R, U, layout, r, u, order=order, shift=shift, fill=fill,
                                         padding=padding)
                assert torch.equal(got[0], want), (got, want)
    if padding == "none":
        padded = list(batch.plan.input_padded_seqlens_py)
        assert padded[:-1] == lengths[:-1] and 0 <= padded[-1] - lengths[-1] < R * U
    with pytest.raises(ValueError, match="batch=a batch from shard_row"):
        batch.restore(batch.input_ids)
    with pytest.raises(ValueError, match="ring_rank=3: must be <= 2"):
        hf.shard_row(ids, pos, ring_size=3, ring_rank=3)


def test_a_batch_for_other_sizes_is_refused():
    sp = hf.SequenceParallel()
    batch = hf.shard_row(torch.arange(4)[None], _positions([4]), ring_size=2, ring_rank=1)
    with pytest.raises(ValueError, match=r"batch=a batch for R=2, U=1 at rank \(1, 0\): must be sharded for this "
                                         r"SequenceParallel's R=1, U=1"):
        sp.attend(batch)


def test_a_batch_of_another_padding_is_refused():
    sp = hf.SequenceParallel(padding="minimal")
    assert "padding='minimal'" in repr(sp) and hf.SequenceParallel().padding == "none"
    assert hf.SequenceParallel(layout="contiguous").padding == "minimal"
    batch = hf.shard_row(torch.arange(4)[None], _positions([4]), ring_size=1, ring_rank=0)
    with pytest.raises(ValueError, match=r"batch=a batch of layout='zigzag', padding='none': must be sharded with "
                                         r"this SequenceParallel's layout='zigzag', padding='minimal'"):
        sp.attend(batch)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="kernel='ring': must be one of"):
        hf.SequenceParallel(kernel="ring")
    with pytest.raises(ValueError, match=r"padding='aligned': must be one of \('none', 'minimal'\)"):
        hf.SequenceParallel(padding="aligned")
    with pytest.raises(ValueError, match="padding='ragged'"):
        hf.shard_row(torch.arange(4)[None], _positions([4]), ring_size=2, ring_rank=0, padding="ragged")
    with pytest.raises(ValueError, match="layout="):
        hf.SequenceParallel(layout="striped")
    sp = hf.SequenceParallel()
    with pytest.raises(ValueError, match="labels=4 labels: must match input_ids' 3 tokens"):
        sp.shard(torch.arange(3)[None], _positions([3]), torch.arange(4)[None])
    batch = sp.shard(torch.arange(3)[None], _positions([3]))
    with pytest.raises(ValueError, match="batch=a batch sharded without labels"):
        sp.loss(torch.zeros(1, 3, 5), batch)
    with pytest.raises(TypeError, match="batch=a dict: must be what sp.shard returned"):
        sp.attend({})


def _attend(**kwargs):
    sp = hf.SequenceParallel(kernel="sdpa")
    batch = sp.shard(torch.arange(4)[None], _positions([4]))
    q = torch.zeros(1, 2, 4, 8)
    with sp.attend(batch):
        return hf.attention_forward(torch.nn.Module(), q, q, q, kwargs.pop("attention_mask", None), **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"softcap": 30.0}, "softcap=30.0: a logit soft-cap"),
    ({"s_aux": torch.zeros(2)}, "s_aux=.*attention sinks"),
    ({"dropout": 0.1}, "dropout=0.1: attention dropout is not supported"),
    ({"attention_mask": torch.ones(1, 1, 4, 4, dtype=torch.bool)}, "attention_mask=a Tensor: must be None"),
    ({"output_attentions": True}, "output_attentions=True"),
    ({"sliding_window": 0}, "sliding_window=0: must be a window of >= 1 tokens"),
    ({"sliding_window": 2.5}, "sliding_window=2.5: must be a window of >= 1 tokens"),  # was taken as 2
])
def test_what_would_change_the_result_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _attend(**kwargs)


def test_the_attention_outside_attend_raises():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="runs only inside `with sp.attend"):
        hf.attention_forward(torch.nn.Module(), q, q, q, None)
    assert _attend()[0].shape == (1, 4, 2, 8)


def test_a_padding_mask_with_masked_tokens_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="cpshard")
    model = LlamaForCausalLM(config)
    sp = hf.SequenceParallel()
    batch = sp.shard(torch.arange(4)[None], _positions([4]))
    with sp.attend(batch), pytest.raises(ValueError, match="attention_mask=a padding mask"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids,
              attention_mask=torch.tensor([[1, 1, 1, 0]]))


def test_chunked_attention_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="cpshard")
    config.attention_chunk_size = 8
    model = LlamaForCausalLM(config)
    sp = hf.SequenceParallel()
    batch = sp.shard(torch.arange(4)[None], _positions([4]))
    with sp.attend(batch), pytest.raises(ValueError, match="attention_chunk_size=8: chunked attention"):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids)


@pytest.mark.parametrize("kernel", ["sdpa", "flex", "flash", "auto"])
def test_every_kernel_equals_each_document_alone(kernel, monkeypatch):
    """Qwen2 with a sliding-window layer (window 3) on documents of 1, 6 and 4 tokens, R = U = 1. ``"flash"``
    runs on flash-attn's documented semantics (tests/fake_flash_attn.py): the kernel itself is not run here."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if kernel == "flash":
        import fake_flash_attn

        monkeypatch.setitem(sys.modules, "flash_attn", None)
        fake_flash_attn.install()

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=3,
                         layer_types=["sliding_attention", "full_attention"], attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = Qwen2ForCausalLM(config).double()
    model = copy.deepcopy(ref)
    model.set_attn_implementation("cpshard")
    lengths = [1, 6, 4]
    ids = torch.randint(0, 32, (1, sum(lengths)))
    sp = hf.SequenceParallel(layout="zigzag", kernel=kernel)
    batch = sp.shard(ids, _positions(lengths), ids)
    with torch.no_grad(), sp.attend(batch):
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
    with torch.no_grad():
        want = torch.cat([ref(input_ids=d[None], position_ids=torch.arange(len(d))[None]).logits[0]
                          for d in ids[0].split(lengths)])
    assert torch.allclose(batch.restore(logits)[0], want, rtol=0, atol=1e-12)
    loss = sp.loss(logits, batch)
    targets = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in ids[0].split(lengths)])
    assert torch.allclose(loss, F.cross_entropy(want, targets, ignore_index=-100), rtol=1e-12)


def test_gradient_checkpointing_runs_its_backward_inside_attend():
    """The recomputed forward of gradient checkpointing needs the context: backward inside ``attend`` gives the
    gradients of a plain step; outside it, the clear error."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="cpshard")
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).double()
    saved = copy.deepcopy(plain)
    saved.gradient_checkpointing_enable()
    saved.train()
    plain.train()
    lengths = [3, 5]
    ids = torch.randint(0, 16, (1, 8), generator=torch.Generator().manual_seed(0))
    sp = hf.SequenceParallel()
    batch = sp.shard(ids, _positions(lengths), ids)
    with sp.attend(batch):
        sp.loss(plain(input_ids=batch.input_ids, position_ids=batch.position_ids).logits, batch).backward()
        sp.loss(saved(input_ids=batch.input_ids, position_ids=batch.position_ids).logits, batch).backward()
    for p, q in zip(plain.parameters(), saved.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15)
    with sp.attend(batch):
        loss = sp.loss(saved(input_ids=batch.input_ids, position_ids=batch.position_ids).logits, batch)
    with pytest.raises(RuntimeError, match="gradient checkpointing"):
        loss.backward()


def test_the_reference_tells_the_two_paddings_apart():
    """The check above must fail on the wrong padding: rank 1 of R = 2 under ``"none"`` (documents of 3 and 5
    tokens, chunks of 0/1 and 1/2 rows) is not its rows under ``"minimal"`` (documents padded to 4 and 8)."""
    lengths = [3, 5]
    ids = torch.arange(100, 108)[None]
    docs = list(ids[0].split(lengths))
    got = hf.shard_row(ids, _positions(lengths), ring_size=2, ring_rank=1).input_ids[0]
    assert torch.equal(got, ref_two_axis_rows(docs, 2, 1, "zigzag", 1, 0, padding="none"))
    assert not torch.equal(got, ref_two_axis_rows(docs, 2, 1, "zigzag", 1, 0, padding="minimal"))


def test_labels_that_are_not_classes_or_minus_100_are_refused_before_the_loss():
    """A label below 0 other than -100, or one at or past the vocabulary, is refused by name (no raw
    IndexError inside cross_entropy, which on R * U ranks left the peers waiting in the loss's all-reduce);
    labels of any integer dtype are taken as int64."""
    sp = hf.SequenceParallel()
    ids, pos = torch.arange(4)[None], _positions([2, 2])
    with pytest.raises(ValueError, match=r"labels=.*-1 at index 1.*must be -100 \(ignored\) or a class"):
        sp.shard(ids, pos, torch.tensor([[3, -1, 2, 0]]))
    batch = sp.shard(ids, pos, torch.tensor([[3, 1, 7, 0]]))
    with pytest.raises(ValueError, match=r"logits=.*vocabulary of 5.*label 7"):
        sp.loss(torch.zeros(1, 4, 5, dtype=torch.float64), batch)
    with pytest.raises(TypeError, match=r"logits=a torch.int64 tensor: must be floating"):
        sp.loss(torch.zeros(1, 4, 8, dtype=torch.int64), batch)
    logits = torch.randn(1, 4, 8, dtype=torch.float64)
    want = sp.loss(logits, batch)
    for dtype in (torch.int32, torch.uint8, torch.int16):
        other = sp.shard(ids, pos, torch.tensor([[3, 1, 7, 0]], dtype=dtype))
        assert other.labels.dtype == torch.int64
        assert torch.equal(sp.loss(logits, other), want)


def test_key_and_value_of_another_dtype_are_refused_by_name():
    sp = hf.SequenceParallel(kernel="sdpa")
    batch = sp.shard(torch.arange(4)[None], _positions([4]))
    q = torch.zeros(1, 2, 4, 8, dtype=torch.float64)
    with sp.attend(batch), pytest.raises(TypeError, match="key=query torch.float64, key torch.float32"):
        hf.attention_forward(torch.nn.Module(), q, q.float(), q.float(), None)


def test_narrow_integer_dtypes_never_wrap_positions():
    """Positions are read and handed out as int64: int8 ids no longer wrap the positions past 127 (RoPE read
    41 for the token at 297), and int8 position ids that wrapped (127, -128, ...) are refused, not read as
    one run (NumPy's int8 diff wrapped -255 to 1)."""
    sp = hf.SequenceParallel()
    batch = sp.shard(torch.zeros(1, 300, dtype=torch.int8), torch.arange(300)[None])
    assert batch.position_ids.dtype == torch.int64
    assert torch.equal(batch.position_ids, torch.arange(300)[None])
    with pytest.raises(ValueError, match="position_ids=a row with -128 at index 128"):
        sp.shard(torch.arange(300)[None], torch.arange(300)[None].to(torch.int8))


def test_a_model_run_without_the_batch_position_ids_is_refused():
    """transformers makes ``arange(L / U)`` positions when none are passed: every rank's rows would then read
    RoPE positions of another part of the row (silently wrong under R * U > 1). The attention compares the
    position ids the model hands it with the batch's, once per tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, attn_implementation="cpshard")
    model = LlamaForCausalLM(config)
    sp = hf.SequenceParallel(kernel="sdpa")
    batch = sp.shard(torch.arange(6)[None], _positions([3, 3]))
    with sp.attend(batch), pytest.raises(ValueError, match=r"position_ids=.*must be the batch's position ids"):
        model(input_ids=batch.input_ids)
    with sp.attend(batch):
        model(input_ids=batch.input_ids, position_ids=batch.position_ids.clone())
