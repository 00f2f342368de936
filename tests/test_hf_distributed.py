"""``cpshard.compat.hf`` on gloo ranks (issue 42, item 3): transformers' Llama and Qwen2 in float64 under
``R`` ring ranks times ``U`` Ulysses ranks equal one process running each document alone: the loss to
1e-10, every parameter gradient averaged over the ranks, and the restored logits; zigzag unpadded
(``padding="none"``, its default) and padded (``"minimal"``). The sub-cases run in
tests/hf_ranks.py, in one world of 5 gloo ranks whose sequence-parallel ranks are global ranks 1..4."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from rank_suites import run_suite  # noqa: E402

SUBCASES = ("shapes", "drawn", "one_kv_head", "flex", "flash", "broken", "refusals", "unchecked")
LOSS, GRAD, LOGITS = 1e-10, 1e-12, 1e-12  # loss absolute; gradients relative to each one's largest


@functools.cache
def _suite(*names: str) -> list[dict]:
    return run_suite("hf_ranks", names, 5, timeout=1200, collective_timeout=600)


def _all(name: str) -> dict:
    merged = {}
    for rank, got in enumerate(_suite(*SUBCASES)):
        for key, value in got[name].items():
            merged[(rank, key)] = value
    return merged


def _exact(results: dict) -> None:
    assert results
    for key, got in results.items():
        assert got["loss"] <= LOSS and got["grad"] <= GRAD and got["logits"] <= LOGITS, (key, got)


def test_llama_and_qwen2_at_every_shape_and_layout_equal_one_process():
    results = _all("shapes")
    seen = {key[1][:3] for key in results}
    assert len(seen) == 2 * 5 * 3  # two models, five (R, U), zigzag unpadded and padded, contiguous
    assert {key[1][2] for key in results} == {"zigzag/none", "zigzag/minimal", "contiguous/minimal"}
    _exact(results)


def test_drawn_documents_equal_one_process():
    results = _all("drawn")
    assert {key[1][1] for key in results} >= {("zigzag", "none"), ("contiguous", "minimal")}, results
    _exact(results)


def test_one_key_value_head_at_two_and_four_ulysses_ranks():
    results = _all("one_kv_head")
    assert {key[1] for key in results} == {(1, 2), (2, 2), (1, 4)}
    _exact(results)


def test_flex_kernel_equals_one_process():
    _exact(_all("flex"))


def test_flash_kernel_wiring_equals_one_process():
    results = _all("flash")
    assert {key[1] for key in results} == {((2, 2), "zigzag/none"), ((2, 2), "contiguous/minimal"),
                                          ((3, 1), "zigzag/none"), ((3, 1), "contiguous/minimal"),
                                          ((3, 1), "zigzag/minimal")}
    _exact(results)


def test_a_broken_layout_is_caught():
    results = _all("broken")
    assert {key for key in results} == {(rank, "ulysses") for rank in (1, 2, 3, 4)} | \
        {(rank, "chunks") for rank in (2, 3, 4)}, results
    assert all(got["loss"] > 1e-6 for got in results.values()), results


def test_bad_configurations_raise_on_every_rank():
    results = _all("refusals")
    ranks = {key[0] for key in results}
    assert ranks == {1, 2, 3, 4}
    for (_, what), message in results.items():
        if what == "same":
            assert "must meet the ring group in this rank only" in message
        if what == "heads":
            assert "num_attention_heads=6" in message and "ring axis" in message
    for what in ("differ", "tokens", "refused"):
        seen = {rank: m for (rank, w), m in results.items() if w == what}
        assert set(seen) == {1, 2, 3, 4}, (what, results)
        for rank, message in seen.items():
            if what == "refused" and rank == 4:  # its own error, naming the argument
                assert message.startswith("position_ids="), message
            else:
                assert "differ across the sequence-parallel ranks" in message and "global ranks" in message, message


def test_documents_that_differ_raise_in_the_first_exchange_with_checks_off():
    results = _all("unchecked")
    assert set(results) == {(1, "raised"), (2, "raised")}, results
