"""gpu_backend/host/staging.py: a chunk's arrays come back through every view kind as they were
staged;
the int32 and bool forms are made only when a view needs them, once."""

from __future__ import annotations

import numpy as np
import torch

from gpu_backend.host.staging import F64, HOST32, I32, MASK, Chunk, Read, StepArrays, stage


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
            assert np.array_equal(dv.view(k, F64).numpy(), a)
            continue
        assert np.array_equal(dv[k].numpy(), a)
        assert dv.view(k, I32).dtype == torch.int32 and np.array_equal(dv.view(k, I32).numpy(), a)
        assert np.array_equal(dv.view(k, MASK).numpy(), a != 0)
        assert np.array_equal(dv.view(k, HOST32).numpy(), a.astype(np.int32))


def test_int32_and_bool_forms_only_when_viewed() -> None:
    """A chunk of CUDA-graph steps views only its int64 words: no int32 or bool form (each
    was a device launch a chunk); the first int32 view makes the form, later ones share it."""
    chunk, arrays = _chunk()
    dv = stage(chunk, arrays)
    chunk.upload()
    dv["idx"], dv["grid"], dv.view("pos_m", F64), dv.view("mask", HOST32)
    assert set(chunk.bufs) == {"h64", "d64", "f64"}
    a = dv.view("idx", I32)
    assert "d32" in chunk.bufs and "db" not in chunk.bufs
    assert dv.view("grid", I32).untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    dv.view("mask", MASK)
    assert "db" in chunk.bufs


def test_span_is_where_a_view_reads() -> None:
    """`StepArrays.span` (a copy by address, `graphs`): the words the array's view reads."""
    chunk, arrays = _chunk()
    dv = stage(chunk, arrays)
    chunk.upload()
    for k in ("idx", "mask", "empty"):
        buf, off, n = dv.span(k)
        assert np.array_equal(buf[off: off + n].numpy(), arrays[k])
        assert buf.data_ptr() + 8 * off == dv[k].data_ptr() or n == 0


def test_narrow_dtypes_are_staged_as_astype_would() -> None:
    """int32, bool and the other narrow integers are widened by the chunk's concatenation,
    not copied first (`staging._integral`); uint64 words and float32 still go through astype.
    Both the upload and a worker's `words` give astype's int64 words."""
    rng = np.random.default_rng(1)
    arrays = {"i32": rng.integers(-(1 << 31), 1 << 31, 40).astype(np.int32),
              "b": rng.integers(0, 2, 33).astype(bool), "u8": rng.integers(0, 256, 9, np.uint8),
              "u64": np.array([0, 1, (1 << 64) - 1], np.uint64), "f32": np.array([1.5, -2.7],
                                                                                np.float32),
              "i64": rng.integers(-(1 << 62), 1 << 62, 5)}
    chunk = Chunk("cpu")
    dv = stage(chunk, arrays)
    words = chunk.words()
    chunk.upload()
    assert words.dtype == np.int64 and np.array_equal(words, chunk.bufs["h64"].numpy())
    for k, a in arrays.items():
        assert np.array_equal(dv[k].numpy(), a.astype(np.int64)), k


def _fill(chunk: Chunk, arrays: dict[str, np.ndarray]) -> list[object]:
    """Stage `arrays` with claims between them: one written in full, one trimmed to part of
    it, one undone (trimmed back to where it began). Returns the slots and claims' offsets."""
    out: list[object] = []
    for i, a in enumerate(arrays.values()):
        out.append(chunk.add(a))
        start = chunk.n
        at, room = chunk.claim(13 + i)
        room[:] = np.arange(13 + i) * (i + 1)
        out.append(at)
        if i % 3 == 1:
            chunk.trim(at + 5)
        elif i % 3 == 2:
            chunk.trim(start)
    return out


def test_a_chunk_written_in_place_stages_the_words_of_a_queued_one() -> None:
    """`Chunk(words=)` (arrays and claims written into its buffer as they come, grown when
    they outgrow it) stages the words and slots of a chunk that concatenates at `upload`,
    padding, narrow dtypes, claims and trims included; its upload copies nothing."""
    _, arrays = _chunk()
    arrays |= {"i32": np.arange(-20, 19, dtype=np.int32), "b": np.arange(9) % 2 == 0}
    want_chunk = Chunk("cpu")
    want = _fill(want_chunk, arrays)
    for words in (1, 40, 100_000):  # grown many times, once, never
        chunk = Chunk("cpu", words)
        assert _fill(chunk, arrays) == want and chunk.n == want_chunk.n
        words_now = chunk.words()
        assert np.array_equal(words_now, want_chunk.words())
        h64 = chunk.h64
        chunk.upload()
        assert chunk.bufs["h64"].data_ptr() == h64.data_ptr()  # no copy on the host
        assert np.array_equal(chunk.bufs["h64"].numpy()[: chunk.n], words_now)


def test_a_claim_trimmed_back_leaves_the_chunk_as_it_was() -> None:
    for words in (0, 8, 4096):
        chunk = Chunk("cpu", words)
        chunk.add(np.arange(3))
        before = (chunk.n, chunk.words().tolist())
        at, room = chunk.claim(100)
        assert at % 32 == 0 and len(room) == 100 and chunk.n == at + 100
        chunk.trim(before[0])
        assert (chunk.n, chunk.words().tolist()) == before


def test_each_typed_read_is_its_array_in_its_dtype() -> None:
    """Every `Read` attribute of `StepArrays` (what the kernels, planners and content read)
    gives its staged array's values in the dtype and place its form states, and no two
    attributes read the same array in the same form."""
    reads = {k: r for k, r in vars(StepArrays).items() if isinstance(r, Read)}
    assert len({(r.name, r.form) for r in reads.values()}) == len(reads)
    rng = np.random.default_rng(1)
    arrays = {r.name: rng.random(7) * 1e6 if r.form == F64 else rng.integers(0, 1 << 20, 7)
              for r in reads.values()}
    chunk = Chunk("cpu")
    dv = stage(chunk, arrays)
    chunk.upload()
    want = {I32: torch.int32, HOST32: torch.int32, MASK: torch.bool, F64: torch.float64}
    for k, r in reads.items():
        got = getattr(dv, k)
        assert got.dtype == want[r.form] and got is dv.view(r.name, r.form), k
        a = arrays[r.name]
        assert np.array_equal(got.numpy(), a != 0 if r.form == MASK else a), k
