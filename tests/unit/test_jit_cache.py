"""sim/jit_cache.py: a change to any source of a kernel package empties its numba cache
(numba alone only notices a change to the file that defines the kernel)."""

from __future__ import annotations

from sim.jit_cache import drop_stale


def _package(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "kernel.py").write_text("from pkg.helpers import h\n")
    (pkg / "helpers.py").write_text("def h(): return 1\n")
    return pkg


def _cached(pkg):
    for name in ("kernel.run-3.py311.nbi", "kernel.run-3.py311.1.nbc"):
        (pkg / "__pycache__" / name).write_bytes(b"machine code")
    return pkg / "__pycache__" / "kernel.run-3.py311.nbi"


def test_unchanged_sources_keep_the_cache(tmp_path):
    pkg = _package(tmp_path)
    drop_stale(str(pkg / "__init__.py"))
    entry = _cached(pkg)
    drop_stale(str(pkg / "__init__.py"))
    assert entry.exists()


def test_an_edited_helper_module_empties_the_cache(tmp_path):
    pkg = _package(tmp_path)
    drop_stale(str(pkg / "__init__.py"))
    entry = _cached(pkg)
    (pkg / "helpers.py").write_text("def h(): return 2\n")  # kernel.py itself is untouched
    drop_stale(str(pkg / "__init__.py"))
    assert not entry.exists() and not list((pkg / "__pycache__").glob("*.nbc"))
