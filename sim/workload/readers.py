"""Row parsers for the trace formats: text in, validated columns out, or a precise error.

Line numbers are 1-based file lines (the Azure header is line 1). Rows before `start` are
skipped unparsed; reading stops after `limit` rows; a final newline (or none) is fine.
Timestamps must not decrease: both published formats are sorted, so a decrease means a
corrupted or hand-edited file, and silently sorting it would hide that.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date
from typing import Any

import numpy as np

from sim.workload.config import MAX_LEN, MAX_TRACE_ROWS
from sim.workload.spec import WorkloadError

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"
MOONCAKE_BLOCK = 512
_MAX_SPAN_NS = 2**62
_MAX_HASH_ID = 2**55  # a block id and a 9-bit token index share one uint64
_UNIX_DAY0 = date(1970, 1, 1).toordinal()
_AZURE_TS = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2}) ([0-9]{2}):([0-9]{2}):([0-9]{2})"
                       r"(?:\.([0-9]{1,9}))?")
_POSITIVE = re.compile(r"[0-9]+")


@dataclass(frozen=True, slots=True)
class TraceRows:
    arrival_ns: np.ndarray  # int64 [n], from the first row read
    prompt_len: np.ndarray  # int64 [n]
    output_len: np.ndarray  # int64 [n]
    hash_ids: list[np.ndarray] | None  # mooncake: int64 [ceil(prompt_len / 512)] per row


def _select(lines: list[str], first: int, start: int, limit: int | None,
            what: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of the data rows wanted; `first` = index of the first data line."""
    end = len(lines)
    while end > first and not lines[end - 1].strip():
        end -= 1
    lo = first + start
    hi = end if limit is None else min(end, lo + limit)
    if hi - lo > MAX_TRACE_ROWS:  # counted before a row is parsed
        raise WorkloadError(f"{what}: rows: at most {MAX_TRACE_ROWS} data rows per run, set "
                            f"workload.trace.limit (got {hi - lo})")
    for i in range(lo, hi):
        yield i + 1, lines[i]


