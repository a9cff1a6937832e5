"""gpu_backend/host/graph_block.py, FlashInfer's FA2 planner ported, against a line-by-line Python
transliteration of the C++ (flashinfer/data/include/flashinfer/attention/scheduler.cuh
`PrefillSplitQOKVIndptr` and `PrefillPlanImpl`, 0.7.2.post1). The port against FlashInfer's own
compiled planner: tests/gpu/test_fa2plan_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend.host import graph_block
from gpu_backend.host.graph_block import H200, Device, Planner, agrees, image, layout


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def cxx_plan(p: Planner, qo_indptr: list[int], kv_indptr: list[int], uniform_q_len: int
             ) -> tuple[list[int], dict[str, list[int]]]:
    """The C++ planner in CUDA-graph mode (window_left -1, no fixed split, split allowed), as
    written: (plan info, the arrays it materializes). Raises where it raises."""
    batch_size = len(qo_indptr) - 1
    total_num_rows = qo_indptr[-1]
    gqa_group_size = p.hq // p.hkv
    max_grid_size = 2 * p.device.sms
    max_batch_size_if_split = max_grid_size // p.hkv
    packed_qo_len_arr = [(qo_indptr[i + 1] - qo_indptr[i]) * gqa_group_size
                         for i in range(batch_size)]
    kv_len_arr = [kv_indptr[i + 1] - kv_indptr[i] for i in range(batch_size)]
    if any(k < 0 for k in kv_len_arr):
        raise ValueError("kv_indptr should be non-decreasing")
    min_kv_chunk_size = max(128 // p.page_size, 1)
    packed_uniform_len = uniform_q_len * gqa_group_size
    assert all(x == packed_uniform_len for x in packed_qo_len_arr)
    cta_tile_q = p.cta_tile_q(packed_uniform_len)
    total_num_tiles_q = batch_size * _ceil_div(packed_uniform_len, cta_tile_q)
    effective_kv_len_arr = list(kv_len_arr)
    # PrefillBinarySearchKVChunkSize
    max_kv_len = max([1] + effective_kv_len_arr)
    low, high = min_kv_chunk_size, max_kv_len
    while low < high:
        mid = (low + high) // 2
        new_batch_size = sum(_ceil_div(packed_qo_len_arr[i], cta_tile_q)
                             * _ceil_div(max(effective_kv_len_arr[i], 1), mid)
                             for i in range(batch_size))
        if new_batch_size > max_batch_size_if_split:
            low = mid + 1
        else:
            high = mid
    split_kv, kv_chunk_size = True, low
    request_indices, qo_tile_indices, kv_tile_indices = [], [], []
    merge_indptr, o_indptr = [0], [0]
    new_batch_size = 0
    for request_idx in range(batch_size):
        packed_qo_len = packed_qo_len_arr[request_idx]
        num_tiles_q = _ceil_div(packed_qo_len, cta_tile_q)
        kv_len = max(effective_kv_len_arr[request_idx], 1)
        num_chunks_kv = _ceil_div(kv_len, kv_chunk_size)
        for q_tile_idx in range(num_tiles_q):
            for kv_tile_idx in range(num_chunks_kv):
                new_batch_size += 1
                request_indices.append(request_idx)
                qo_tile_indices.append(q_tile_idx)
                kv_tile_indices.append(kv_tile_idx)
        qo_len = packed_qo_len // gqa_group_size
        for _ in range(qo_len):
            merge_indptr.append(merge_indptr[-1] + num_chunks_kv)
        o_indptr.append(o_indptr[-1] + qo_len * num_chunks_kv)
    padded_batch_size = max(max_batch_size_if_split, total_num_tiles_q)
    if new_batch_size > padded_batch_size:
        raise ValueError("new batch size should not exceed padded batch size")
    kv_chunk_size *= p.page_size
    # PrefillPlanImpl: the int allocator, then the float one
    cur = 0

    def alloc(size: int, align: int) -> int:
        nonlocal cur
        off = cur + (-cur % align)
        cur = off + size
        return off

    req = alloc(4 * padded_batch_size, 16)
    qt = alloc(4 * padded_batch_size, 16)
    kt = alloc(4 * padded_batch_size, 16)
    oi = alloc(4 * (batch_size + 1), 16)
    cs = alloc(4, 1)
    rows = alloc(4, 16)
    max_partial_rows = _ceil_div(padded_batch_size * cta_tile_q, gqa_group_size)
    if o_indptr[-1] > max_partial_rows:
        raise ValueError("batch_prefill partial outputs need more rows than the plan reserved")
    v_size = p.hq * max_partial_rows * p.head_dim * 4
    s_off = v_size + (-v_size % 16)
    merge = alloc(4 * (total_num_rows + 1), 16)
    mask = alloc(padded_batch_size, 16)
    info = [padded_batch_size, total_num_rows, rows, cta_tile_q, req, qt, kt, merge, oi, cs, 0,
            s_off, mask, 1, int(split_kv)]
    arrays = {"request_indices": request_indices, "qo_tile_indices": qo_tile_indices,
              "kv_tile_indices": kv_tile_indices, "o_indptr": o_indptr,
              "kv_chunk_size": [kv_chunk_size], "total_num_rows": [qo_indptr[batch_size]],
              "merge_indptr": merge_indptr,
              "block_valid_mask": [int(i < new_batch_size) for i in range(padded_batch_size)],
              "nbytes": [cur]}
    return info, arrays


def _read(lay: graph_block.Layout, img: np.ndarray, name: str, n: int) -> list[int]:
    raw = img.view(np.uint8)[lay.at[name]:]
    return (raw[:n] if name == "block_valid_mask" else raw[: 4 * n].view(np.int32)).tolist()


SHAPES = [(32, 8, 128, 16), (32, 8, 128, 32), (8, 8, 64, 16), (16, 2, 256, 1), (64, 4, 128, 64)]


@settings(max_examples=150, deadline=None)
@given(shape=st.sampled_from(SHAPES), sms=st.sampled_from([132, 108, 20, 2]),
       width=st.integers(1, 40), pages=st.lists(st.integers(0, 3000), min_size=1, max_size=96))
def test_the_port_writes_what_the_cxx_planner_writes(shape: tuple[int, int, int, int],
                                                     sms: int, width: int,
                                                     pages: list[int]) -> None:
    hq, hkv, d, page_size = shape
    p = Planner(Device(sms, 9, H200.smem_optin), hq, hkv, d, page_size, 2)
    kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    qo = [width * i for i in range(len(pages) + 1)]
    info, want = cxx_plan(p, qo, kv_indptr.tolist(), width)
    lay = layout(p, len(pages), width)
    img = image(lay, kv_indptr)
    assert img is not None and lay.info == tuple(info) and lay.nbytes == want["nbytes"][0]
    for name, vals in want.items():
        if name != "nbytes":
            assert _read(lay, img, name, len(vals)) == vals, name
    used = lay.used(img)
    assert not img.view(np.uint8)[: lay.nbytes][~used].any()  # the rest: zeros, never read


def test_cta_tile_q_follows_flashinfer() -> None:
    """utils.cuh `FA2DetermineCtaTileQ`'s branches (head_dim_qk = head_dim)."""
    def tile(d: int, packed: int, cc: int = 9, smem: int = H200.smem_optin, kvb: int = 2) -> int:
        return Planner(Device(132, cc, smem), 32, 8, d, 16, kvb).cta_tile_q(packed)

    assert tile(128, 16) == 16 and tile(128, 17) == 64 and tile(128, 64) == 64
    assert tile(128, 65) == 128 and tile(256, 65) == 64 and tile(512, 32) == 16
    assert tile(512, 33) == 32 and tile(128, 16, cc=7) == 64
    # one Q tile plus one K+V step of the 1x4 layout over the opt-in shared memory: 64
    assert tile(256, 16, smem=16 * 256 * 2 + 512 * 64 * 2 - 1) == 64
    assert tile(256, 16, smem=16 * 256 * 2 + 512 * 64 * 2) == 16


