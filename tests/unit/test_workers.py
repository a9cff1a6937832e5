"""gpu_backend/workers.py: steps prepared by forked worker processes are the steps the loop's own
preparation makes (arrays, pool operations, batches, reference groups), on every replay scenario
and fault trace, with the chunks spread so that every step's predecessor was walked by another
worker; a replay gives the same rows; a worker's error or death reaches the loop as an error;
closing early leaves no process behind."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import time
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from replay_traces import FAULTS, SCENARIOS, any_trace, big_verify

from gpu_backend import prepare, slots, workers
from gpu_backend.driver import GUARD_PAGES, replay
from gpu_backend.fa2plan import H200, Planner
from gpu_backend.layout import PREP_ONLY
from gpu_backend.prepare import HostState, Prepared, prepared_steps
from gpu_backend.reference import ReferenceKernels
from gpu_backend.staging import Chunk, PackedSlots
from gpu_backend.tracedata import TraceData, load_trace
from gpu_backend.truthprep import truth_shape
from sim.errors import KvsimError, TraceError


def _state(trace: TraceData) -> HostState:
    slots, _, last = truth_shape(trace)
    return HostState(trace, GUARD_PAGES, trace.model.max_position, last=last,
                     free=list(range(slots))[::-1], graphs=Planner.for_model(trace.model, H200))


def _steps(trace: TraceData, n: int) -> list[Prepared]:
    return list(prepared_steps(trace, _state(trace), "cpu", n))


def _same_step(a: Prepared, b: Prepared) -> None:
    assert (a.step, a.rows) == (b.step, b.rows)
    for f in ("ops", "touched", "fill", "engine_nan", "truth_same", "q_identity", "groups",
              "wcheck"):
        assert getattr(a, f) == getattr(b, f), f
    assert np.array_equal(a.wpages, b.wpages)
    for k, x in vars(a.b).items():  # a worker's step: what the loop reads (`shipped`)
        y = getattr(b.b, k)
        if x is None and k in PREP_ONLY:
            continue
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y, k
    # each worker grows its own graph capacities: a padded graph block may differ, nothing else
    assert (a.graph is None) == (b.graph is None)
    pad = a.graph != b.graph
    keys = [k for k in a.dv if not (pad and (k.startswith("gr_") or k == "gblk"))]
    assert keys == [k for k in b.dv if not (pad and (k.startswith("gr_") or k == "gblk"))]
    for k in keys:
        assert np.array_equal(a.dv[k].numpy(), b.dv[k].numpy()), (a.step.step, k)


@pytest.mark.parametrize("name", [*sorted(SCENARIOS), *FAULTS])
def test_workers_prepare_the_steps_the_loop_would(tmp_path: Path, name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    t = load_trace(any_trace(tmp_path, name))
    want = _steps(t, 0)
    monkeypatch.setattr(prepare, "CHUNK_STEPS", 1)  # every step's predecessor: another worker's
    for n in (1, 2, 3):
        got = _steps(t, n)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _same_step(a, b)


@pytest.mark.parametrize("name", ["clean_mtp_xqa", "shared_block_written", "overlong_fa2"])
def test_a_batch_unpickles_as_it_was(tmp_path: Path, name: str) -> None:
    """`StepBatch.__reduce__` (its arrays in one buffer): every field back, arrays with their
    dtype and shape (xqa's 2-D block table, empty ones), writable."""
    t = load_trace(SCENARIOS[name](tmp_path / name))
    for p in _steps(t, 0):
        got = pickle.loads(pickle.dumps(p.b, protocol=pickle.HIGHEST_PROTOCOL))
        slim = pickle.loads(pickle.dumps(p.b.shipped(), protocol=pickle.HIGHEST_PROTOCOL))
        assert all(getattr(slim, k) is None for k in PREP_ONLY)
        assert all(np.array_equal(v, getattr(slim, k)) for k, v in vars(p.b).items()
                   if k not in PREP_ONLY and isinstance(v, np.ndarray))
        for (k, x), y in zip(vars(p.b).items(), vars(got).values(), strict=True):
            if isinstance(x, np.ndarray):
                assert (x.dtype, x.shape) == (y.dtype, y.shape) and y.flags.writeable, k
                assert np.array_equal(x, y), k
            else:
                assert x == y, k
        with pytest.raises(FrozenInstanceError):  # made without __init__, still frozen
            got.step = -1  # type: ignore[misc]


@pytest.mark.parametrize("name", ["clean_mtp_xqa", "shared_block_written", "overlong_fa2"])
def test_packed_slots_are_the_slots(tmp_path: Path, name: str) -> None:
    """`staging.PackedSlots` (how a worker ships a step's slots): every slot back after
    pickling, in order, the 2-D and empty ones too; an unknown name is a KeyError."""
    t = load_trace(SCENARIOS[name](tmp_path / name))
    for p in _steps(t, 0):
        slots = p.dv.slots
        got = pickle.loads(pickle.dumps(PackedSlots(slots), protocol=pickle.HIGHEST_PROTOCOL))
        assert list(got) == list(slots) and len(got) == len(slots)
        assert {k: got[k] for k in reversed(list(slots))} == slots
        with pytest.raises(KeyError):
            got["no such array"]
    assert any(len(s[0]) == 2 for s in slots.values())


def test_a_chunk_larger_than_one_upload_arrives_whole(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker splits its chunk into uploads of CHUNK_WORDS, as the loop's preparation does."""
    t = load_trace(big_verify(tmp_path / "big", batch=8, kv=256, steps=9))
    want = _steps(t, 0)
    monkeypatch.setattr(prepare, "CHUNK_WORDS", 1000)
    monkeypatch.setattr(prepare, "CHUNK_STEPS", 4)
    got = _steps(t, 2)
    assert len({id(p.dv.chunk) for p in got}) == len(got)  # every step its own upload
    for a, b in zip(got, want, strict=True):
        _same_step(a, b)


def test_a_part_larger_than_a_slot_takes_the_pipe(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    t = load_trace(big_verify(tmp_path / "big", batch=8, kv=256, steps=9))
    want = _steps(t, 0)
    monkeypatch.setattr(slots, "SLOT_BYTES", 1 << 17)  # the prompt step's part does not fit
    monkeypatch.setattr(prepare, "CHUNK_STEPS", 1)
    sent: list[str] = []
    real = workers._from_slot

    def counted(*a: Any) -> Any:
        sent.append("slot")
        return real(*a)

    monkeypatch.setattr(workers, "_from_slot", counted)
    got = _steps(t, 2)
    assert 0 < len(sent) < len(got)  # both ways taken
    for a, b in zip(got, want, strict=True):
        _same_step(a, b)


@pytest.mark.parametrize("name", [*sorted(SCENARIOS), *FAULTS])
def test_workers_give_the_same_verdicts(tmp_path: Path, name: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """... with the batches they ship (`StepBatch.shipped`): the loop reads no field they
    leave out."""
    t = load_trace(any_trace(tmp_path, name))
    m = t.model

    def rows(n: int) -> list[tuple[Any, ...]]:
        res = replay(t, ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu", workers=n)
        assert res.stats["prepare_workers"] == n
        # the error of an ok row only: a corrupt row's can race (gne_without_headroom: two
        # appends to one slot in one launch land in no fixed order, with or without workers)
        return [(r.step, r.row, r.verdict, r.err if r.verdict == "ok" else None, r.message)
                for r in res.rows]

    monkeypatch.setattr(prepare, "CHUNK_STEPS", 2)
    assert rows(2) == rows(0)
    assert not mp.active_children()


def test_a_workers_error_is_raised_by_the_loop(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The serial preparation's TraceError (a request's prefix missing from requests.parquet)
    comes out of the worker as the same error."""
    t = load_trace(SCENARIOS["shared_block_written"](tmp_path / "s"))
    t.prompts[1] = ()  # request 1 starts at committed 20 in step 1, on a shared prefix
    with pytest.raises(TraceError, match="request 1 starts at committed 20"):
        _steps(t, 0)
    monkeypatch.setattr(prepare, "CHUNK_STEPS", 1)
    monkeypatch.setattr(workers, "LEAD", 1)  # step 1: a worker's (the loop's is step 0)
    monkeypatch.setattr(workers, "_first_chunk", _no_error(workers._first_chunk))
    with pytest.raises(TraceError, match="request 1 starts at committed 20"):
        _steps(t, 2)
    assert not mp.active_children()


def _no_error(fn: Any) -> Any:
    """fn, asserting it raises nothing (the error must come from a worker)."""
    def call(*a: Any) -> Any:
        try:
            return fn(*a)
        except TraceError as e:
            raise AssertionError("raised by the loop's own chunk") from e
    return call


def test_a_dead_worker_is_a_plain_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = load_trace(big_verify(tmp_path / "big", batch=4, kv=64, steps=12))
    monkeypatch.setattr(workers, "_work", lambda *a: os._exit(3))
    with pytest.raises(KvsimError, match="preparation worker exited"):
        _steps(t, 2)
    assert not mp.active_children()


def test_closing_early_stops_the_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    t = load_trace(big_verify(tmp_path / "big", batch=4, kv=64, steps=40))
    real = prepare.prepare_step

    def slow(*a: Any) -> Prepared:  # the workers inherit it: still busy when the loop stops
        time.sleep(0.05)
        return real(*a)

    monkeypatch.setattr(prepare, "prepare_step", slow)
    monkeypatch.setattr(prepare, "CHUNK_STEPS", 2)
    it = prepared_steps(t, _state(t), "cpu", 3)
    next(it)
    (forker,) = mp.active_children()
    pids = _workers_forked(forker.pid, 3)
    it.close()
    assert not mp.active_children()
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]  # killed and reaped


def _workers_forked(pid: int, n: int, wait: float = 30.0) -> list[int]:
    """pid's n children, once it has forked them all: it forks them beside the loop, which may
    have its first chunk first (CI's 2 busy cores once saw 2 of 3)."""
    end = time.monotonic() + wait
    while len(pids := _children(pid)) < n and time.monotonic() < end:
        time.sleep(0.01)
    assert len(pids) == n
    return pids


def _children(pid: int) -> list[int]:
    """The processes whose parent is pid (Linux's /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def test_workers_only_on_a_gpu_host_with_cores_for_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert workers.usable("cuda") == 4 and workers.usable("cpu") == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert workers.usable("cuda") == 4
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert workers.usable("cuda") == 0


def test_a_replay_takes_no_workers_unless_asked(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's own preparation by default, even for a long trace on a host with the cores
    (the workers were slower at every length the H200 measured)."""
    monkeypatch.setattr(workers, "usable", lambda device: 4)  # a host with the cores for them
    t = load_trace(big_verify(tmp_path / "long", batch=4, kv=64, steps=300))
    res = replay(t, ReferenceKernels(t.model.num_q_heads, t.model.num_blocks), "cpu")
    assert res.stats["prepare_workers"] == 0 and res.rows


def test_chunk_zero_is_the_prompt_step_then_chunks_grow_to_chunk_steps() -> None:
    assert [workers._chunk(i, 3) for i in range(14)] == [0, 1, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5,
                                                         6]
    assert [workers._chunk(i, 1) for i in range(4)] == [0, 1, 2, 3]
    sizes = np.bincount([workers._chunk(i, 8) for i in range(1000)])
    assert list(sizes[:10]) == [1, 1, 2, 3, 4, 5, 6, 7, 8, 8] and set(sizes[9:-1]) == {8}



class _Upload:
    """The event after a chunk's upload from its slot; `synchronize` is the loop's wait."""

    def __init__(self) -> None:
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True


def _ring_with_all_slots_taken() -> slots.Ring:
    ring = slots.Ring(mp.get_context("fork"))
    for _ in range(slots.SLOTS):
        assert ring.free.acquire(block=False)
    return ring


def _hold(ring: slots.Ring, chunk: Chunk, k: int) -> tuple[np.ndarray, _Upload]:
    words = np.frombuffer(ring.mem, np.int64, 4, k * slots.SLOT_BYTES)
    words[:] = [k, 1, 2, 3]
    chunk.bufs["h64"] = torch.from_numpy(words)
    done = _Upload()
    ring.hold(chunk, words, done)  # type: ignore[arg-type]
    return words, done


def test_a_slot_comes_back_once_its_chunk_is_gone_oldest_first() -> None:
    """On a GPU the loop reads a chunk's words in place: its slot is the worker's again only
    when every step of the chunk is gone, and in the order the worker filled them."""
    ring = _ring_with_all_slots_taken()
    older, newer = Chunk("cpu"), Chunk("cpu")
    _hold(ring, older, 0)
    _hold(ring, newer, 1)
    del newer
    ring.release()
    assert not ring.free.acquire(block=False)  # the older chunk still holds the first slot
    del older
    ring.release()
    assert ring.free.acquire(block=False) and ring.free.acquire(block=False)
    assert not ring.free.acquire(block=False) and not ring.held


def test_the_loop_makes_room_before_it_waits_for_a_worker_it_holds_every_slot_of() -> None:
    """A worker waits for a free slot, and the loop frees slots only as it judges steps: before
    the loop waits for that worker, the oldest chunk's words leave their slot (once its upload
    is done), so neither waits on the other. With a slot to spare nothing moves."""
    ring = _ring_with_all_slots_taken()
    chunks = [Chunk("cpu") for _ in range(slots.SLOTS)]
    held = [_hold(ring, c, k) for k, c in enumerate(chunks[:-1])]
    ring.make_room()
    assert not ring.free.acquire(block=False) and not held[0][1].waited
    held.append(_hold(ring, chunks[-1], slots.SLOTS - 1))
    ring.make_room()
    assert held[0][1].waited and not held[1][1].waited
    assert ring.free.acquire(block=False) and len(ring.held) == slots.SLOTS - 1
    moved = chunks[0].bufs["h64"]
    held[0][0][:] = -1  # the worker writes its next chunk into the slot
    assert moved.tolist() == [0, 1, 2, 3]
