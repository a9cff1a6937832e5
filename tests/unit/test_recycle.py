"""sim/fast/recycle.py: buffers handed to the trace writer come back only once it lets go."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import sim.fast.engine as fast_engine
from sim.api import load_scenario, run
from sim.fast import recycle
from sim.fast.recycle import Recycler
from sim.trace import writer as trace_writer

ROOT = Path(__file__).resolve().parents[2]


def test_a_buffer_comes_back_only_when_no_view_of_it_lives():
    r = Recycler()
    a = np.zeros((10, 3), np.int64, order="F")
    first = id(a)
    view = a[:4, 1]  # what the writer keeps (through an Arrow array) until its row group is out
    a = r.swap(a)  # the engine's attribute now names the new buffer
    assert id(a) != first and a.shape == (10, 3) and a.flags.f_contiguous
    a = r.swap(a)  # the first is still seen through `view`: another new buffer
    assert id(a) != first and r.reused == 0
    del view
    a = r.swap(a)
    assert id(a) == first and r.reused == 1


def test_the_pool_stays_bounded_and_refuses_views():
    r = Recycler(keep=2)
    held = [np.zeros(4)]
    for _ in range(5):
        held.append(r.swap(held[-1]))
    assert len(r.pool) == 2
    with pytest.raises(ValueError, match="own its memory"):
        r.swap(np.zeros(8)[2:])


def test_recycled_buffers_under_a_slow_writer_give_the_reference_digest(tmp_path, monkeypatch):
    """Trace-only fast runs hand the rows' and events' buffers to the writer thread. With every
    buffer poisoned when handed out again, a 2-step-per-drain loop, small row groups and a
    writer slowed to keep several of them in flight, a buffer reused too early (or a column the
    loop does not write every drain) changes the digest."""
    sc, base = load_scenario(ROOT / "bench" / "workloads" / "a_vidur.toml")
    syn = sc.workload.synthetic.model_copy(update={"num_requests": 40})  # type: ignore[union-attr]
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={"synthetic": syn})})
    run(sc, out=tmp_path / "reference", base_dir=base, engine="reference", collect=False,
        check=False)
    monkeypatch.setattr(recycle, "POISON", True)
    monkeypatch.setattr(fast_engine, "_STEPS", 2)
    monkeypatch.setattr(trace_writer, "_ROW_GROUP", 40)  # a row group per drain or two
    slow = pq.ParquetWriter.write_table

    def write_table(self, table, *a, **k):  # type: ignore[no-untyped-def]
        time.sleep(0.002)
        return slow(self, table, *a, **k)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", write_table)
    engines: list[fast_engine.FastEngine] = []
    init = fast_engine.FastEngine.__init__
    monkeypatch.setattr(fast_engine.FastEngine, "__init__",
                        lambda self, *a, **k: (engines.append(self), init(self, *a, **k))[1])
    run(sc, out=tmp_path / "fast", base_dir=base, engine="fast", collect=False, check=False)
    digest = {e: json.loads((tmp_path / e / "manifest.json").read_text())["digest"]
              for e in ("fast", "reference")}
    assert digest["fast"] == digest["reference"]
    (eng,) = engines
    assert eng.delta and all(r.reused > 0 for r in eng.recycle)  # buffers did come back
