"""The house rules of ``docs/ARCHITECTURE.md``, read from the source's AST (function-level and
``TYPE_CHECKING`` imports included): the import graph has no circle and follows the layers, only the
communication layer calls collectives, no private name or attribute crosses a subpackage, the architecture
page names every module, and no module grows past its size. Each rule is shown failing on a deliberate
violation, so that a rule that can no longer fail is noticed."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "cpshard"
DOC = ROOT / "docs" / "ARCHITECTURE.md"

#: Subpackages by layer, bottom up (docs/ARCHITECTURE.md). A module imports from its own subpackage
#: (the graph stays acyclic) or from a lower layer; subpackages that share a layer are independent.
LAYERS: dict[str, int] = {
    "base": 0,
    "index": 1,
    "plan": 2,
    "ops": 3, "packing": 3, "policy": 3,
    "distributed": 4,
    "loss": 5, "testing": 5,
    "megatron": 6,
    "compat": 7,
    "tools": 8,
    "": 9,  # the package's face: cpshard/__init__.py, __main__.py, _aliases.py
}
#: Where ``torch.distributed`` may be used: the collectives, and process-group creation in the launcher.
#: ``compat.torch_cp._torch`` names torch's private context-parallel interface (which lives under
#: ``torch.distributed``) and runs no collective: torch's shard and unshard run them.
COMMUNICATORS = ("cpshard.distributed.", "cpshard.testing.spawn", "cpshard.compat.torch_cp._torch")
#: Lines a module may hold; past it, a module holds one idea and is listed here with it (or with what
#: is under way).
SIZE_LIMIT = 600
LARGE: dict[str, tuple[int, str]] = {}


# -- reading the source -------------------------------------------------------------------------


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(tree: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The cpshard modules a module imports, anywhere in it (inside functions and ``TYPE_CHECKING``
    too): ``from cpshard.x import y`` names ``cpshard.x.y`` where that is a module, else ``cpshard.x``."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def read_house(src: Path = SRC) -> tuple[dict[str, set[str]], dict[str, ast.AST], dict[str, int]]:
    """``(graph, trees, lines)`` of every module under ``src``."""
    paths = {module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    trees = {m: ast.parse(p.read_text()) for m, p in paths.items()}
    known = set(paths)
    graph = {m: imports(trees[m], m, paths[m].name == "__init__.py", known) for m in paths}
    lines = {m: len(p.read_text().splitlines()) for m, p in paths.items()}
    return graph, trees, lines


GRAPH, TREES, LINES = read_house()
OUTSIDE = {f"{p.parent.name}/{p.name}": ast.parse(p.read_text())
           for folder in ("tests", "benchmarks", "examples") for p in sorted((ROOT / folder).glob("*.py"))}



# -- the rules, each a function of what was read ------------------------------------------------


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of imports (the strongly connected parts with more than one module, or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1 or v in graph.get(v, ()):
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def subpackage(module: str) -> str:
    """``cpshard.plan.values`` -> ``plan``; the package's own files -> ``""``."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] not in LAYERS:
        return ""
    return parts[1]


