"""scripts/gpu_check.sh without a GPU: it must skip cleanly (exit 0, one JSON record saying so), so
that nothing needs a GPU to build or pass. Its parts themselves are run on the CPU by hand
(``scripts/gpu_check.py --on-cpu``) and on a lent GPU by the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script runs its checks instead")
def test_gpu_check_skips_cleanly_without_cuda(tmp_path):
    out = tmp_path / "gpu.json"
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), str(out)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))
    assert run.returncode == 0, run.stderr
    record = json.loads(out.read_text())
    assert record["cuda"] is False and "no CUDA device" in record["skipped"]
