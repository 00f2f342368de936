"""Installing: the pins live in constraints.txt, which scripts/setup.sh reads (CI runs setup.sh through
scripts/test.sh), and a missing dependency is named with its install command.

The install cases themselves (a torch-only environment, pip install of the checkout with and without
its dependencies) need a fresh virtual environment and run in scripts/check_install.sh, which
scripts/test.sh runs after the suite.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"


def _groups() -> dict[str, list[str]]:
    """constraints.txt's pins by group, read here independently of setup.sh's awk."""
    groups: dict[str, list[str]] = {}
    current = None
    for line in CONSTRAINTS.read_text().splitlines():
        head = re.match(r"# \[(\w+)\]", line)
        if head:
            current = groups.setdefault(head.group(1), [])
        elif line.strip() and not line.startswith("#"):
            assert current is not None, line
            current.append(line.strip())
    return groups


def test_constraints_pin_each_package_once_and_setup_reads_them():
    groups = _groups()
    assert list(groups) == ["torch", "core", "megatron", "verl", "torchtitan"]
    pins = [p for group in groups.values() for p in group]
    names = [re.split("==", p)[0].lower().replace("_", "-") for p in pins]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][\w.+]*", p) for p in pins), pins
    assert len(names) == len(set(names)), "a package pinned twice"
    assert "torch==2.13.0" in groups["torch"] and "megatron-core==0.19.2" in groups["megatron"]
    assert "verl==0.9.1" in groups["verl"] and any(p.startswith("numpy==") for p in groups["core"])
    assert "torchtitan==0.3.0" in groups["torchtitan"] and "triton==3.9.0" in groups["torchtitan"]
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    code = "\n".join(line for line in setup.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"[A-Za-z][\w.-]*==[0-9]", code), "setup.sh holds a pin of its own"
    pins_fn = re.search(r"^pins\(\) \{.*?^\}", setup, flags=re.S | re.M).group(0)
    for group, want in groups.items():
        got = subprocess.run(["bash", "-c", f'cd "{ROOT}"; CONSTRAINTS=constraints.txt; {pins_fn}\npins {group}'],
                             capture_output=True, text=True, check=True).stdout.split()
        assert got == want, group


def test_constraints_match_the_environment_setup_built():
    """What setup.sh installed is what constraints.txt says (where it installed it)."""
    from importlib import metadata

    for group in ("core", "megatron", "verl", "torchtitan"):
        for pin in _groups()[group]:
            name, version = pin.split("==")
            try:
                installed = metadata.version(name)
            except metadata.PackageNotFoundError:
                continue  # a group setup.sh was told to skip
            assert installed == version, (name, installed, version)


def test_missing_numpy_is_named_with_its_fix():
    """`import cpshard` where NumPy cannot be imported (hidden by a meta-path finder in a subprocess)."""
    code = """
import sys
class NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ImportError("No module named 'numpy'")
sys.meta_path.insert(0, NoNumpy())
import cpshard
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if "cpshard needs NumPy" not in done.stderr and "torch" in done.stderr.splitlines()[-1]:
        pytest.skip("torch itself needs NumPy here: " + done.stderr.splitlines()[-1])
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: cpshard needs NumPy") and "pip install 'numpy>=1.22'" in last, last


def test_missing_megatron_is_named_with_its_commands(monkeypatch):
    import importlib.util

    from cpshard.megatron import import_megatron

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    monkeypatch.delitem(sys.modules, "megatron.core.transformer.moe.ops.paged_stash", raising=False)
    monkeypatch.delitem(sys.modules, "megatron", raising=False)
    with pytest.raises(ImportError) as info:
        import_megatron("packed_seq_params")
    text = str(info.value)
    assert "pip install --no-deps --ignore-requires-python megatron-core==0.19.2" in text
    assert "_import.py" not in text
