"""The malformed-input corpus, generated (not hand-listed) from the scenario schema, a valid
workload trace and a valid kvsim trace.

Every `Case` is one CLI invocation that must exit 2 with one message naming `mentions` (the
file and the field), no traceback and nothing written. Scenario mutations walk the pydantic
models: each bounded number just past each bound, a wrong type for every leaf, an unknown key
in every table, every table replaced by a scalar, every required key dropped.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

import annotated_types
import pyarrow.parquet as pq
from pydantic import BaseModel

from sim.config import Scenario


@dataclass
class Case:
    name: str
    argv: list[str]
    mentions: list[str]  # substrings the one error message must contain
    out: Path | None = None  # must not exist afterwards
    files: dict[str, bytes] = field(default_factory=dict)  # written before the run


# -- a tiny TOML writer (inline tables), enough for mutated scenarios -----------------------------
class Raw(str):
    """A TOML token written as is (`nan`, `0xff...`): a Python value cannot spell them all."""


def toml_value(v: Any) -> str:
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(v)


def to_toml(d: dict[str, Any]) -> bytes:
    return "\n".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in d.items()).encode() + b"\n"


BASE: dict[str, Any] = {
    "seed": 3,
    "profile": "trtllm-post-17264",
    "model": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64, "max_position_embeddings": 512},
    "cache": {"tokens_per_block": 16, "num_blocks": 64, "reuse": "partial-copy",
              "max_blocks_per_seq": 0},
    "scheduler": {"max_batch_size": 4, "max_num_tokens": 512, "policy": "guaranteed-no-evict",
                  "chunk_size": 0},
    "spec": {"mode": "mtp", "max_draft_len": 2,
             "acceptance": {"kind": "rates", "rates": [0.8, 0.5]},
             "runtime_draft_lens": [], "extra_kv_tokens": 0},
    "overlap": {"enabled": True},
    "limits": {"max_seq_len": 256},
    "workload": {"requests": [{"arrival_ns": 0, "prompt_len": 40, "output_len": 4},
                              {"arrival_ns": 10, "prompt_len": 20, "output_len": 3}]},
}


def _copy(d: Any) -> Any:
    return json.loads(json.dumps(d))


def _set(d: dict, path: tuple, value: Any) -> dict:
    d = _copy(d)
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return d


def _drop(d: dict, path: tuple) -> dict:
    d = _copy(d)
    node = d
    for k in path[:-1]:
        node = node[k]
    del node[path[-1]]
    return d


def _model_of(path: tuple) -> type[BaseModel] | None:
    """The pydantic model holding the leaf at `path` in BASE (None if not a model field)."""
    model: Any = Scenario
    keys = [k for k in path if not isinstance(k, int)]
    for i, k in enumerate(keys[:-1]):
        ann = model.model_fields[k].annotation
        if get_origin(ann) is list:
            ann = get_args(ann)[0]
        cands = [a for a in (get_args(ann) or (ann,)) if isinstance(a, type)
                 and issubclass(a, BaseModel) and keys[i + 1] in a.model_fields]
        if not cands:
            return None
        model = cands[0]
    return model if keys[-1] in model.model_fields else None


def _bounds(model: type[BaseModel], name: str) -> list[Any]:
    """Values just outside the numeric bounds declared on `model.name`."""
    info = model.model_fields[name]
    out: list[Any] = []
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge):
            out.append(m.ge - 1 if isinstance(m.ge, int) else m.ge - 0.5)
        elif isinstance(m, annotated_types.Gt):
            out.append(m.gt if not isinstance(m.gt, int) else m.gt)
        elif isinstance(m, annotated_types.Le):
            out.append(m.le + 1 if isinstance(m.le, int) else m.le * 2)
    return out


def _leaves(d: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(d, list) and d and isinstance(d[0], dict):
        for i, v in enumerate(d):
            yield from _leaves(v, (*path, i))
    else:
        yield path, d


def _tables(d: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(d, dict):
        yield path
        for k, v in d.items():
            yield from _tables(v, (*path, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            if isinstance(v, dict):
                yield from _tables(v, (*path, i))


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def scenario_mutations() -> Iterator[tuple[str, bytes, str]]:
    """(name, file bytes, field the message must name)."""
    for path, value in _leaves(BASE):
        name, where = _dotted(path), path[-1]
        yield f"wrongtype-dict:{name}", to_toml(_set(BASE, path, {"x": 1})), str(where)
        if not isinstance(value, str):
            yield f"wrongtype-str:{name}", to_toml(_set(BASE, path, "oops")), str(where)
        if isinstance(value, int | float) and not isinstance(value, bool):
            model = _model_of(path)
            if model is not None:
                for bad in _bounds(model, str(where)):
                    yield f"bound:{name}={bad}", to_toml(_set(BASE, path, bad)), str(where)
        if path[:-1] and not isinstance(path[-1], int) and path[0] != "workload" or \
                (len(path) == 4 and path[-1] in ("arrival_ns", "output_len")):
            model = _model_of(path)
            if model is not None and model.model_fields[str(where)].is_required():
                yield f"missing:{name}", to_toml(_drop(BASE, path)), str(where)
    for path in _tables(BASE):
        yield (f"unknown-key:{_dotted(path) or 'top'}",
               to_toml(_set(BASE, (*path, "bogus_knob"), 1)), "bogus_knob")
        if path:
            yield f"table-as-scalar:{_dotted(path)}", to_toml(_set(BASE, path, 7)), str(path[-1])
    yield from _scenario_specials()


def _scenario_specials() -> Iterator[tuple[str, bytes, str]]:
    s = BASE
    yield "missing-workload", to_toml(_drop(s, ("workload",))), "workload"
    yield "empty-workload", to_toml(_set(s, ("workload",), {})), "workload"
    yield "empty-requests", to_toml(_set(s, ("workload", "requests"), [])), "requests"
    yield ("draft>max_seq_len", to_toml(_set(_set(s, ("spec", "max_draft_len"), 60),
                                              ("limits", "max_seq_len"), 32)), "max_draft_len")
    yield ("max_seq_len>max_pos", to_toml(_set(s, ("limits", "max_seq_len"), 4096)),
           "max_seq_len")
    yield "gqa", to_toml(_set(s, ("model", "num_kv_heads"), 3)), "num_kv_heads"
    yield "blocks-1e12", to_toml(_set(s, ("cache", "num_blocks"), 10**12)), "num_blocks"
    yield ("kv-slots-absurd", to_toml(_set(_set(s, ("cache", "num_blocks"), 10**7),
                                           ("cache", "tokens_per_block"), 1024)), "num_blocks")
    big = _set(_set(s, ("scheduler", "max_batch_size"), 4096),
               ("cache", "max_blocks_per_seq"), 10**7)
    yield "block-table-absurd", to_toml(big), "max_blocks_per_seq"
    yield "huge-int", to_toml(_set(s, ("cache", "num_blocks"), 10**30)), "num_blocks"
    yield "float-int", to_toml(_set(s, ("cache", "num_blocks"), 64.5)), "num_blocks"
    yield "nan", b"seed = nan\n" + to_toml(_drop(s, ("seed",))), "seed"
    yield "inf-rate", to_toml(_set(s, ("spec", "acceptance", "rates"), [float("inf")])), "rates"
    yield "bad-profile", to_toml(_set(s, ("profile",), "no-such-engine")), "no-such-engine"
    yield "bad-switch", to_toml(_set(s, ("switches",), {"no_such_switch": True})), \
        "no_such_switch"
    yield "bad-switch-value", to_toml(_set(s, ("switches",), {"backend": "cuda9"})), "backend"
    yield "non-utf8", b"seed = 1\n# \xff\xfe\n" + to_toml(_drop(s, ("seed",))), "UTF-8"
    yield "invalid-toml", b"[cache\nnum_blocks = 3\n", "TOML"
    yield "invalid-toml-dup", b"seed = 1\nseed = 2\n", "TOML"
    yield "empty-file", b"", "workload"
    yield "binary", bytes(range(256)), "UTF-8"


# -- workload traces (Azure CSV, Mooncake JSONL) -----------------------------------------------
AZ_HEAD = b"TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ_ROWS = [b"2023-11-16 18:15:46.6805900,374,44", b"2023-11-16 18:15:50.9951690,396,109",
           b"2023-11-16 18:15:51.2000000,879,45"]


def _mc(t: Any = 0, n: Any = 600, o: Any = 5, h: Any = None, drop: str = "") -> bytes:
    row = {"timestamp": t, "input_length": n, "output_length": o,
           "hash_ids": [1, 2] if h is None else h}
    row.pop(drop, None)
    return json.dumps(row).encode()


def workload_mutations() -> Iterator[tuple[str, str, bytes, str]]:
    """(name, format, trace file bytes, field the message must name)."""
    ok = AZ_ROWS
    az: list[tuple[str, bytes, str]] = [
        ("header", b"time,ctx,gen\n" + b"\n".join(ok), "header"),
        ("missing-field", AZ_HEAD + ok[0] + b"\n2023-11-16 18:15:47.0,12\n", "line 3"),
        ("negative-ctx", AZ_HEAD + b"2023-11-16 18:15:46.6805900,-374,44\n", "ContextTokens"),
        ("zero-gen", AZ_HEAD + b"2023-11-16 18:15:46.6805900,374,0\n", "GeneratedTokens"),
        ("float-len", AZ_HEAD + b"2023-11-16 18:15:46.6805900,37.5,4\n", "ContextTokens"),
        ("unsorted", AZ_HEAD + ok[1] + b"\n" + ok[0] + b"\n", "TIMESTAMP"),
        ("bad-time", AZ_HEAD + b"yesterday,374,44\n", "TIMESTAMP"),
        ("bad-date", AZ_HEAD + b"2023-02-30 18:15:46.6805900,374,44\n", "TIMESTAMP"),
        ("truncated", AZ_HEAD + b"\n".join(ok)[:-12], "line 4"),
        ("non-utf8", AZ_HEAD + ok[0] + b"\n\xff\xfe,1,2\n", "UTF-8"),
        ("header-only", AZ_HEAD, "no data rows"),
        ("empty", b"", "header"),
        ("extra-field", AZ_HEAD + ok[0] + b",7\n", "3 fields"),
    ]
    for name, data, fld in az:
        yield f"azure-{name}", "azure2023", data, fld
    mc = [
        *[(f"missing-{f}", _mc(drop=f), f) for f in
          ("timestamp", "input_length", "output_length", "hash_ids")],
        ("negative-input", _mc(n=-5, h=[]), "input_length"),
        ("zero-output", _mc(o=0), "output_length"),
        ("string-time", _mc(t="now"), "timestamp"),
        ("nan-time", _mc(t=float("nan")), "timestamp"),
        ("negative-time", _mc(t=-1), "timestamp"),
        ("unsorted", _mc(t=100) + b"\n" + _mc(t=50), "timestamp"),
        ("hash-count", _mc(h=[1]), "hash_ids"),
        ("hash-negative", _mc(h=[1, -2]), "hash_ids"),
        ("hash-not-list", _mc(h="abc"), "hash_ids"),
        ("bool-length", _mc(n=True, h=[1]), "input_length"),
        ("truncated", _mc() + b"\n" + _mc(t=5)[:-9], "line 2"),
        ("not-object", b"[1, 2, 3]\n", "JSON object"),
        ("non-utf8", _mc() + b"\n\xc3\x28\n", "UTF-8"),
        ("empty", b"", "no data rows"),
    ]
    for name, data, fld in mc:
        yield f"mooncake-{name}", "mooncake", data, fld


def trace_scenario(trace_file: Path, fmt: str) -> bytes:
    d = _copy(BASE)
    d["model"]["max_position_embeddings"] = 4096
    d["limits"]["max_seq_len"] = 4096
    d["workload"] = {"trace": {"path": str(trace_file), "format": fmt}}
    return to_toml(d)


# -- kvsim trace directories for check / metrics / timeline -----------------------------------
TABLES = ("steps", "rows", "requests", "blocks", "violations")
Mutator = Callable[[Path], None]


def _edit_manifest(fn: Callable[[dict], Any]) -> Mutator:
    def go(d: Path) -> None:
        m = json.loads((d / "manifest.json").read_text())
        fn(m)
        (d / "manifest.json").write_text(json.dumps(m))
    return go


def _write(rel: str, data: bytes | Callable[[bytes], bytes]) -> Mutator:
    def go(d: Path) -> None:
        p = d / rel
        p.write_bytes(data(p.read_bytes()) if callable(data) else data)
    return go


def _drop_column(table: str) -> Mutator:
    def go(d: Path) -> None:
        t = pq.read_table(d / f"{table}.parquet")
        pq.write_table(t.drop_columns([t.column_names[0]]), d / f"{table}.parquet")
    return go


def _setitem(path: tuple, value: Any) -> Callable[[dict], None]:
    def go(m: dict) -> None:
        node = m
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return go


def _delitem(*path: str) -> Callable[[dict], None]:
    def go(m: dict) -> None:
        node = m
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
    return go


def trace_mutations() -> Iterator[tuple[str, Mutator, str]]:
    """(name, mutation of a copy of a valid trace dir, text the message must name)."""
    for t in TABLES:
        f = f"{t}.parquet"
        yield f"missing-{t}", lambda d, f=f: (d / f).unlink(), f
        yield f"truncated-{t}", _write(f, lambda b: b[: len(b) // 2]), f
        yield f"empty-{t}", _write(f, b""), f
        yield f"garbage-{t}", _write(f, b"PAR1 not really parquet PAR1"), f
        yield f"dropcol-{t}", _drop_column(t), f
        yield f"table-is-dir-{t}", lambda d, f=f: ((d / f).unlink(), (d / f).mkdir()), f
    m = "manifest.json"
    yield "manifest-missing", lambda d: (d / m).unlink(), m
    yield "manifest-garbage", _write(m, b"{not json"), m
    yield "manifest-truncated", _write(m, lambda b: b[: len(b) // 2]), m
    yield "manifest-array", _write(m, b"[1, 2]"), m
    yield "manifest-non-utf8", _write(m, b'{"complete": true, "x": "\xff"}'), m
    yield "manifest-empty", _write(m, b""), m
    for v in (4, 0, "3", None):  # readable: 1, 2 and 3 (ints)
        yield f"format_version={v}", _edit_manifest(_setitem(("format_version",), v)), \
            "format_version"
    for v in (1, 2):  # readable, but the trace is format 3: its digest is not theirs
        yield f"format_version={v}-of-a-3", _edit_manifest(_setitem(("format_version",), v)), \
            "digest"
    yield "format_version-missing", _edit_manifest(_delitem("format_version")), "format_version"
    yield "digest-mismatch", _edit_manifest(_setitem(("digest",), "0" * 64)), "digest"
    yield "digest-missing", _edit_manifest(_delitem("digest")), "digest"
    yield "digest-int", _edit_manifest(_setitem(("digest",), 7)), "digest"
    yield "complete-missing", _edit_manifest(_delitem("complete")), "complete"
    yield "complete-false", _edit_manifest(_setitem(("complete",), False)), "complete"
    yield "complete-string", _edit_manifest(_setitem(("complete",), "true")), "complete"
    yield "counts-mismatch", _edit_manifest(_setitem(("counts", "steps"), 10**6)), "counts.steps"
    yield "counts-not-dict", _edit_manifest(_setitem(("counts",), [1])), "counts"
    yield "model-missing", _edit_manifest(_delitem("model")), "model"
    yield "model-not-dict", _edit_manifest(_setitem(("model",), "llama")), "model"
    for k, v in (("num_blocks", 10**12), ("num_blocks", -4), ("num_blocks", "64"),
                 ("num_blocks", 0), ("tokens_per_block", 0), ("tokens_per_block", 10**9),
                 ("tokens_per_block", 2.5), ("num_blocks", True)):
        yield f"model.{k}={v!r}", _edit_manifest(_setitem(("model", k), v)), k
    yield "model.null_block-str", _edit_manifest(_setitem(("model", "null_block"), "no")), \
        "null_block"
    yield "dir-is-a-file", lambda d: (shutil.rmtree(d), d.write_text("x")), "trace"
