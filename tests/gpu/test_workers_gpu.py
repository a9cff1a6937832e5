"""Preparation workers (gpu_backend/workers.py) on the GPU: a FlashInfer replay with its steps
prepared by forked workers (`--prepare-workers N`) gives the rows of the
loop's own preparation, CUDA graphs included; the workers never touch the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from replay_traces import SCENARIOS, big_verify

from gpu_backend import prepare
from gpu_backend.driver import replay
from gpu_backend.tracedata import TraceData, load_trace

pytestmark = pytest.mark.gpu


def _replay(trace: TraceData, workers: int) -> list[tuple[int, int, str, float]]:
    from gpu_backend.replay import FlashInferKernels

    res = replay(trace, FlashInferKernels(trace.model.num_q_heads, "cuda"), "cuda",
                 workers=workers)
    assert res.stats["prepare_workers"] == workers
    return [(r.step, r.row, r.verdict, r.err) for r in res.rows]


@pytest.mark.parametrize("name", ["big_verify", "append_past_alloc", "overlap_uncorrected"])
def test_workers_give_the_loops_rows(tmp_path: Path, name: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = big_verify(tmp_path / name, batch=16, kv=512, steps=24) if name == "big_verify" \
        else SCENARIOS[name](tmp_path / name)
    t = load_trace(path)
    want = _replay(t, 0)
    monkeypatch.setattr(prepare, "CHUNK_STEPS", 2)  # several chunks, every worker some
    got = _replay(t, 3)
    assert [g[:3] for g in got] == [w[:3] for w in want]
    # a worker grows its own graph capacities: another padding, the same kernels
    np.testing.assert_allclose([g[3] for g in got], [w[3] for w in want], atol=2e-3)





def _read_in_place(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """Every chunk read from a slot waits for the slots' registration (a test's chunks come
    faster than any registration), so each is read in place; per chunk: (its words pinned,
    inside the slot)."""
    from gpu_backend import slots, workers

    words: list[tuple[bool, bool]] = []
    real = workers._from_slot

    def from_slot(r: slots.Ring, *a: object) -> object:
        if r.pin is not None:
            r.pin.thread.join()
        got = real(r, *a)  # type: ignore[arg-type]
        at = got[3].data_ptr() - slots.address(r.mem)
        words.append((got[3].is_pinned(), 0 <= at < len(r.mem)))
        return got

    monkeypatch.setattr(workers, "_from_slot", from_slot)
    monkeypatch.setattr(slots, "SLOT_BYTES", 1 << 20)
    monkeypatch.setattr(prepare, "CHUNK_STEPS", 2)
    return words


def test_chunks_upload_from_the_workers_registered_slots(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Once CUDA has registered a worker's slots (a thread beside the loop), the loop uploads
    its chunks from them, page-locked, with no copy into pinned memory; the rows are the loop's
    own preparation's; the slots are unregistered when the replay ends."""
    import torch

    from gpu_backend import slots

    rings: list[slots.Ring] = []
    real_ring = slots.Ring

    def ring(ctx: object) -> slots.Ring:
        rings.append(real_ring(ctx))
        return rings[-1]

    monkeypatch.setattr(slots, "Ring", ring)
    words = _read_in_place(monkeypatch)
    t = load_trace(big_verify(tmp_path / "big", batch=16, kv=512, steps=24))
    want = _replay(t, 0)
    got = _replay(t, 2)
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert words and all(p and inside for p, inside in words)
    cudart = torch.cuda.cudart()
    for r in rings:  # registering again works only if the replay's registration is undone
        assert r.pin is not None and not r.pin.ok
        assert int(cudart.cudaHostRegister(slots.address(r.mem), len(r.mem), 0)) == 0
        assert int(cudart.cudaHostUnregister(slots.address(r.mem))) == 0


def test_one_worker_with_one_slot_never_waits_on_the_loop(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A worker whose one slot holds a chunk the loop has not judged yet waits for the slot,
    and the loop, before it waits for that worker, moves the chunk out of the slot
    (`slots.Ring.make_room`): the replay ends, with the loop's own rows."""
    from gpu_backend import slots

    moved: list[bool] = []
    real_room = slots.Ring.make_room

    def make_room(r: slots.Ring) -> None:
        before = len(r.held)
        real_room(r)
        moved.append(len(r.held) < before)

    monkeypatch.setattr(slots.Ring, "make_room", make_room)
    monkeypatch.setattr(slots, "SLOTS", 1)
    _read_in_place(monkeypatch)
    t = load_trace(big_verify(tmp_path / "big", batch=16, kv=512, steps=24))
    want = _replay(t, 0)
    got = _replay(t, 1)
    assert [g[:3] for g in got] == [w[:3] for w in want]
    assert any(moved)
