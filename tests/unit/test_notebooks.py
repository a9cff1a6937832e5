"""The notebooks parse as jupytext percent scripts and import only the library (no logic).

Executing them runs real sweeps (minutes on a 2-core machine), so CI only parses them; run
`jupytext --to ipynb --execute notebooks/*.py` to refresh the executed copies.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.py"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_parses(path: Path) -> None:
    jupytext = pytest.importorskip("jupytext", reason="pip install 'kvsim[notebooks]'")
    nb = jupytext.read(path)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert code and any(c.cell_type == "markdown" for c in nb.cells)
    tree = ast.parse("\n".join(code))
    assert not [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)]
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    ours = {m for m in mods if m and m.startswith("sim")}
    assert ours <= {"sim.cost", "sim.sweep", "sim.metrics"}
