"""cpshard.spawn.run_ranks hands back what the ranks return, whatever the ranks imported (ranks started
by ``spawn``, as users get them; the rest of the suite forks them from a server, tests/forked.py)."""

from __future__ import annotations

import pickle

import pytest
import torch

from cpshard import spawn
from cpshard.spawn import run_ranks

pytestmark = pytest.mark.usefixtures("spawned")  # the default start method (tests/conftest.py)


def _values(rank):
    """Tensors of every kind a rank may return (built the same way in the parent to compare)."""
    g = torch.Generator().manual_seed(rank)
    base = torch.randn(4, 6, generator=g)
    return {
        "float64 view": base.double()[:, ::2],          # not contiguous
        "bfloat16": base.bfloat16(),
        "float8": base.to(torch.float8_e4m3fn),
        "bool": base > 0,
        "int64 0-d": torch.tensor(rank),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
        "complex conj": torch.complex(base, -base).conj(),
        "nested list": [torch.arange(3) + rank, (torch.ones(2, dtype=torch.uint8),)],
    }


def _import_megatron_then_return(rank, world):
    from cpshard.megatron._import import import_megatron

    import_megatron("transformer.multi_token_prediction")  # replaces torch.storage._load_from_bytes
    import sys
    assert "megatron.core.safe_globals" in sys.modules
    return _values(rank)


def _bits(t):
    return t.resolve_conj().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b):
    """The same structure, and every tensor the same dtype, shape and bytes (NaN payloads, -0.0)."""
    if isinstance(a, torch.Tensor):
        assert type(b) is torch.Tensor and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)


def test_tensors_come_back_after_a_rank_imported_megatron():
    """megatron-core replaces torch.storage._load_from_bytes when it is imported; a tensor pickled
    the usual way would then make the parent import Megatron (and Triton) to read it."""
    from cpshard.megatron._import import import_megatron
    try:
        import_megatron("transformer.multi_token_prediction")
    except ImportError as exc:
        pytest.skip(f"megatron-core cannot be imported ({exc}); scripts/setup.sh installs it")
    got = run_ranks(_import_megatron_then_return, 2, timeout=120)
    for rank, values in enumerate(got):
        _same(_values(rank), values)
    # what a rank sends names nothing of Megatron's, so a parent that never imported it reads it too
    # (this process may have imported Megatron already, so the bytes are what is checked)
    assert torch.storage._load_from_bytes.__module__ == "megatron.core.safe_globals"
    assert b"megatron" not in spawn._dumps(_values(0))
    assert b"megatron" in pickle.dumps(_values(0))  # the default pickling would have named it
