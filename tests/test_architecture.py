"""docs/ARCHITECTURE.md's import rules, read from the source: a module imports only from its own layer
or below, and only ``distributed`` and ``spawn`` import ``torch.distributed``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "cpshard"

LAYERS = {
    0: {"_errors", "_types", "_deps", "_dtypes"},
    1: {"layout", "_parse", "plan", "bshd", "_index", "_exchange", "_halo", "_indices", "_balance", "causal",
        "_relayout", "pack", "_refine"},
    2: {"ops", "padded"},
    3: {"_agree", "_header", "distributed", "spawn"},
    4: {"attention", "loss", "mtp", "verify", "scan", "_hybrid"},
    5: {"cli", "plot", "__main__", "__init__", "megatron", "compat"},
}
LAYER_OF = {name: layer for layer, names in LAYERS.items() for name in names}
COMMUNICATORS = {"distributed", "spawn"}


def _module(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports count)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


SOURCES = sorted(SRC.rglob("*.py"))


def test_every_module_has_a_layer():
    assert {_module(p) for p in SOURCES} <= set(LAYER_OF), "add new modules to docs/ARCHITECTURE.md and LAYERS"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_follow_the_layers(path: Path):
    me = _module(path)
    for name in _imports(path):
        if name.startswith("torch.distributed"):
            assert me in COMMUNICATORS, f"{path.name} imports {name}: only distributed.py and spawn.py may"
        parts = name.split(".")
        if parts[0] != "cpshard" or len(parts) < 2 or parts[1] not in LAYER_OF:
            continue
        other = parts[1]
        assert LAYER_OF[other] <= LAYER_OF[me], f"{path.name} (layer {LAYER_OF[me]}) imports {other} " \
                                                f"(layer {LAYER_OF[other]})"


def test_no_module_calls_torch_distributed_by_attribute():
    """``torch.distributed.x(...)`` without an import is a collective too."""
    for path in SOURCES:
        if _module(path) in COMMUNICATORS:
            continue
        uses = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and node.attr == "distributed"
                and isinstance(node.value, ast.Name) and node.value.id == "torch"]
        assert not uses, f"{path.name} reaches torch.distributed at lines {uses}"


def test_the_plan_command_does_not_load_the_communication_layer():
    code = ("import sys, cpshard.cli; print(sorted(m for m in sys.modules if m in "
            "('cpshard.distributed', 'cpshard.attention', 'cpshard.spawn')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
