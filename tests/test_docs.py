"""Every Python block of README.md and docs/*.md runs as written, and the pages say nothing users cannot use.

A block is a complete program (its imports included), run as it stands: one that starts ranks with
``run_ranks`` as a script in a fresh interpreter (``python block.py``, the ranks spawned as users get them),
the others in this process. A block that is not a whole program is marked ``<!-- excerpt: PATH -->`` on
the line above it: its text must be part of PATH, a file that the suite runs. The site itself is built with
``mkdocs build --strict`` by scripts/test.sh.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:<!-- excerpt: (?P<excerpt>\S+) -->\n)?```python\n(?P<code>.*?)```", re.S)
# the files that the suite runs, and where (a block may be an excerpt of these only)
RUN_BY_THE_SUITE = {"examples/train_step.py": "tests/test_readme.py::test_the_training_step_example_runs",
                    "tests/torch_cp_ranks.py":
                        "tests/test_torch_cp_distributed.py::test_flex_attention_under_cp_equals_cp1"}
# packages some blocks need that scripts/setup.sh can be told to skip (CPSHARD_MEGATRON=0, CPSHARD_NO_VERL=1,
# CPSHARD_NO_TORCHTITAN=1)
OPTIONAL = {"cpshard.megatron": "megatron", "cpshard.compat": "megatron", "verl": "verl",
            "torchtitan": "torchtitan", "transformers": "transformers"}


def _blocks() -> list[tuple[str, str, str | None]]:
    found = []
    for page in PAGES:
        for n, match in enumerate(BLOCK.finditer(page.read_text()), 1):
            found.append((f"{page.relative_to(ROOT)}#{n}", match["code"], match["excerpt"]))
    return found


BLOCKS = _blocks()


def _needs(code: str) -> list[str]:
    missing = [pkg for name, pkg in OPTIONAL.items() if re.search(rf"^\s*(from|import) {re.escape(name)}\b", code, re.M)
               and importlib.util.find_spec(pkg) is None]
    return sorted(set(missing))


def test_the_pages_hold_python_blocks():
    assert len([b for b in BLOCKS if b[0].startswith("README.md")]) >= 2
    assert len(BLOCKS) >= 10, [b[0] for b in BLOCKS]


@pytest.mark.parametrize("name,code,excerpt", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_every_python_block_runs_as_written(name, code, excerpt, tmp_path, monkeypatch):
    if excerpt is not None:
        source = ROOT / excerpt
        assert source.is_file(), f"{name}: marked as an excerpt of {excerpt}, which does not exist"
        assert code in source.read_text(), f"{name}: not (any longer) a part of {excerpt}"
        assert excerpt in RUN_BY_THE_SUITE, f"{name}: {excerpt} is not a file that the suite runs"
        return
    missing = _needs(code)
    if missing:
        where = ("scripts/test.sh runs it in its torchtitan pass, .venv-torchtitan first on the path"
                 if missing == ["torchtitan"] else "scripts/setup.sh was told to skip it")
        pytest.skip(f"{name} needs {', '.join(missing)}, absent here: {where}")
    if "run_ranks" in code:
        assert 'if __name__ == "__main__":' in code, f"{name}: a script that calls run_ranks needs the guard"
        script = tmp_path / "block.py"
        script.write_text(code)
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{name} failed:\n{done.stdout}\n{done.stderr}"
        return
    monkeypatch.chdir(tmp_path)
    exec(compile(code, name, "exec"), {"__name__": "__main__"})


# Words that users cannot use: private modules, internal issue numbers, an API that is gone.
PRIVATE = re.compile(r"cpshard[./]_[a-z]|(?<![\w.])_(exchange|relayout|balance|refine|hybrid|indices|index|halo|agree|"
                     r"header|parse|verl_pack|verl_rows|import|deps|dtypes|errors|types)\b|\bissue \d+|token_runs",
                     re.IGNORECASE)


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "ARCHITECTURE.md"], ids=lambda p: p.name)
def test_no_private_module_issue_number_or_removed_api_where_users_read(page):
    """ARCHITECTURE.md is the maintainers' map of the modules, private ones included."""
    hits = [f"{page.name}:{n}: {line.strip()}" for n, line in enumerate(page.read_text().splitlines(), 1)
            if PRIVATE.search(line)]
    assert not hits, "\n".join(hits)


def test_relative_links_of_the_readme_lead_to_files():
    """The docs site checks its own links (mkdocs --strict); the README is read on its own."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    broken = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not broken, broken


def test_every_docs_page_is_in_the_site_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if f": {p}" not in config] == []


def test_the_changelog_is_by_version_and_names_this_one():
    """Keep a Changelog: [Unreleased] on top, then versions newest first; the newest is the package's."""
    import cpshard

    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)[1]
    heads = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert heads[0] == "Unreleased" and heads[1] == version == cpshard.__version__, (heads, version)
    assert heads[1:] == sorted(heads[1:], key=lambda v: tuple(map(int, v.split("."))), reverse=True)
