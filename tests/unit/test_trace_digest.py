"""The trace's content digest (sim/trace/digest.py) in every format: the per-column hash is
sha256 for formats 1 and 2, xxh3-128 for format 3, over the same canonical bytes; chunking never
counts, a changed value always does (and read_trace refuses it)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from sim.api import load_scenario, run
from sim.errors import TraceError
from sim.trace.digest import HASHERS, TableDigest
from sim.trace.reader import read_trace
from sim.trace.records import FORMAT_VERSION, READABLE_VERSIONS

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = pa.schema([pa.field("i", pa.int64(), nullable=False),
                    pa.field("h", pa.uint64(), nullable=False),
                    pa.field("s", pa.string(), nullable=False),
                    pa.field("b", pa.bool_(), nullable=False),
                    pa.field("l", pa.list_(pa.int32()), nullable=False)])


def _table(n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, 4, n)
    return pa.table({
        "i": pa.array(rng.integers(-5, 5, n), pa.int64()),
        "h": pa.array(rng.integers(0, 2**63, n, dtype=np.uint64), pa.uint64()),
        "s": pa.array([["", "ab", "xyz"][k] for k in rng.integers(0, 3, n)], pa.string()),
        "b": pa.array(rng.integers(0, 2, n).astype(bool), pa.bool_()),
        "l": pa.array([rng.integers(-1, 9, k).tolist() for k in lens], pa.list_(pa.int32())),
    }, schema=SCHEMA)


def _digest(t: pa.Table | pa.RecordBatch, version: int) -> str:
    d = TableDigest("t", SCHEMA, version)
    d.update(t)
    return d.hexdigest()


def test_formats_1_and_2_hash_with_sha256_and_3_with_xxh3_128():
    assert HASHERS == {1: hashlib.sha256, 2: hashlib.sha256, 3: xxhash.xxh3_128}
    assert FORMAT_VERSION == 3 and READABLE_VERSIONS == (1, 2, 3)
    t = _table(50)
    by_version = {v: _digest(t, v) for v in READABLE_VERSIONS}
    assert by_version[1] == by_version[2] != by_version[3]
    # the canonical bytes are the same whichever the hash: an int64 column is its data buffer,
    # a list column its int32 values then its int32 lengths
    ints = np.array(t.column("i").to_pylist(), np.int64).tobytes()
    lst = t.column("l").combine_chunks()
    values = np.array(lst.values.to_pylist(), np.int32).tobytes()
    lengths = np.diff(np.array(lst.offsets.to_pylist(), np.int32)).astype(np.int32).tobytes()
    for v, new in HASHERS.items():
        d = TableDigest("t", SCHEMA, v)
        d.update(t)
        assert d.h["i"][0].digest() == new(ints).digest()
        assert (d.h["l"][0].digest(), d.h["l"][1].digest()) == (new(values).digest(),
                                                                 new(lengths).digest())


@given(n=st.integers(0, 60), cuts=st.lists(st.integers(0, 60), max_size=5),
       version=st.sampled_from(READABLE_VERSIONS))
def test_the_digest_ignores_chunking_in_every_format(n, cuts, version):
    """Chunks of any size (empty ones too, and slices: arrays with an offset), record batches or
    one table: one digest."""
    t = _table(n)
    bounds = [0, *sorted(c for c in cuts if c <= n), n]
    chunked = pa.concat_tables([t.slice(a, b - a) for a, b in zip(bounds, bounds[1:],
                                                                   strict=False)])
    whole = _digest(t, version)
    assert _digest(chunked, version) == whole
    d = TableDigest("t", SCHEMA, version)
    for batch in chunked.to_batches():
        d.update(batch)
    assert d.hexdigest() == whole
    if n:
        assert _digest(_table(n, seed=1), version) != whole


# -- a format 3 trace with one value changed is refused ---------------------------------------
def _flip_first(col: pa.ChunkedArray) -> pa.Array:
    """The column with its first value changed (same type and length)."""
    a = col.combine_chunks()
    t = a.type
    if pa.types.is_boolean(t):
        return pa.concat_arrays([pc.invert(a[:1]), a[1:]])
    if pa.types.is_string(t):
        return pa.concat_arrays([pa.array([a[0].as_py() + "x"], t), a[1:]])
    if pa.types.is_list(t):  # one id of the first non-empty list
        vals = np.array(a.values.to_pylist(), np.int32)
        vals[0] += 1
        return pa.ListArray.from_arrays(a.offsets, pa.array(vals, pa.int32()))
    return pa.concat_arrays([pa.array([a[0].as_py() ^ 1], t), a[1:]])


def _move_boundary(col: pa.ChunkedArray) -> pa.Array:
    """The same ids, the first list one shorter and the second one longer."""
    a = col.combine_chunks()
    off = np.array(a.offsets.to_pylist(), np.int32)
    assert off[1] > off[0]
    off[1] -= 1
    return pa.ListArray.from_arrays(pa.array(off, pa.int32()), a.values)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sc, base = load_scenario(ROOT / "scenarios" / "worked_example.toml")
    out = run(sc, out=tmp_path_factory.mktemp("t") / "t", base_dir=base).trace_dir
    assert out is not None
    return out


@pytest.mark.parametrize("table, column, change", [
    ("steps", "num_tokens", _flip_first),  # int64
    ("rows", "first_gen", _flip_first),  # bool
    ("rows", "pages", _flip_first),  # list values (the stored tails)
    ("rows", "pages", _move_boundary),  # list lengths only
    ("rows", "prev_row", _flip_first),  # a delta-encoding column
    ("blocks", "event", _flip_first),  # string
    ("blocks", "hash", _flip_first),  # uint64
    ("requests", "prompt_tokens", _flip_first),
])
def test_a_changed_value_in_a_format_3_trace_is_a_digest_mismatch(
        tmp_path: Path, trace: Path, table: str, column: str,
        change: Callable[[pa.ChunkedArray], pa.Array]) -> None:
    assert read_trace(trace).manifest["format_version"] == 3
    root = tmp_path / "t"
    shutil.copytree(trace, root)
    f = root / f"{table}.parquet"
    t = pq.read_table(f)
    i = t.schema.get_field_index(column)
    pq.write_table(t.set_column(i, t.schema.field(i), change(t.column(i))), f)
    with pytest.raises(TraceError) as err:
        read_trace(root)
    digest = json.loads((root / "manifest.json").read_text())["digest"]
    assert str(err.value).startswith(f"{root}: digest mismatch: manifest.json says {digest}, "
                                     "the tables hash to ")
