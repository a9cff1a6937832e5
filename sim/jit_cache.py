"""numba's on-disk cache, keyed on a whole package's sources.

numba invalidates a cached kernel when the file defining it changes, not when a helper it
inlines from a sibling module does: edit `sim/check/compiled/rows.py` and `kernel.run` would
load the stale machine code. Packages of kernels call `drop_stale(__file__)` on import, before
anything compiles: a changed source hash empties their cache.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_STAMP = "kvsim-sources.sha256"


def drop_stale(package_file: str) -> None:
    pkg = Path(package_file).resolve().parent
    digest = hashlib.sha256()
    for src in sorted(pkg.glob("*.py")):
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    cache, want = pkg / "__pycache__", digest.hexdigest()
    stamp = cache / _STAMP
    try:
        if stamp.read_text() == want:
            return
    except OSError:
        pass  # first import, or never written
    try:
        for f in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            f.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        tmp = cache / f"{_STAMP}.{os.getpid()}"  # atomic: pytest workers import concurrently
        tmp.write_text(want)
        os.replace(tmp, stamp)
    except OSError:
        pass  # a read-only install: numba then caches elsewhere or not at all
