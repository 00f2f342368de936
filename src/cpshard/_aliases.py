"""The module paths of cpshard before its subpackages, kept for the code that imports them.

``import cpshard.mtp`` (or ``from cpshard.spawn import run_ranks``) loads the module's new home and
binds it under the old name too: one module object, so that what is patched through one path is
patched through the other. The table is the whole of it; ``tests/test_architecture.py`` checks that
every entry resolves. New code imports the new paths (``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

MOVED = {
    "cpshard.attention": "cpshard.testing.attention",
    "cpshard.bshd": "cpshard.plan.bshd",
    "cpshard.causal": "cpshard.plan.causal",
    "cpshard.cli": "cpshard.tools.cli",
    "cpshard.layout": "cpshard.base.layout",
    "cpshard.mtp": "cpshard.loss.mtp",
    "cpshard.padded": "cpshard.ops.padded",
    "cpshard.plot": "cpshard.tools.plot",
    "cpshard.scan": "cpshard.testing.scan",
    "cpshard.spawn": "cpshard.testing.spawn",
    "cpshard.verify": "cpshard.tools.verify",
}
"""Old path -> new path, loaded on first import."""

FUNCTION_NAMED = {"cpshard.pack": "cpshard.packing.pack"}
"""Old module paths that share their name with a function of ``cpshard`` (``cpshard.pack`` is the
function): registered as loaded, so that ``from cpshard.pack import packing_bound`` finds the module
and the import system never rebinds ``cpshard.pack`` to it."""


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # loaded by create_module under its own name; the import system set the old name's spec on it
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, _Alias(MOVED[name]))


def install() -> None:
    """Serve :data:`MOVED`'s old paths (once per process; ``cpshard/__init__.py`` calls it)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
    for old, new in FUNCTION_NAMED.items():
        sys.modules.setdefault(old, importlib.import_module(new))
