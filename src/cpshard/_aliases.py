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
    "cpshard.mtp": "cpshard.loss.mtp",
    "cpshard.padded": "cpshard.ops.padded",
    "cpshard.plot": "cpshard.tools.plot",
    "cpshard.scan": "cpshard.testing.scan",
    "cpshard.spawn": "cpshard.testing.spawn",
    "cpshard.verify": "cpshard.tools.verify",
}
"""Old path -> new path, loaded on first import."""

SPLIT = {"cpshard.layout": ("cpshard.base.layout", "cpshard.base.convention", "cpshard.policy.layouts")}
"""Old paths of modules split by idea -> their new homes: the old path is a module of its own that
holds every name of its new homes (the same objects: what is mutated through it, such as a registered
layout rule, is seen there; a name rebound on it is not)."""

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


class _Union(importlib.abc.Loader):
    def __init__(self, homes: tuple[str, ...]) -> None:
        self.homes = homes

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a plain module

    def exec_module(self, module: ModuleType) -> None:
        names: set[str] = set()
        for home in self.homes:
            new = importlib.import_module(home)
            module.__dict__.update({k: v for k, v in vars(new).items() if not k.startswith("__")})
            names.update(getattr(new, "__all__", ()))
        module.__all__ = sorted(names)  # type: ignore[attr-defined]
        module.__doc__ = f"The names of {', '.join(self.homes)} under their old path (``cpshard._aliases.SPLIT``)."


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name in MOVED:
            return importlib.util.spec_from_loader(name, _Alias(MOVED[name]))
        if name in SPLIT:
            return importlib.util.spec_from_loader(name, _Union(SPLIT[name]))
        return None


def install() -> None:
    """Serve :data:`MOVED`'s and :data:`SPLIT`'s old paths (once per process; ``cpshard/__init__.py`` calls it)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
    for old, new in FUNCTION_NAMED.items():
        sys.modules.setdefault(old, importlib.import_module(new))
