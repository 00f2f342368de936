"""The benchmark scripts still run and report (smoke runs on tiny batches; nothing here looks at a time).

Benchmarks are scripts, not tests (README, "Performance"); this only keeps them from rotting as the
library changes: each runs to completion on a small batch and prints its comparison. The scripts start
together (each is mostly imports, and spawned ranks starting: on two cores they overlap) and each test
waits for its own.
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
    ("collective_counter.py", ["--quick"], ["import + first counted op", "baseline/new", "all_reduce"]),
    ("scale.py", ["--sizes", "64", "--repeats", "1", "--only", "index", "--only", "pack"], ["unshard cold", "/verl"]),
    ("verl_activation.py", ["--quick"], ["import verl + verl.models.mcore.model_forward", "on - off"]),
    ("torch_cp.py", ["--quick"], ["perdoc-ht", "cp-zz-full", "cp-contig", "refused", "host ms to build",
                                  "many short documents"]),
    ("hf_sp.py", ["--quick", "--rows", "1", "--repeats", "1"], ["row-zigzag", "doc-2UR", "MiB each rank sends",
                                                                "of one rank's preparation"]),
]


def _skip_reason(script):
    if script in ("verl.py", "verl_activation.py") and importlib.util.find_spec("verl") is None:
        return "verl is not installed (scripts/setup.sh installs it)"
    return None


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """Every selected script, started at once: ``{script: (process, stdout file, stderr file)}``."""
    selected = {item.callspec.params["script"] for item in request.session.items
                if getattr(item, "module", None) is request.module and hasattr(item, "callspec")}
    out = {}
    try:
        for script, args, _ in CASES:
            if script in selected and _skip_reason(script) is None:
                where = tmp_path_factory.mktemp(script.removesuffix(".py"))
                stdout, stderr = (where / "stdout").open("w+"), (where / "stderr").open("w+")
                proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=ROOT,
                                        stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True)
                out[script] = proc, stdout, stderr
        yield out
    finally:
        for proc, stdout, stderr in out.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            stdout.close()
            stderr.close()


def _finished(started, script):
    proc, stdout, stderr = started[script]
    proc.wait(timeout=300)
    stdout.seek(0)
    stderr.seek(0)
    return proc.returncode, stdout.read(), stderr.read()


@pytest.mark.parametrize("script,args,expected", CASES, ids=[c[0] for c in CASES])
def test_benchmark_runs_and_reports(started, script, args, expected):
    if _skip_reason(script):
        pytest.skip(_skip_reason(script))
    returncode, stdout, stderr = _finished(started, script)
    assert returncode == 0, stderr[-2000:]
    for text in expected:
        assert text in stdout, (text, stdout[-2000:])
    if script == "verl.py":  # every drop-in agreed with verl on every real token
        rows = [line for line in stdout.splitlines() if line.startswith(("preprocess", "postprocess"))]
        assert rows and all(line.rstrip().endswith("True") for line in rows), rows
    if script == "torch_cp.py":  # every balancer measured on every line but torch's per-document one
        rows = [line.split() for line in stdout.splitlines() if line.lstrip().startswith("8192")]
        assert len(rows) == 6 + 2 + 2 and all(len(r) == 13 for r in rows[:6]), rows  # + many short documents
        assert all(len(r) == 5 for r in rows[8:]), rows
        assert all(r[7] == "refused" for r in rows[:6] if r[2] != "exp-2cp"), rows
