"""cpshard's own calls print nothing of torch's: the ``is_fx_tracing will return true ...`` notice that
``torch.nested.nested_tensor_from_jagged`` logs once per process is spent quietly at its one call
site, and torch.fx's logger is left as it was (a fresh process each: the notice is once per process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

NOTICE = "is_fx_tracing will return true"

PROGRAMS = {
    "unshard": "import torch, cpshard\n"
               "plan = cpshard.ShardPlan.build([5, 3], cp_size=2)\n"
               "x = torch.arange(8.0)\n"
               "rows = [cpshard.shard(x, plan, r) for r in range(2)]\n"
               "print(cpshard.unshard(rows, plan).values().tolist())\n",
    "from_padded": "import torch\nfrom cpshard.padded import from_padded\n"
                   "x = torch.arange(6.0).view(2, 3); mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)\n"
                   "print(from_padded(x, mask).values().tolist())\n",
}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_no_torch_fx_notice_from_cpshard(name):
    proc = _run(PROGRAMS[name])
    assert proc.returncode == 0, proc.stderr
    assert NOTICE not in proc.stderr and proc.stderr.strip() == "", proc.stderr
    assert proc.stdout.strip() in ("[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]", "[0.0, 1.0, 3.0, 4.0, 5.0]")


def test_torch_fx_logger_is_left_as_it_was():
    """Quiet at the source, not by muting: torch.fx's logger keeps its level after cpshard's first call."""
    proc = _run(PROGRAMS["unshard"] + "import logging\n"
                "print(logging.getLogger('torch.fx._symbolic_trace').level)\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(__import__("logging").NOTSET)