def _clip(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _shown(value: Any) -> str:
    """A JSON value as the file spells it (strings quoted), clipped."""
    return _clip(json.dumps(value))


def _columns(times: list[int], prompt: list[int], output: list[int],
             hash_ids: list[np.ndarray] | None, what: str) -> TraceRows:
    rel = [t - times[0] for t in times] if times else []
    if rel and rel[-1] > _MAX_SPAN_NS:
        raise WorkloadError(f"{what}: rows span {rel[-1]} ns, more than 2**62")
    return TraceRows(np.array(rel, np.int64), np.array(prompt, np.int64),
                     np.array(output, np.int64), hash_ids)


def _check_order(t: int, prev: int | None, what: str, field: str) -> None:
    if prev is not None and t < prev:
        raise WorkloadError(f"{what}: field '{field}' must not decrease, got {t} ns after "
                            f"{prev} ns on the row before")


def azure_timestamp_ns(text: str) -> int | None:
    """`2023-11-16 18:17:03.9799600` as integer ns since the Unix epoch (UTC assumed); up to 9
    fractional digits (datetime takes 6, the trace has 7). None if malformed."""
    m = _AZURE_TS.fullmatch(text)
    if m is None:
        return None
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    if h > 23 or mi > 59 or s > 59:
        return None
    try:
        days = date(y, mo, d).toordinal() - _UNIX_DAY0
    except ValueError:
        return None
    frac = int((m[7] or "").ljust(9, "0"))
    return (days * 86400 + h * 3600 + mi * 60 + s) * 10**9 + frac


def _azure_positive(text: str, where: str, field: str) -> int:
    if _POSITIVE.fullmatch(text) is None or not text.strip("0"):
        raise WorkloadError(f"{where}: field '{field}' must be a positive int, got "
                            f"{_clip(text)!r}")
    if len(text.lstrip("0")) > 9 or int(text) > MAX_LEN:  # digits first: int() stops at 4,300
        raise WorkloadError(f"{where}: field '{field}' must be <= {MAX_LEN} tokens, got "
                            f"{_clip(text)}")
    return int(text)


def parse_azure(text: str, what: str, start: int, limit: int | None) -> TraceRows:
    lines = text.removeprefix("\ufeff").split("\n")
    head = lines[0].rstrip("\r")
    if head != AZURE_HEADER:
        raise WorkloadError(f"{what} line 1: expected header {AZURE_HEADER!r}, "
                            f"got {_clip(head)!r}")
    times: list[int] = []
    prompt: list[int] = []
    output: list[int] = []
    for ln, raw in _select(lines, 1, start, limit, what):
        where = f"{what} line {ln}"
        parts = raw.rstrip("\r").split(",")
        if len(parts) != 3:
            raise WorkloadError(f"{where}: expected 3 fields ({AZURE_HEADER}), got "
                                f"{len(parts)}: {_clip(raw.rstrip())!r}")
        t = azure_timestamp_ns(parts[0])
        if t is None:
            raise WorkloadError(f"{where}: field 'TIMESTAMP' must look like "
                                f"'2023-11-16 18:17:03.9799600', got {_clip(parts[0])!r}")
        _check_order(t, times[-1] if times else None, where, "TIMESTAMP")
        prompt.append(_azure_positive(parts[1], where, "ContextTokens"))
        output.append(_azure_positive(parts[2], where, "GeneratedTokens"))
        times.append(t)
    return _columns(times, prompt, output, None, what)


def _json_positive(row: dict[str, Any], where: str, field: str) -> int:
    v = row[field]
    if type(v) is not int or v < 1:
        raise WorkloadError(f"{where}: field '{field}' must be a positive int, got {_shown(v)}")
    if v > MAX_LEN:
        raise WorkloadError(f"{where}: field '{field}' must be <= {MAX_LEN} tokens, got "
                            f"{_shown(v)}")
    return v


def _mooncake_ms(row: dict[str, Any], where: str) -> int:
    v = row["timestamp"]
    # the range first: math.isfinite raises on an int too large for a float
    ok = type(v) in (int, float) and 0 <= v <= _MAX_SPAN_NS // 10**6 and math.isfinite(v)
    if not ok:
        raise WorkloadError(f"{where}: field 'timestamp' must be a non-negative number of ms, "
                            f"got {_shown(v)}")
    return v * 10**6 if type(v) is int else round(v * 1e6)


def _hash_ids(row: dict[str, Any], input_len: int, where: str) -> np.ndarray:
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(type(h) is int and 0 <= h < _MAX_HASH_ID
                                            for h in ids):
        raise WorkloadError(f"{where}: field 'hash_ids' must be a list of non-negative ints "
                            f"below 2**55, got {_shown(ids)}")
    need = -(-input_len // MOONCAKE_BLOCK)
    if len(ids) != need:
        raise WorkloadError(f"{where}: field 'hash_ids' has {len(ids)} ids, expected "
                            f"ceil(input_length / {MOONCAKE_BLOCK}) = {need}")
    return np.array(ids, np.int64)


def _mooncake_row(raw: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(raw)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise WorkloadError(f"{where}: nesting: a flat JSON object (got arrays or objects "
                            "nested past the parser's depth)") from None
    except ValueError as e:  # an integer past Python's int-string conversion limit
        raise WorkloadError(f"{where}: numbers: an integer of at most 64 bits "
                            f"({str(e).split(';')[0]})") from None
    if not isinstance(row, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {_shown(row)}")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in row:
            raise WorkloadError(f"{where}: missing field '{field}'")
    return row


def parse_mooncake(text: str, what: str, start: int, limit: int | None) -> TraceRows:
    times: list[int] = []
    prompt: list[int] = []
    output: list[int] = []
    hash_ids: list[np.ndarray] = []
    for ln, raw in _select(text.split("\n"), 0, start, limit, what):
        where = f"{what} line {ln}"
        row = _mooncake_row(raw, where)
        t = _mooncake_ms(row, where)
        _check_order(t, times[-1] if times else None, where, "timestamp")
        n_in = _json_positive(row, where, "input_length")
        output.append(_json_positive(row, where, "output_length"))
        hash_ids.append(_hash_ids(row, n_in, where))
        prompt.append(n_in)
        times.append(t)
    return _columns(times, prompt, output, hash_ids, what)
