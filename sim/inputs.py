"""Reading the files a user hands in (scenario and sweep TOML, calibration JSON, workload traces)
without letting one of them take the machine: every reader here checks before it allocates.

- Only a regular file is opened: a FIFO would block for ever, `/dev/zero` never ends, a folder
  is a mistake. A symlink is followed and its target checked.
- At most `max_bytes` are read (the file's size is checked first, the read is capped too, as a
  file can grow between the two).
- A parsed tree may nest at most `MAX_DEPTH` tables and arrays, and hold no integer wider than
  64 bits. Deeper data would exhaust the parsers' recursion. Python refuses to convert an
  integer of more than 4,300 digits, failing the parse without naming the field, so files are
  parsed with that limit raised to `MAX_DIGITS` (cheap at that size) and the field is named.

Each error is one line, `<file>: <field>: <what is allowed> (got ...)`, raised as the caller's
`KvsimError` subclass so the CLI prints it and exits 2.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sim.errors import KvsimError, ScenarioError

MAX_DEPTH = 64  # tables and arrays inside each other; real files use four or five
MAX_INT = 2**64  # |n| below this: every kvsim integer is an int64 or uint64
MAX_DIGITS = 20_000  # digits of one integer the parsers convert; the file is refused past it
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
          (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def shown(value: Any) -> str:
    """A value as an error message shows it: short, and never an error itself (Python raises
    on `repr` of an integer of more than 4,300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= MAX_INT:
        return f"an integer of {value.bit_length()} bits"
    return _clip(repr(value))


def _clip(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def read_input(path: str | Path, what: str, max_bytes: int,
               error: type[KvsimError] = ScenarioError) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them.

    Raises `error` naming the file when it is missing, not a regular file, or too large.
    """
    p = Path(path)
    try:
        check_kind(p, what, os.stat(p), error)  # before opening: opening a device can act
        # O_NONBLOCK: should a FIFO have taken the file's place since, opening it won't block
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            check_kind(p, what, st, error)
            _check_size(p, what, st.st_size, max_bytes, error)
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{p}: cannot read {what}: {e.strerror or e}") from None
    _check_size(p, what, len(raw), max_bytes, error)
    return raw


def check_kind(p: Path, what: str, st: os.stat_result, error: type[KvsimError]) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a file")
        raise error(f"{p}: {what}: must be a regular file (got {kind})")


def _check_size(p: Path, what: str, size: int, max_bytes: int,
                error: type[KvsimError]) -> None:
    if size > max_bytes:
        raise error(f"{p}: {what}: size: at most {max_bytes} bytes (got {size} or more)")


def decode_text(raw: bytes, p: str | Path, error: type[KvsimError] = ScenarioError) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}: not UTF-8 text (byte {e.start})") from None


def load_toml(path: str | Path, what: str, max_bytes: int) -> dict[str, Any]:
    """A TOML file as a dict, checked by `check_tree`. Raises ScenarioError."""
    data: dict[str, Any] = _load(path, what, max_bytes, tomllib.loads, tomllib.TOMLDecodeError,
                                 "TOML", finite=False)
    return data


def load_json(path: str | Path, what: str, max_bytes: int) -> Any:
    """A JSON file, checked by `check_tree` with `finite=True` (NaN, Infinity and numbers that
    overflow to infinity are refused, naming the field). Raises ScenarioError."""
    return _load(path, what, max_bytes, json.loads, json.JSONDecodeError, "JSON", finite=True)


def _load(path: str | Path, what: str, max_bytes: int, parse: Callable[[str], Any],
          syntax: type[ValueError], lang: str, finite: bool) -> Any:
    text = decode_text(read_input(path, what, max_bytes), path)
    try:
        with long_integers():
            data = parse(text)
    except syntax as e:  # before ValueError: both decode errors are ValueErrors
        raise ScenarioError(f"{path}: invalid {lang}: {e}") from None
    except RecursionError:
        raise _too_deep(path, text) from None
    except ValueError:  # an integer past even MAX_DIGITS
        raise _too_long(path, text) from None
    check_tree(data, str(path), finite=finite)
    return data


@contextmanager
def long_integers() -> Iterator[None]:
    """Parse integers of up to MAX_DIGITS digits (Python's default stops at 4,300) so that the
    caller can name the field that holds one."""
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(max(old, MAX_DIGITS))
    try:
        yield
    finally:
        sys.set_int_max_str_digits(old)


def _too_deep(path: str | Path, text: str) -> ScenarioError:
    """The parser ran out of recursion: name the line where the brackets pass MAX_DEPTH
    (counted roughly, strings included: it only places the message)."""
    depth = 0
    for n, line in enumerate(text.splitlines(), 1):
        for ch in line:
            depth += (ch in "[{") - (ch in "]}")
            if depth > MAX_DEPTH:
                return ScenarioError(f"{path}: line {n}{_key(line)}: nesting: at most "
                                     f"{MAX_DEPTH} tables and arrays deep (got deeper)")
    return ScenarioError(f"{path}: nesting: at most {MAX_DEPTH} tables and arrays deep")


def _too_long(path: str | Path, text: str) -> ScenarioError:
    m = re.search(f"[0-9]{{{MAX_DIGITS},}}", text)
    n = text.count("\n", 0, m.start()) + 1 if m else 0
    line = text.splitlines()[n - 1] if m else ""
    where = f"line {n}{_key(line)}" if m else "integers"
    return ScenarioError(f"{path}: {where}: an integer of at most 64 bits (got one of more "
                         f"than {MAX_DIGITS} digits)")


def _key(line: str) -> str:
    """` (key)` for a `key = value` or `"key": value` line, else nothing."""
    m = re.match(r'\s*"?([A-Za-z0-9_.-]+)"?\s*[=:]', line)
    return f" ({m[1]})" if m else ""


def check_tree(data: Any, where: str, finite: bool = False,
               error: type[KvsimError] = ScenarioError) -> None:
    """Refuse nesting deeper than MAX_DEPTH and integers of 64 bits or more anywhere in a parsed
    file (and, with `finite`, NaN and infinities). Iterative: the tree may be deep."""
    _check_value(data, (), where, finite, error)
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict | list):
            continue  # a scalar: checked by its parent
        if len(path) >= MAX_DEPTH:
            raise error(f"{where}: {_field(path)}: at most {MAX_DEPTH} tables and arrays "
                        "deep (got deeper)")
        if _small_numbers(node, finite):
            continue  # a list of numbers, checked in C
        for k, v in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(v, dict | list):
                stack.append((v, (*path, k)))
            else:
                _check_value(v, (*path, k) if _bad(v, finite) else (), where, finite, error)


def _bad(v: Any, finite: bool) -> bool:
    if type(v) is int:
        return abs(v) >= MAX_INT
    return finite and type(v) is float and not math.isfinite(v)


def _check_value(v: Any, path: tuple[Any, ...], where: str, finite: bool,
                 error: type[KvsimError]) -> None:
    if not _bad(v, finite):
        return
    if type(v) is int:
        raise error(f"{where}: {_field(path)}: an integer of at most 64 bits (got {shown(v)})")
    raise error(f"{where}: {_field(path)}: a finite number (got {v})")


def _field(path: tuple[Any, ...]) -> str:
    return _clip(".".join(str(k) for k in path) or "top")


def _small_numbers(node: dict | list, finite: bool) -> bool:
    """True for a list of numbers only, all below MAX_INT (and finite, with `finite`). min/max
    compare in C and raise on a list or a table among numbers; a NaN among them is left to
    the element-wise walk, which names it."""
    if not isinstance(node, list) or not node:
        return False
    try:
        lo, hi = min(node), max(node)
    except TypeError:
        return False
    if not all(isinstance(v, int | float) and abs(v) < MAX_INT for v in (lo, hi)):
        return False
    return not finite or all(map(math.isfinite, node))
