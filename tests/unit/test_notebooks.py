"""The notebooks parse as jupytext percent scripts, import only the library (no logic), and their
executed copies (`notebooks/NAME.ipynb`) hold the same code cells, with outputs, under 300 KB.

Executing all four takes over a minute on a 2-core machine (cold sweep caches), so CI does not
run them; refresh an executed copy with
`jupytext --to ipynb notebooks/NAME.py && jupyter execute --inplace notebooks/NAME.ipynb`.
Cells are read without jupytext (CI installs no notebook extras); where jupytext is installed,
its reading of the script must agree.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

DIR = Path(__file__).parents[2] / "notebooks"
NOTEBOOKS = sorted(DIR.glob("*.py"))
LIBRARY = {"sim.api", "sim.cost", "sim.metrics", "sim.profiles", "sim.sweep"}


def _cells(path: Path) -> list[tuple[str, str]]:
    """(kind, source) of each `# %%` cell of a percent script; the header comment is skipped."""
    cells: list[tuple[str, list[str]]] = []
    for line in path.read_text().splitlines():
        if line.startswith("# %%"):
            cells.append(("markdown" if "[markdown]" in line else "code", []))
        elif cells:
            cells[-1][1].append(line)
    return [(kind, "\n".join(lines).strip()) for kind, lines in cells]


def _code(path: Path) -> list[str]:
    return [src for kind, src in _cells(path) if kind == "code"]


def test_the_four_notebooks_are_there() -> None:
    assert {p.stem for p in NOTEBOOKS} >= {"capacity_planning", "kv_headroom", "prefix_reuse",
                                           "fault_catalog"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_parses_and_holds_no_logic(path: Path) -> None:
    cells = _cells(path)
    code = _code(path)
    assert code and any(kind == "markdown" for kind, _ in cells)
    tree = ast.parse("\n".join(code))
    assert not [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m for m in mods if m and m.startswith("sim")} <= LIBRARY
    plain = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in plain if m.split(".")[0] == "sim"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_executed_copy_is_in_sync(path: Path) -> None:
    ipynb = path.with_suffix(".ipynb")
    refresh = f"jupytext --to ipynb notebooks/{path.name} && jupyter execute --inplace {ipynb.name}"
    assert ipynb.exists(), f"missing {ipynb.name}: {refresh}"
    assert ipynb.stat().st_size < 300_000, f"{ipynb.name}: {ipynb.stat().st_size} bytes"
    nb = json.loads(ipynb.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    src = ["".join(c["source"]).strip() for c in cells]
    assert src == _code(path), f"{ipynb.name} is stale: {refresh}"
    assert all(c.get("execution_count") for c in cells), f"{ipynb.name}: not executed"
    errors = [o for c in cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{ipynb.name}: {errors[0].get('ename')}: {errors[0].get('evalue')}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_jupytext_reads_the_same_cells(path: Path) -> None:
    jupytext = pytest.importorskip("jupytext", reason="pip install 'kvsim[notebooks]'")
    code = [c.source.strip() for c in jupytext.read(path).cells if c.cell_type == "code"]
    assert code == _code(path)