def test_refused_page_counts_give_no_plan() -> None:
    lay = layout(Planner.for_model(_Model(), H200), 2, 4)
    assert image(lay, np.array([0, 5, 3], dtype=np.int32)) is None  # decreasing offsets


def test_agrees_sees_a_byte_or_an_info_entry_that_differs() -> None:
    p = Planner.for_model(_Model(), H200)
    kv_indptr = np.array([0, 100, 260, 261], dtype=np.int32)
    info, _ = cxx_plan(p, [0, 4, 8, 12], kv_indptr.tolist(), 4)
    lay = layout(p, 3, 4)
    img = image(lay, kv_indptr)
    assert img is not None
    theirs = np.full(lay.nbytes + 64, 0xAB, dtype=np.uint8)  # unset bytes: whatever was there
    used = lay.used(img)
    theirs[: lay.nbytes][used] = img.view(np.uint8)[: lay.nbytes][used]
    assert agrees(lay, info, theirs, kv_indptr)
    for at in np.flatnonzero(used)[[0, len(np.flatnonzero(used)) // 2, -1]]:
        bad = theirs.copy()
        bad[at] ^= 1
        assert not agrees(lay, info, bad, kv_indptr)
    assert not agrees(lay, info[:3] + [info[3] * 2] + info[4:], theirs, kv_indptr)
    assert not agrees(lay, info, theirs[: lay.nbytes - 1], kv_indptr)


class _Model:
    num_q_heads, num_kv_heads, head_dim, page_size = 32, 8, 128, 16


@pytest.mark.parametrize("rows,width", [(64, 4), (128, 4), (1, 1), (200, 8)])
def test_the_layout_is_the_key_s_alone(rows: int, width: int) -> None:
    """Every step of a key shares its plan info and workspace layout: a graph captures them
    once (`graphs.StepGraphs`)."""
    p = Planner.for_model(_Model(), H200)
    infos = set()
    rng = np.random.default_rng(rows)
    for _ in range(20):
        pages = rng.integers(0, 600, rows)
        kv_indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        infos.add(tuple(cxx_plan(p, list(range(0, width * rows + 1, width)),
                                 kv_indptr.tolist(), width)[0]))
    assert infos == {layout(p, rows, width).info}
