"""Results cached by content: sha256 of the normalized scenario JSON, the contents of the files
it reads (workload trace, calibration) and the kvsim version.

One JSON file per simulated run under DIR/cache/<2 hex>/<hash>.json, written to a temporary name
and renamed, so an interrupted sweep resumes from whatever finished and never reads a half entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def content_key(scenario: dict, version: str, base_dir: str,
                inputs: dict[str, str] | None = None) -> str:
    """`inputs`: a digest per file the scenario reads, so an edited trace is not a hit."""
    blob = json.dumps({"scenario": scenario, "kvsim": version, "base_dir": base_dir,
                       "inputs": inputs or {}}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes; "" when it cannot be read (the run then names the error)."""
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return ""
    return h.hexdigest()


class ResultCache:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict | None:
        try:
            return json.loads(self.path(key).read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def put(self, key: str, value: dict) -> None:
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(value))  # insertion order: the results table's column order
        os.replace(tmp, p)
