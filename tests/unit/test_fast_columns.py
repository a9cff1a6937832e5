"""The fast engine's column builders (sim/fast/columns.py) against the plain constructions they
replace: the trace stores the same values either way (test_fast.py holds whole traces equal)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from sim.fast import fields as fl
from sim.fast.columns import _positions_of, _pylist, _slices, positions
from sim.trace.digest import TableDigest
from sim.trace.records import FORMAT_VERSION
from sim.trace.writer import columnar_arrow, strings

_NAMES = ("alloc", "free", "done")  # names of different lengths


def _digest(col: pa.Array) -> str:
    schema = pa.schema([pa.field("event", pa.string(), nullable=False)])
    d = TableDigest("blocks", schema, FORMAT_VERSION)
    d.update(pa.table({"event": col}, schema=schema))
    return d.hexdigest()


@pytest.mark.parametrize("codes", [[], [0], [2, 0, 1, 1, 2], [1] * 7])
def test_strings_are_the_python_strings(codes):
    got = strings(np.array(codes, np.int64), _NAMES)
    want = pa.array([_NAMES[c] for c in codes], pa.string())
    assert got.equals(want)
    assert _digest(got) == _digest(want)
    assert _pylist(got) == [_NAMES[c] for c in codes]


def test_strings_pass_through_the_writer_and_a_wrong_type_is_refused():
    col = strings(np.array([1, 0]), ("ctx", "gen"))
    assert columnar_arrow(col, pa.string()) is col
    with pytest.raises(TypeError, match="int64"):
        columnar_arrow(col, pa.int64())


def ranges(starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[start, start+n) for each row, as a list column (offsets int32, values int64): numpy's
    way, the oracle of the compiled positions() and _slices()."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1] - starts, lengths)
    return offsets.astype(np.int32), values


@pytest.mark.parametrize("starts, lengths", [([], []), ([5], [0]), ([0, 7, 3], [2, 1, 4]),
                                             ([9, 9, 0], [0, 3, 0])])
def test_positions_are_the_ranges(starts, lengths):
    starts, lengths = np.array(starts, np.int64), np.array(lengths, np.int64)
    want_off, want = ranges(starts, lengths)
    off, got = positions(starts, want_off)
    assert got.dtype == np.int32
    assert off.tolist() == want_off.tolist() and got.tolist() == want.tolist()
    toks = np.arange(100, 120, dtype=np.int32)
    sliced = _slices(toks, starts, want_off)
    assert sliced.dtype == np.int32 and sliced.tolist() == toks[want].tolist()


def _rows(append: list[int], rope: list[int], q: list[int]) -> np.ndarray:
    W = np.zeros((fl.NW, len(q)), np.int64).T  # the engine's layout (Fortran order)
    W[:, fl.W_APPEND], W[:, fl.W_ROPE], W[:, fl.W_Q] = append, rope, q
    return W


def test_append_and_rope_positions_are_one_column_only_when_their_starts_agree():
    append, rope = _positions_of(_rows([4, 0], [4, 0], [1, 3]))
    assert append is rope and append[1].tolist() == [4, 0, 1, 2]
    append, rope = _positions_of(_rows([4, 0], [5, 0], [1, 3]))
    assert append[1].tolist() == [4, 0, 1, 2] and rope[1].tolist() == [5, 0, 1, 2]
