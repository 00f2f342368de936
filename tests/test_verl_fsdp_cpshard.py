"""verl 0.9.1's own FSDP engine under ``cpshard.compat.verl.patch()``, on gloo, on the CPU: plain Ulysses
(``CPSHARD_RING`` 1) and a ring axis (``CPSHARD_RING`` 2 and 4) equal one process.

tests/verl_fsdp_engine.py builds the engine as verl's ``TrainingWorker`` does (attention ``sdpa``, fp32, a
tiny random Qwen2 of 4 query and 2 key/value heads, verl's default gradient checkpointing). One gloo group of
four ranks builds it at Ulysses degree ``sp = 1`` (four data-parallel ranks given the same micro-batch) and
then, each inside ``patch(layout=..., ring=R)``, at every ``(sp, R)`` of :data:`CONFIGS`, and runs
``infer_batch`` and one ``forward_backward_batch`` on packed documents of 5, 11 and 7 tokens. Without cpshard
verl is wrong at ``sp = 2`` here (tests/test_verl_fsdp_engine.py); with it every log-prob, entropy, gradient
and the grad norm equal ``sp = 1``'s to float32 rounding, on every rank, for both layouts. A second model of 2
query heads runs at ``sp = 4`` as 2 ring x 2 Ulysses ranks: more SP ranks than heads, which verl refuses
(``num_attention_heads % sp``). The errors: a ring size that does not divide ``sp``, and a Ulysses axis that
does not divide the heads, raise on every rank when the engine is built, naming ``CPSHARD_RING``; verl's
padded path (``use_remove_padding=False``) raises on every rank at the micro-batch.

The whole grid runs here, in CI (about a minute on two cores); nothing is left to run by hand.
"""

from __future__ import annotations

import pytest
import torch

import verl_fsdp_engine as E

E.skip_without_verl()
from cpshard.spawn import run_ranks  # noqa: E402 - after the skip

LENGTHS = E.LENGTHS
#: (sp, ring size, layout) under patch(): every (R, U) of sp 2 and 4, both layouts where R > 1
CONFIGS = [(2, 1, "zigzag"), (2, 2, "zigzag"), (2, 2, "contiguous"), (4, 1, "zigzag"), (4, 2, "zigzag"),
           (4, 2, "contiguous"), (4, 4, "zigzag"), (4, 4, "contiguous")]
PAST_HEADS = (4, 2, "zigzag")  # the 2-head model: sp 4 as 2 ring x 2 Ulysses ranks


def _error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _all_configs(rank, world, path, narrow):
    """verl's engine at sp 1, then under patch() at every configuration (rank bodies run in fresh processes:
    verl's platform is chosen before its engine module is imported)."""
    import sys

    import verl_fsdp_engine as E
    from cpshard.compat import verl as cv

    E.install_cpu_platform()
    from verl.utils import tensordict_utils as tu

    out = {"sp 1": E.step(E.build(path, sp=1), LENGTHS, E.weights())}
    for sp, ring, layout in CONFIGS:
        with cv.patch(layout=layout, ring=ring) as p:
            out[(sp, ring, layout)] = E.step(E.build(path, sp=sp), LENGTHS, E.weights())
            out[(sp, ring, layout)]["ring"] = p.ring
            out["verl"] = f"{p.verl_version} ({sys.modules['verl'].__file__})"
    with cv.patch(layout="zigzag", ring=2):  # the configurations above recompute each layer in the backward
        out["no checkpointing"] = E.step(E.build(path, sp=4, checkpointing=False), LENGTHS, E.weights())
    out["narrow sp 1"] = E.step(E.build(narrow, sp=1), LENGTHS, E.weights())
    sp, ring, layout = PAST_HEADS
    with cv.patch(layout=layout, ring=ring):
        out["narrow"] = E.step(E.build(narrow, sp=sp), LENGTHS, E.weights())
    with cv.patch(ring=4):  # 4 does not divide sp 2
        out["ring misfit"] = _error(lambda: E.build(path, sp=2))
    with cv.patch(ring=1):  # the 2-head model at sp 4 as 4 Ulysses ranks
        out["heads misfit"] = _error(lambda: E.build(narrow, sp=4))
    with cv.patch(ring=1):  # verl's padded path: the attention could not see the documents
        engine = E.build(path, sp=2)
        data = E.batch(LENGTHS)
        tu.assign_non_tensor(data, use_remove_padding=False)
        with engine.eval_mode():
            out["padded"] = _error(lambda: engine.infer_batch(data))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = E.save_tiny_qwen2(str(tmp_path_factory.mktemp("qwen2")))
    narrow = E.save_tiny_qwen2(str(tmp_path_factory.mktemp("qwen2_2heads")), heads=2, kv_heads=1)
    return run_ranks(_all_configs, 4, path, narrow, timeout=600, collective_timeout=300)


def _close(got, want):
    assert set(got["grads"]) == set(want["grads"])
    for key in ("log_probs", "entropy", "grads"):
        assert E.gap(got[key], want[key]) < 1e-5, key
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"sp{c[0]}-ring{c[1]}-{c[2]}")
def test_engine_under_the_patch_equals_sp1(runs, config):
    """Every log-prob, entropy, gradient and the grad norm at (sp, R, layout) equal sp 1's to float32 rounding."""
    for r in runs:
        assert r[config]["ring"] == config[1]
        _close(r[config], r["sp 1"])


def test_with_and_without_gradient_checkpointing(runs):
    """verl's default, ``enable_gradient_checkpointing``, runs every configuration above: the backward's
    recomputation of the attention finds the micro-batch's plan (held until the next micro-batch or the end
    of ``forward_backward_batch``). Without it, at sp 4 as 2 ring x 2 Ulysses ranks, the same numbers."""
    for r in runs:
        _close(r["no checkpointing"], r["sp 1"])


def test_more_sp_ranks_than_heads_with_a_ring_axis(runs):
    """A 2-head model at sp 4 (2 ring x 2 Ulysses ranks) equals sp 1: verl alone refuses sp > heads."""
    for r in runs:
        _close(r["narrow"], r["narrow sp 1"])


def test_a_ring_size_that_does_not_fit_raises_on_every_rank(runs):
    for r in runs:
        assert "CPSHARD_RING" in r["ring misfit"] and "ulysses_sequence_parallel_size 2" in r["ring misfit"]
        assert "CPSHARD_RING" in r["heads misfit"] and "num_attention_heads 2" in r["heads misfit"]


def test_verls_padded_path_is_refused_on_every_rank(runs):
    for r in runs:
        assert r["padded"].startswith("use_remove_padding=False: is not supported under cpshard's sequence")


if __name__ == "__main__":  # the table docs/verl.md records: python tests/test_verl_fsdp_cpshard.py
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = E.save_tiny_qwen2(f"{tmp}/a")
        narrow = E.save_tiny_qwen2(f"{tmp}/b", heads=2, kv_heads=1)
        ref = E.hf_reference(path, LENGTHS, E.weights())
        ranks = run_ranks(_all_configs, 4, path, narrow, timeout=600, collective_timeout=300)
    print("verl", ranks[0]["verl"])
    for config in ["sp 1", *CONFIGS]:
        got = [r[config] for r in ranks]
        print(config, *(f"{key} {max(E.gap(g[key], ref[key]) for g in got):.2g}"
                        for key in ("log_probs", "entropy", "grads", "grad_norm")))
