"""gpu_backend/staging.py: a chunk's arrays come back through every view kind as they were staged;
the int32 and bool forms are made only when a view needs them, once."""

from __future__ import annotations

import numpy as np
import torch

from gpu_backend.staging import Chunk, stage


def _chunk() -> tuple[Chunk, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    arrays = {"idx": rng.integers(-5, 1 << 20, 37), "mask": rng.integers(0, 2, 64),
              "grid": rng.integers(0, 9, (4, 6)), "empty": np.zeros(0, np.int64),
              "pos_m": rng.random(11) * 1e6}
    return Chunk("cpu"), arrays


def test_every_view_is_the_staged_array() -> None:
    chunk, arrays = _chunk()
    dv = stage(chunk, arrays)
    chunk.upload()
    for k, a in arrays.items():
        if a.dtype == np.float64:
            assert np.array_equal(dv[k + "@f64"].numpy(), a)
            continue
        assert np.array_equal(dv[k].numpy(), a)
        assert dv[k + "@32"].dtype == torch.int32 and np.array_equal(dv[k + "@32"].numpy(), a)
        assert np.array_equal(dv[k + "@b"].numpy(), a != 0)
        assert np.array_equal(dv[k + "@host"].numpy(), a.astype(np.int32))


def test_int32_and_bool_forms_only_when_viewed() -> None:
    """A chunk of CUDA-graph steps views only its int64 words: no int32 or bool form (each
    was a device launch a chunk); the first @32 view makes the form, later ones share it."""
    chunk, arrays = _chunk()
    dv = stage(chunk, arrays)
    chunk.upload()
    dv["idx"], dv["grid"], dv["pos_m@f64"], dv["mask@host"]
    assert set(chunk.bufs) == {"h64", "d64", "f64"}
    a = dv["idx@32"]
    assert "d32" in chunk.bufs and "db" not in chunk.bufs
    assert dv["grid@32"].untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    dv["mask@b"]
    assert "db" in chunk.bufs


def test_span_is_where_a_view_reads() -> None:
    """`StepArrays.span` (a copy by address, `rawcopy`): the words the array's view reads."""
    chunk, arrays = _chunk()
    dv = stage(chunk, arrays)
    chunk.upload()
    for k in ("idx", "mask", "empty"):
        buf, off, n = dv.span(k)
        assert np.array_equal(buf[off: off + n].numpy(), arrays[k])
        assert buf.data_ptr() + 8 * off == dv[k].data_ptr() or n == 0
