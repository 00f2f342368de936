"""verl 0.9.1's own FSDP engine (``FSDPEngineWithLMHead``) on gloo, on the CPU: plain verl, no cpshard.

tests/verl_fsdp_engine.py builds the engine as verl's ``TrainingWorker`` does and says what it takes to
run it here. One gloo group of two ranks builds it twice, at Ulysses degree ``sp = 1`` (two data-parallel
ranks, both given the same micro-batch, so that FSDP's average of their gradients is one process's) and
``sp = 2``, and runs ``infer_batch`` and ``forward_backward_batch`` on packed documents of 5, 11 and 7
tokens of a tiny random Qwen2 (fp32, attention ``sdpa``). The reference is the same model in this
process, each document alone.

- At ``sp = 1`` verl's numbers are the reference's to float32 rounding: the harness is sound.
- At ``sp = 2`` with ``sdpa`` verl runs without an error and is wrong: its Ulysses hook replaces only
  transformers' flash-attention forward, so each rank attends over its own half of the packed row.
  The test asserts that it is wrong (the numbers are in docs/verl.md); under cpshard's patch it equals
  ``sp = 1`` (tests/test_verl_fsdp_cpshard.py).
"""

from __future__ import annotations

import pytest
import torch

import verl_fsdp_engine as E

E.skip_without_verl()
from cpshard.spawn import run_ranks  # noqa: E402 - after the skip

LENGTHS = E.LENGTHS


def _both_degrees(rank, world, path):
    """verl's engine at sp 1 and sp 2 on the same documents, in one group (rank bodies run in fresh
    processes: verl's platform is chosen before its engine module is imported)."""
    import verl_fsdp_engine as E

    E.install_cpu_platform()
    out = {sp: E.step(E.build(path, sp=sp), LENGTHS, E.weights()) for sp in (1, 2)}
    with E.drop_ins_bound():
        out["sp 2, drop-ins"] = E.step(E.build(path, sp=2), LENGTHS, E.weights())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = E.save_tiny_qwen2(str(tmp_path_factory.mktemp("qwen2")))
    reference = E.hf_reference(path, LENGTHS, E.weights())
    return reference, run_ranks(_both_degrees, 2, path, timeout=300, collective_timeout=120)


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_engine_with_the_ulysses_drop_ins_equals_plain_verl_bit_for_bit(runs):
    """verl's engine at sp 2 with cpshard's drop-ins where it binds verl's Ulysses helpers (pad and slice
    of ids, positions, rolled labels and temperature; the gather of log-probs and entropy, and its
    gradient): every log-prob, entropy, gradient and the grad norm equal plain verl's exactly."""
    _, ranks = runs
    for r in ranks:
        assert _equal(r["sp 2, drop-ins"], r[2])


def test_engine_at_sp1_equals_one_process(runs):
    ref, ranks = runs
    for got in (r[1] for r in ranks):
        assert set(got["grads"]) == set(ref["grads"])
        assert E.gap(got["log_probs"], ref["log_probs"]) < 1e-5
        assert E.gap(got["entropy"], ref["entropy"]) < 1e-5
        assert E.gap(got["grads"], ref["grads"]) < 1e-5
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)


def test_engine_at_sp2_with_sdpa_is_silently_wrong(runs):
    """Plain verl at sp 2, sdpa: no error, every rank agrees, and the numbers are not sp 1's (each rank's
    attention sees its own half of the packed row only). What cpshard's patch is to fix."""
    ref, ranks = runs
    assert E.gap(ranks[0][2], ranks[1][2]) == 0  # gathered: the ranks agree on the wrong values
    got = ranks[0][2]
    assert E.gap(got["log_probs"], ref["log_probs"]) > 1e-2
    assert E.gap(got["grads"], ref["grads"]) > 1e-2
    assert abs(got["grad_norm"] - ref["grad_norm"]) > 1e-3
    # the packed row (23 tokens, padded to 24) in halves of 12: rank 0 holds documents 0 and the first 7
    # tokens of document 1; rank 1 the last 4 of document 1, then document 2. Only those 4 lose the keys
    # before them, and only their rows are wrong.
    wrong = torch.zeros(sum(LENGTHS), dtype=torch.bool)
    wrong[12:16] = True
    assert E.gap(got["log_probs"][~wrong], ref["log_probs"][~wrong]) < 1e-5
    assert (got["log_probs"][wrong] - ref["log_probs"][wrong]).abs().min() > 1e-4


if __name__ == "__main__":  # the measurement docs/verl.md records: python tests/test_verl_fsdp_engine.py
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = E.save_tiny_qwen2(tmp)
        ref = E.hf_reference(path, LENGTHS, E.weights())
        ranks = run_ranks(_both_degrees, 2, path, timeout=300, collective_timeout=120)
    for sp in (1, 2):
        got = ranks[0][sp]
        print(f"sp={sp}: log-probs {E.gap(got['log_probs'], ref['log_probs']):.3g}, entropy "
              f"{E.gap(got['entropy'], ref['entropy']):.3g}, gradients {E.gap(got['grads'], ref['grads']):.3g} off; "
              f"grad norm {got['grad_norm']:.4f} (one process: {ref['grad_norm']:.4f})")
