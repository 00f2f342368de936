"""The benchmark scripts still run and report (smoke runs on tiny batches; nothing here looks at a time).

Benchmarks are scripts, not tests (README, "Performance"); this only keeps them from rotting as the
library changes: each runs to completion on a small batch and prints its comparison.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--seqs", "16", "--max-len", "512"]

CASES = [
    ("step.py", ["--quick", *TINY, "--repeats", "2"], ["x floor", "unshard (restore, cold)", "minimal"]),
    ("shard.py", ["--quick", *TINY], ["index_select (baseline)", "cpshard.shard, cold"]),
    ("balance.py", ["--quick", "--batches", "3", "--max-doc", "8192"], ["balanced", "bound/mean"]),
    ("gather.py", ["--quick", "--repeats", "2"], ["baseline/cpshard"]),
    ("verl.py", ["--quick", "--repeats", "1"], ["postprocess_thd_engine contiguous", "verl/cpshard"]),
    ("pack.py", ["--quick", "--batches", "1", "--no-large"], ["verl+bal", "pack+bal", "bound"]),
]


@pytest.mark.parametrize("script,args,expected", CASES, ids=[c[0] for c in CASES])
def test_benchmark_runs_and_reports(script, args, expected):
    if script == "verl.py" and importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed (scripts/setup.sh installs it)")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for text in expected:
        assert text in done.stdout, (text, done.stdout[-2000:])
    if script == "verl.py":  # every drop-in agreed with verl on every real token
        rows = [line for line in done.stdout.splitlines() if line.startswith(("preprocess", "postprocess"))]
        assert rows and all(line.rstrip().endswith("True") for line in rows), rows
