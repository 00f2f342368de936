"""cpshard's load balancer driving torch's own context parallelism across gloo ranks (cp 2, 3 and 4):
torch's shard and unshard against ``cpshard.shard``; flex attention through torch's CP block mask and
K/V all-gather against per-document attention at cp = 1; the q, k, v gradients through SDPA with
``document_mask_mod``'s mask; transformers' Llama trained one step under CP against cp = 1. The
sub-cases run in tests/torch_cp_ranks.py, one gloo group per cp for all of them."""

from __future__ import annotations

import functools
import importlib.util

import pytest

from rank_suites import run_suite

_HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
_NAMES = ("shard_unshard", "flex", "sdpa_grads", "ring_sdpa") + (("llama",) if _HAVE_TRANSFORMERS else ())
WORLDS = [2, 3, 4]


@functools.cache
def _suites(world):
    return run_suite("torch_cp_ranks", _NAMES, world, timeout=900, collective_timeout=300)


def _examples(world, name):
    counts = [rank[name] for rank in _suites(world)]
    assert len(set(counts)) == 1, counts  # every rank ran every example
    return counts[0]


@pytest.mark.parametrize("world", WORLDS)
def test_torch_shard_and_unshard_with_the_balancer(world):
    assert _examples(world, "shard_unshard") >= 8  # three explicit batches (one full row, unpadded zigzag), drawn ones


@pytest.mark.parametrize("world", WORLDS)
def test_flex_attention_under_cp_equals_cp1(world):
    assert _examples(world, "flex") >= 2


@pytest.mark.parametrize("world", WORLDS)
def test_attention_gradients_under_cp_equal_cp1(world):
    assert _examples(world, "sdpa_grads") >= 3


@pytest.mark.parametrize("world", WORLDS)
def test_torch_context_parallel_ring_sdpa_is_refused(world):
    assert all(rank["ring_sdpa"] is True for rank in _suites(world))


@pytest.mark.skipif(not _HAVE_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("world", WORLDS)
def test_llama_step_under_cp_equals_cp1(world):
    assert _examples(world, "llama") >= 2


def test_ranks_whose_plans_differ_raise_on_every_rank_with_checks_on():
    """Before: torch's shard and unshard returned other rows on each rank, no error (load_balancer had no
    check). With ``check=True`` and ``mesh=``, one all-gather of every rank's plans first."""
    seen = run_suite("torch_cp_ranks", ("plans_differ",), 2, timeout=120, collective_timeout=60)
    for rank, (differ, refused, alike, built, group, two_d) in enumerate(r["plans_differ"] for r in seen):
        # plans built inside the balancer (a function): rank 1's bad positions make every rank raise
        assert built[0] == "raised" and "ranks [1] built no plan" in built[1], built
        if rank == 1:
            assert built[2].startswith("positions[0, 0]=1: must be 0"), built
        # a process group or a 2-D mesh: refused by name on every rank (before: AttributeError, torch's own)
        assert group.startswith("TypeError: mesh=ProcessGroup: must be a 1-D DeviceMesh"), group
        assert two_d.startswith("ValueError: mesh=a DeviceMesh of 2 dimensions (1, 2)"), two_d
        assert differ[0] == "raised" and "built different plans" in differ[1] and "num_seqs=2" in differ[1], differ
        # rank 1's plans are for cp = 1: every rank names it, rank 1's own error chained as the cause
        assert refused[0] == "raised" and "ranks [1] built no plan (see that rank's own error)" in refused[1], refused
        if rank == 1:
            assert refused[2].startswith("mesh=a device mesh of 2 ranks: must have the plans' cp_size=1"), refused
        assert alike[0] == "ok" and alike[1].tolist() == [list(range(8))], alike