def against_layers(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run up a layer, or sideways into another subpackage of the same layer."""
    out = []
    for me, targets in sorted(graph.items()):
        mine = subpackage(me)
        for other in sorted(targets):
            theirs = subpackage(other)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                out.append(f"{me} ({mine or 'face'}, layer {LAYERS[mine]}) imports {other} "
                           f"({theirs or 'face'}, layer {LAYERS[theirs]})")
    return out


def collective_uses(trees: dict[str, ast.AST]) -> list[str]:
    """Uses of ``torch.distributed`` (an import, or ``torch.distributed.x`` by attribute) outside the
    communication layer."""
    out = []
    for name, tree in sorted(trees.items()):
        if name.startswith(COMMUNICATORS) or name in COMMUNICATORS:
            continue
        for node in ast.walk(tree):
            hit = ((isinstance(node, ast.Import) and any(a.name.startswith("torch.distributed") for a in node.names))
                   or (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"))
                   or (isinstance(node, ast.ImportFrom) and node.module == "torch"
                       and any(a.name == "distributed" for a in node.names))
                   or (isinstance(node, ast.Attribute) and node.attr == "distributed"
                       and isinstance(node.value, ast.Name) and node.value.id == "torch"))
            if hit:
                out.append(f"{name} line {node.lineno}")  # type: ignore[attr-defined]
    return out


def unnamed(modules: set[str], doc: str) -> list[str]:
    """Modules the architecture page does not name (by their path under ``src/cpshard``, e.g.
    ``plan/values.py``, or a package by its folder, e.g. ``plan/``)."""
    out = []
    for m in sorted(modules):
        parts = m.split(".")[1:]
        if not parts:
            continue  # cpshard/__init__.py: the page is about it
        package = any(other.startswith(m + ".") for other in modules)
        path = "/".join(parts) + ("/" if package else ".py")
        if not re.search(rf"(?<![\w/.]){re.escape(path)}", doc):
            out.append(path)
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_crossings(trees: dict[str, ast.AST], known: set[str]) -> set[str]:
    """``"importer: module.name"`` for every private name (``_x``, or a private module) that a module
    takes from another subpackage: by ``from m import _x``, or as ``m._x`` of a module it imported.
    Importers outside ``cpshard`` (tests, benchmarks) take from another subpackage whatever they take."""
    out = set()
    for me, tree in trees.items():
        mine = subpackage(me) if me.startswith("cpshard") else None
        bound: dict[str, str] = {}  # local name -> cpshard module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known and a.asname:
                        bound[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cpshard"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    owner = full if full in known else node.module
                    if full in known:
                        bound[a.asname or a.name] = full
                    private = _is_private(a.name) or any(_is_private(p) for p in owner.split(".")[1:])
                    if private and (mine is None or subpackage(owner) != mine):
                        out.add(f"{me}: {full}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and _is_private(node.attr) and (mine is None or subpackage(bound[node.value.id]) != mine)):
                out.add(f"{me}: {bound[node.value.id]}.{node.attr}")
    return out


def private_members(trees: dict[str, ast.AST]) -> dict[str, set[str]]:
    """``{"_x": subpackages}``: every private member a class of a subpackage defines (a method or a
    class-level name in its body, ``self._x = ...`` or ``cls._x = ...`` in its methods, or
    ``object.__setattr__(obj, "_x", ...)`` in them), with the subpackages whose classes define it."""
    out: dict[str, set[str]] = {}
    for me, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = set()
            for st in cls.body:
                if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(st.name)
                elif isinstance(st, ast.Assign):
                    names |= {t.id for t in st.targets if isinstance(t, ast.Name)}
                elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                    names.add(st.target.id)
            for n in ast.walk(cls):
                if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                        and n.value.id in ("self", "cls")):
                    names.add(n.attr)
                elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "__setattr__"
                      and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)
                      and isinstance(n.args[1].value, str)):
                    names.add(n.args[1].value)
            for name in filter(_is_private, names):
                out.setdefault(name, set()).add(subpackage(me))
    return out


def private_attribute_reads(trees: dict[str, ast.AST], members: dict[str, set[str]]) -> list[str]:
    """``obj._x`` in a module of one subpackage where ``_x`` is a private member that only classes of
    other subpackages define (:func:`private_members`): reading another layer's object by its private
    parts. A name that the reader's own subpackage also defines is its own (``self._x`` inside the
    defining class, or a name two layers happen to share), and dunder names are not private."""
    out = []
    for me, tree in sorted(trees.items()):
        mine = subpackage(me)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr in members
                    and mine not in members[node.attr]):
                out.append(f"{me} line {node.lineno}: {ast.unparse(node)} "
                           f"(defined in {', '.join(sorted(members[node.attr]))})")
    return out


def plan_unions(trees: dict[str, ast.AST]) -> list[str]:
    """``ShardPlan | BshdPlan`` outside the plan package (``Plan`` is what both are)."""
    out = []
    for name, tree in sorted(trees.items()):
        if subpackage(name) == "plan":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
                names = {n.id for n in (node.left, node.right) if isinstance(n, ast.Name)}
                if names == {"ShardPlan", "BshdPlan"}:
                    out.append(f"{name} line {node.lineno}")
    return out


def oversized(lines: dict[str, int], large: dict[str, tuple[int, str]] = LARGE) -> list[str]:
    """Modules over :data:`SIZE_LIMIT` lines that ``large`` (:data:`LARGE`) does not list, or over what it allows."""
    out = []
    for name, n in sorted(lines.items()):
        limit = large.get(name, (SIZE_LIMIT, ""))[0]
        if n > limit:
            out.append(f"{name}: {n} lines > {limit}")
    return out


# -- the rules hold ------------------------------------------------------------------------------


def test_every_module_is_in_a_layer():
    assert {subpackage(m) for m in GRAPH} <= set(LAYERS)
    folders = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS) - {""}, "a new subpackage needs a layer here and in docs/ARCHITECTURE.md"


def test_the_import_graph_has_no_circle():
    assert cycles(GRAPH) == []


def test_imports_follow_the_layers():
    assert against_layers(GRAPH) == []


def test_collectives_only_in_the_communication_layer():
    assert collective_uses(TREES) == []


def test_the_architecture_page_names_every_module():
    assert unnamed(set(GRAPH), DOC.read_text()) == []


def test_module_sizes():
    assert oversized(LINES) == []
    assert all(name in LINES for name in LARGE), "drop modules from LARGE that are gone"
    assert all(LINES[name] > SIZE_LIMIT for name in LARGE), "drop modules from LARGE that are back under the limit"


def test_no_private_name_crosses_a_subpackage():
    assert private_crossings(TREES, set(GRAPH)) == set(), "make the name public, or move the code beside it"


def test_no_private_attribute_is_read_across_subpackages():
    assert private_attribute_reads(TREES, private_members(TREES)) == [], \
        "give the object a public answer (a documented method or property), or move the code beside it"


def test_tests_take_public_names_or_hooks():
    """Tests, benchmarks and examples take public names or documented hooks, never a private one."""
    assert private_crossings(OUTSIDE, set(GRAPH)) == set(), "take a public name or a documented hook instead"


def test_no_union_of_plan_kinds_outside_the_plan():
    assert plan_unions(TREES) == [], "take a Plan and let the plan kind answer"


def test_the_index_service_names_no_plan():
    """The index service sits below the plan values: it builds no plan object (module or names)."""
    assert not {m for m in GRAPH["cpshard.plan.indices"] if m.startswith("cpshard.plan.")}
    assert not any(m.startswith("cpshard.plan") for m in GRAPH["cpshard.index.route"])


# -- ... and each one fails on a violation ------------------------------------------------------


def test_a_function_level_import_is_read(tmp_path):
    pkg = tmp_path / "cpshard"
    (pkg / "plan").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "plan" / "__init__.py").write_text("")
    (pkg / "plan" / "values.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from cpshard.plan import twins\n")
    (pkg / "plan" / "twins.py").write_text("def f():\n    from cpshard.plan.values import Plan\n")
    graph, _, _ = read_house(pkg)
    assert graph["cpshard.plan.twins"] == {"cpshard.plan.values"}
    assert graph["cpshard.plan.values"] == {"cpshard.plan.twins"}
    assert cycles(graph) == [["cpshard.plan.twins", "cpshard.plan.values"]]


def test_a_circle_is_found():
    graph = {k: set(v) for k, v in GRAPH.items()}
    graph["cpshard.plan.indices"].add("cpshard.plan.values")
    found = cycles(graph)
    assert len(found) == 1 and {"cpshard.plan.indices", "cpshard.plan.values"} <= set(found[0])


def test_an_upward_import_is_found():
    graph = {k: set(v) for k, v in GRAPH.items()}
    graph["cpshard.plan.values"].add("cpshard.distributed.collectives")
    graph["cpshard.ops.sharding"].add("cpshard.packing.pack")  # sideways, same layer
    assert against_layers(graph) == [
        "cpshard.ops.sharding (ops, layer 3) imports cpshard.packing.pack (packing, layer 3)",
        "cpshard.plan.values (plan, layer 2) imports cpshard.distributed.collectives (distributed, layer 4)"]


@pytest.mark.parametrize("code", ["import torch.distributed as dist", "from torch import distributed",
                                  "from torch.distributed import all_reduce", "torch.distributed.barrier()"])
def test_a_collective_outside_the_communication_layer_is_found(code):
    trees = dict(TREES)
    trees["cpshard.loss.reductions"] = ast.parse(code)
    assert collective_uses(trees) == ["cpshard.loss.reductions line 1"]


def test_an_unnamed_module_is_found():
    doc = DOC.read_text().replace("plan/values.py", "plan/(the values)")
    assert unnamed(set(GRAPH), doc) == ["plan/values.py"]


def test_a_private_crossing_is_found():
    tree = ast.parse("from cpshard.plan.indices import _segments_per_token\nfrom cpshard.plan import values\n"
                     "values._cumsum\nfrom cpshard.megatron import _import\n")
    assert private_crossings({"cpshard.ops.sharding": tree, "cpshard.plan.bshd": tree}, set(GRAPH)) == {
        "cpshard.ops.sharding: cpshard.plan.indices._segments_per_token",
        "cpshard.ops.sharding: cpshard.plan.values._cumsum",
        "cpshard.ops.sharding: cpshard.megatron._import", "cpshard.plan.bshd: cpshard.megatron._import"}


def test_a_private_attribute_read_across_subpackages_is_found():
    members = private_members(TREES)
    assert "plan" in members["_rank_segments"] and "__init__" not in members  # a plan class's member; no dunder
    read = "def f(plan, x):\n    plan._rank_segments(0, x)\n    return x.__dict__, x._not_a_member\n"
    own = "class Mine:\n    def __init__(self):\n        self._rank_segments = None\n"
    trees = {"cpshard.ops.sharding": ast.parse(read), "cpshard.plan.bshd": ast.parse(read)}
    # the plan's own modules read it freely
    assert private_attribute_reads(trees, members) == [
        "cpshard.ops.sharding line 2: plan._rank_segments (defined in plan)"]
    # as does a subpackage whose own class defines the name too
    trees["cpshard.loss.mtp"] = ast.parse(read + own)
    assert private_attribute_reads(trees, private_members({**TREES, **trees})) == [
        "cpshard.ops.sharding line 2: plan._rank_segments (defined in loss, plan)"]


def test_a_union_of_plan_kinds_is_found():
    tree = ast.parse("def f(plan: ShardPlan | BshdPlan) -> None: ...")
    assert plan_unions({"cpshard.loss.mtp": tree, "cpshard.plan.twins": tree}) == ["cpshard.loss.mtp line 1"]


def test_an_oversized_module_is_found():
    assert oversized({**LINES, "cpshard.plan.bshd": SIZE_LIMIT + 1}) == [
        f"cpshard.plan.bshd: {SIZE_LIMIT + 1} lines > {SIZE_LIMIT}"]
    large = {"cpshard.plan.values": (SIZE_LIMIT + 40, "one idea")}  # a listed module past its own ceiling
    assert oversized({**LINES, "cpshard.plan.values": SIZE_LIMIT + 40}, large) == []
    assert oversized({**LINES, "cpshard.plan.values": SIZE_LIMIT + 41}, large) == [
        f"cpshard.plan.values: {SIZE_LIMIT + 41} lines > {SIZE_LIMIT + 40}"]


# -- the paths users import ------------------------------------------------------------------------


def alias_tables() -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """``MOVED`` and ``SPLIT`` as ``cpshard/_aliases.py`` writes them, read from its source (the alias
    table is the package face's own: the test reads it as it reads every module, without importing it)."""
    tables = {node.targets[0].id: ast.literal_eval(node.value) for node in TREES["cpshard._aliases"].body
              if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id in ("MOVED", "SPLIT")}
    return tables["MOVED"], tables["SPLIT"]


def test_the_old_paths_are_the_new_modules():
    import cpshard

    moved, split = alias_tables()
    # the paths the house promised to keep, among them
    assert {"cpshard.mtp", "cpshard.spawn", "cpshard.attention", "cpshard.scan"} <= set(moved)
    assert set(split) == {"cpshard.layout"}
    for old, new in moved.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert getattr(cpshard, old.rpartition(".")[2]) is importlib.import_module(new)
    for old, homes in split.items():  # a module split by idea: its old path holds every name of its homes
        module = importlib.import_module(old)
        assert getattr(cpshard, old.rpartition(".")[2]) is module
        for home in map(importlib.import_module, homes):
            assert all(getattr(module, n) is getattr(home, n) for n in home.__all__), (old, home.__name__)
    layout = importlib.import_module("cpshard.layout")  # the names it had before the split, all of them
    assert {"GradReduction", "LayerLayouts", "Layout", "Padding", "Reorder", "TwinOrder", "alignment", "fp8_alignment",
            "fp8_total_alignment", "layer_layouts", "layout_for", "padded_lengths", "register_layout_rule", "round_up",
            "sequence_unit", "shared_alignment", "total_problem", "unregister_layout_rule",
            "_RULES"} <= set(vars(layout))
    assert layout._RULES is importlib.import_module("cpshard.policy.layouts")._RULES
    from cpshard.pack import packing_bound  # the module keeps its old path; cpshard.pack is the function
    assert callable(cpshard.pack) and not isinstance(cpshard.pack, type(cpshard))
    assert packing_bound is importlib.import_module("cpshard.packing.pack").packing_bound


def test_public_paths_import_in_a_fresh_process():
    code = ("import cpshard.distributed, cpshard.loss, cpshard.mtp, cpshard.megatron, cpshard.compat.verl, "
            "cpshard.spawn, cpshard.attention, cpshard.scan, cpshard.cli, cpshard.verify; "
            "from cpshard.mtp import mtp_loss; from cpshard.spawn import run_ranks; "
            "from cpshard.distributed import gather; from cpshard.loss import token_mean; "
            "print(cpshard.mtp.__name__, cpshard.spawn.__spec__.name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["cpshard.loss.mtp", "cpshard.testing.spawn"]


def test_the_plan_command_does_not_load_the_communication_layer():
    code = ("import sys, cpshard.tools.cli; print(sorted(m for m in sys.modules if m.startswith("
            "('cpshard.distributed', 'cpshard.testing', 'cpshard.loss'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_renderers_do_not_load_the_command_line():
    code = ("import sys, cpshard; cpshard.describe_plan(cpshard.ShardPlan.build([5, 3], cp_size=2)); "
            "print('cpshard.tools.cli' in sys.modules, sys.modules['cpshard.tools.describe'].__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "cpshard.tools.describe"]
