"""A small TOML writer for scenario dicts (the project has no tomli_w dependency).

Layout rules, chosen so a written scenario reads like the hand-written ones in scenarios/:
- top-level sections (`[cache]`, `[spec]`, ...) are tables; scalars of a table come first;
- a list of dicts is an array of tables (`[[workload.requests]]`);
- a dict below a section whose values are all plain (`acceptance = {kind = "forced", ...}`)
  is an inline table; one that holds tables itself (`[workload.synthetic]`) stays a table.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def dumps(data: dict[str, Any], header: str = "") -> str:
    """TOML text for `data`; `header` lines become leading `# ` comments."""
    lines = [f"# {h}".rstrip() for h in header.splitlines()]
    _table(lines, data, ())
    return "\n".join(lines).lstrip("\n") + "\n"


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _is_leaf_dict(v: Any) -> bool:
    return isinstance(v, dict) and not any(isinstance(x, dict) or _is_table_array(x)
                                           for x in v.values())


def _inline_here(v: Any, depth: int) -> bool:
    # Sections (depth 0 → keys of the document) are never inline; plain dicts below them are.
    plain = not isinstance(v, dict) and not _is_table_array(v)
    return plain or (depth >= 1 and _is_leaf_dict(v))


def _table(lines: list[str], data: dict[str, Any], path: tuple[str, ...]) -> None:
    depth = len(path)
    for k, v in data.items():
        if _inline_here(v, depth):
            lines.append(f"{_key(k)} = {_value(v)}")
    for k, v in data.items():
        if _inline_here(v, depth):
            continue
        sub = (*path, _key(k))
        if isinstance(v, dict):
            if not v and depth == 0:
                continue  # an empty section ([switches] = {}) is the default anyway
            if v and not any(_inline_here(x, depth + 1) for x in v.values()):
                _table(lines, v, sub)  # only sub-tables: their headers imply this one
                continue
            lines += ["", f"[{'.'.join(sub)}]"]
            _table(lines, v, sub)
        else:
            for item in v:
                lines += ["", f"[[{'.'.join(sub)}]]"]
                _table(lines, item, sub)


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON string escapes are valid TOML escapes
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")
