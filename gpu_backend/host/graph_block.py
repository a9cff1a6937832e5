"""FlashInfer 0.7.2's FA2 paged-prefill planner in its CUDA-graph mode, on the host, no CUDA.

Why: a graph step (`gpu_backend.device.graphs`) re-plans FA2 every step, and calling FlashInfer's
C++
planner from the replay loop cost ~90 µs of the loop's host a step at batch 64 x kv 2k on the
H200 (its arguments' views 32, the planner 29-31, the fence on its pinned
buffer 11-14, the plan-info comparison 6, the record 5), a fifth of the loop. The plan is a pure
function of the step's page counts and constants the replay knows before it starts, so the
preparation (a worker process, or the loop's pipeline) computes the bytes the planner would
copy into the wrapper's int workspace and stages them with the step's other inputs, an int32
word of the image a staged word; the wrapper's int workspace is that field of the graph's int32
block, which the graph's one int64 -> int32 conversion a step writes (`graphs.StepGraphs`).

What is ported, from flashinfer/data/include/flashinfer/ (0.7.2.post1):
- attention/scheduler.cuh `PrefillSplitQOKVIndptr` with enable_cuda_graph, uniform_q_len > 0,
  window_left = -1, fixed_split_size = -1, disable_split_kv = false (`graphs._plan_first` plans
  the same way), and `PrefillBinarySearchKVChunkSize`;
- attention/scheduler.cuh `PrefillPlanImpl`'s int-workspace layout (allocator.h's
  `AlignedAllocator`, offsets from an aligned base) and its `PrefillPlanInfo` vector;
- utils.cuh `FA2DetermineCtaTileQ` (head_dim_qk = head_dim_vo).
IdType is int32 (the replay's indptrs). Entries past the plan's real work items are zeros
where the C++ planner leaves whatever its pinned buffer held: the kernel never reads them (the
block-valid mask is false there). The first step of every graph checks this port against
FlashInfer's own planner, bytes and plan info (`graphs.StepGraphs._plan_first`); a key whose
plan differs runs eagerly. tests/gpu/test_fa2plan_gpu.py compares random page counts at
several shapes with the C++ planner; tests/unit/test_fa2plan.py holds the compiled pass to a
line-by-line Python transliteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from gpu_backend.host.batch import StepBatch, launch_runs, stale_plan
from gpu_backend.host.staging import ALIGN, StepArrays
from sim.jit_cache import drop_stale

drop_stale(__file__)

import numba as nb  # noqa: E402


@dataclass(frozen=True)
class Device:
    """The device attributes FlashInfer's planner reads."""
    sms: int  # cudaDevAttrMultiProcessorCount
    cc_major: int  # compute capability
    smem_optin: int  # bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin

    @classmethod
    def of(cls, device: Any) -> Device:

        p = torch.cuda.get_device_properties(device)
        # torch builds without the opt-in limit: an SM's shared memory less the 1 KB CUDA
        # reserves per block (A100, H100/H200); the first plan of each graph checks the result
        optin = getattr(p, "shared_memory_per_block_optin",
                        p.shared_memory_per_multiprocessor - 1024)
        return cls(p.multi_processor_count, p.major, int(optin))


H200 = Device(132, 9, 232448)  # for laying out graph steps without a GPU (tests, benches)


@dataclass(frozen=True)
class Planner:
    """What a plan depends on besides the step: the device and the attention's shape."""
    device: Device
    hq: int
    hkv: int
    head_dim: int
    page_size: int
    kv_bytes: int  # sizeof the K/V dtype

    @classmethod
    def for_model(cls, model: Any, device: Device) -> Planner:
        """For a trace's `trace.ModelShape` (2-byte K/V: `pool.torch_dtype`'s fp16/bf16)."""
        return cls(device, model.num_q_heads, model.num_kv_heads, model.head_dim,
                   model.page_size, 2)

    def cta_tile_q(self, packed_qo_len: int) -> int:
        """utils.cuh `FA2DetermineCtaTileQ`."""
        d = self.head_dim
        if d >= 512:
            return 16 if packed_qo_len <= 32 else 32
        if packed_qo_len > 64 and d < 256:
            return 128
        if self.device.cc_major < 8 or packed_qo_len > 16:
            return 64
        fits = 16 * d * 2 + 2 * d * 16 * 4 * self.kv_bytes <= self.device.smem_optin
        return 16 if fits else 64


@dataclass(frozen=True)
class Layout:
    """A plan's constants for R rows of W queries: the C++ planner's plan info and where each
    array sits in the int workspace (bytes)."""
    rows: int
    width: int
    page_size: int
    cta_tile_q: int
    tiles_q: int  # query tiles a row
    max_batch: int  # max_batch_size_if_split
    padded: int  # padded_batch_size: the kernel's grid
    min_chunk: int  # min_kv_chunk_size, pages
    max_partial_rows: int
    at: dict[str, int]
    nbytes: int  # what the planner copies to the device (int_workspace_size_out)
    info: tuple[int, ...]  # `PrefillPlanInfo::ToVector`

    @property
    def words(self) -> int:
        """int32 words that hold the image."""
        return -(-self.nbytes // 4)

    def used(self, img: np.ndarray) -> np.ndarray:
        """bool per byte of plan `img`: the bytes the C++ planner sets for that plan (the
        request and tile arrays up to its work items, `new_batch_size`)."""
        u = np.zeros(self.nbytes, dtype=bool)
        items = int(img.view(np.uint8)[self.at["block_valid_mask"]:][: self.padded].sum())
        for name, n in (("request_indices", 4 * items), ("qo_tile_indices", 4 * items),
                        ("kv_tile_indices", 4 * items), ("o_indptr", 4 * (self.rows + 1)),
                        ("kv_chunk_size", 4), ("total_num_rows", 4),
                        ("merge_indptr", 4 * (self.rows * self.width + 1)),
                        ("block_valid_mask", self.padded)):
            u[self.at[name]: self.at[name] + n] = True
        return u


def _alloc(at: int, size: int, align: int) -> tuple[int, int]:
    """allocator.h `aligned_alloc_offset` from an aligned base: (offset, end)."""
    off = at + (-at % align)
    return off, off + size


@lru_cache(maxsize=64)
def layout(p: Planner, rows: int, width: int) -> Layout:
    """scheduler.cuh `PrefillPlanImpl`'s allocations, in its order."""
    gqa = p.hq // p.hkv
    packed = width * gqa
    cta = p.cta_tile_q(packed)
    tiles = -(-packed // cta)
    max_batch = (2 * p.device.sms) // p.hkv  # num_blocks_per_sm = 2, no colocated CTAs
    padded = max(max_batch, rows * tiles)
    total = rows * width
    at: dict[str, int] = {}
    end = 0
    for name, size, align in (("request_indices", 4 * padded, 16),
                              ("qo_tile_indices", 4 * padded, 16),
                              ("kv_tile_indices", 4 * padded, 16),
                              ("o_indptr", 4 * (rows + 1), 16), ("kv_chunk_size", 4, 1),
                              ("total_num_rows", 4, 16), ("merge_indptr", 4 * (total + 1), 16),
                              ("block_valid_mask", padded, 16)):
        at[name], end = _alloc(end, size, align)
    partial = -(-padded * cta // gqa)
    v_size = p.hq * partial * p.head_dim * 4
    s_off = _alloc(v_size, 0, 16)[0]
    info = (padded, total, at["total_num_rows"], cta, at["request_indices"],
            at["qo_tile_indices"], at["kv_tile_indices"], at["merge_indptr"], at["o_indptr"],
            at["kv_chunk_size"], 0, s_off, at["block_valid_mask"], 1, 1)
    return Layout(rows, width, p.page_size, cta, tiles, max_batch, padded,
                  max(128 // p.page_size, 1), partial, at, end, info)


def image(lay: Layout, kv_indptr: np.ndarray) -> np.ndarray | None:
    """The int workspace bytes the C++ planner copies to the device for a step of these page
    counts (`kv_indptr`: the step's int32 page offsets, len rows + 1), as int32 words; None if
    the planner would refuse them (a check that fails in scheduler.cuh)."""
    a = lay.at
    out = np.zeros(lay.words, dtype=np.int32)
    ok = _fill(kv_indptr, lay.rows, lay.width, lay.tiles_q, lay.max_batch, lay.padded,
               lay.min_chunk, lay.max_partial_rows, lay.page_size, a["request_indices"] // 4,
               a["qo_tile_indices"] // 4, a["kv_tile_indices"] // 4, a["o_indptr"] // 4,
               a["kv_chunk_size"] // 4, a["total_num_rows"] // 4, a["merge_indptr"] // 4,
               a["block_valid_mask"], out)
    return out if ok else None


@nb.njit(cache=True)
def _fill(kv_indptr: np.ndarray, B: int, W: int, tiles: int, max_batch: int, padded: int,
          min_chunk: int, max_partial: int, page_size: int, o_req: int, o_qt: int, o_kt: int,
          o_o: int, o_cs: int, o_rows: int, o_merge: int, o_mask: int, out: np.ndarray) -> bool:
    """`PrefillSplitQOKVIndptr` (uniform rows, CUDA-graph mode) and the copies after it in
    `PrefillPlanImpl`, into `out` (int32 words; o_mask in bytes)."""
    pages = np.empty(B, np.int64)
    high = 1
    for i in range(B):
        pages[i] = kv_indptr[i + 1] - kv_indptr[i]
        if pages[i] < 0:
            return False
        high = max(high, pages[i])
    low = min_chunk  # PrefillBinarySearchKVChunkSize
    while low < high:
        mid = (low + high) // 2
        n = 0
        for i in range(B):
            n += tiles * ((max(pages[i], 1) + mid - 1) // mid)
        if n > max_batch:
            low = mid + 1
        else:
            high = mid
    chunk = low
    k = 0
    merge = 0
    out[o_merge] = 0
    out[o_o] = 0
    for i in range(B):
        chunks = (max(pages[i], 1) + chunk - 1) // chunk
        for qt in range(tiles):
            for kt in range(chunks):
                if k >= padded:
                    return False  # new batch size over the padded one
                out[o_req + k] = i
                out[o_qt + k] = qt
                out[o_kt + k] = kt
                k += 1
        for r in range(W):
            merge += chunks
            out[o_merge + i * W + r + 1] = merge
        out[o_o + i + 1] = out[o_o + i] + W * chunks
    if out[o_o + B] > max_partial:
        return False  # the partial outputs would not fit the float workspace
    out[o_cs] = chunk * page_size
    out[o_rows] = B * W
    mask = out.view(np.uint8)
    for j in range(k):
        mask[o_mask + j] = 1
    return True


def agrees(lay: Layout, info: list[int], theirs: np.ndarray, kv_indptr: np.ndarray) -> bool:
    """This port's plan for page offsets `kv_indptr` is FlashInfer's: its plan info `info`
    (`PrefillPlanInfo::ToVector`) and its pinned buffer's bytes `theirs` (uint8), wherever the
    planner set them."""
    ours = image(lay, kv_indptr)
    if ours is None or tuple(int(x) for x in info) != lay.info or len(theirs) < lay.nbytes:
        return False
    used = lay.used(ours)
    return bool((ours.view(np.uint8)[: lay.nbytes][used] == theirs[: lay.nbytes][used]).all())

# the block's fields in order: (field, the step's array staged for it, how the kernels read it:
# "f" float64, "i" int64, "w" int32); "g0_" is the reference's one group (`batch.RefGroup`).
# `steady_jit._pack` writes the same layout in its compiled pass (tests/unit/test_steady_block.py
# holds the two to the same words)
_FIELDS = (("app_tok_m", "app_tok_m", "f"), ("app_pos_m", "app_pos_m", "f"),
           ("tslot", "tslot", "i"), ("true_pos", "true_pos", "i"), ("app_row", "app_row", "w"),
           ("append_pos", "append_pos", "w"), ("qo", "run0_qo", "w"),
           ("kv_indptr", "kv_indptr", "w"), ("last_page_len", "last_page_len", "w"),
           ("slots", "g0_slots", "i"), ("limit", "g0_limit", "i"),
           ("params", "gr_params", "i"), ("touched", "gr_touched", "i"),
           ("wpages", "gr_wpages", "i"), ("prows", "gr_prows", "i"),
           ("plan", "gr_plan", "w"), ("kv_indices", "kv_indices", "w"))

# gr_params: the counts and step numbers the graph's page checks read on the device
# (pool_triton's PARAMS: touched pages, target pages, targets to check, step, previous step, rows)
_PARAMS = 8

# gr_plan: FA2's plan, the int workspace's bytes as int32 words (`graph_block.image`), each staged
# as
# an int64 word
# (rows, query width W, capacities: kv_indices, touched pages, target pages, poisoned rows,
# the plan's words)
Key = tuple[int, int, int, int, int, int, int]


def offsets(key: Key) -> dict[str, tuple[int, int]]:
    """Field -> (offset, length) in words of a block of graph `key`: the fields one after the
    other, each aligned as `staging.Chunk.add` aligns an array."""
    R, W, cap_p, cap_t, cap_w, cap_r, plan = key
    sizes = {"qo": R + 1, "kv_indptr": R + 1, "last_page_len": R, "slots": R, "limit": R * W,
             "params": _PARAMS, "touched": cap_t, "wpages": cap_w, "prows": cap_r,
             "plan": plan, "kv_indices": cap_p}
    out, at = {}, 0
    for name, _, _ in _FIELDS:
        n = sizes.get(name, R * W)
        out[name] = (at, n)
        at += n + (-n % ALIGN)
    return out


def _cap(n: int, floor: int) -> int:
    """The power of two at or above max(n, floor)."""
    return 1 << (max(n, floor, 1) - 1).bit_length()


def block(caps: dict[tuple[int, int], Key], b: StepBatch, arrays: dict[str, np.ndarray],
          ops: list[Any], wpages: np.ndarray, wcheck: int, prev: int, ok: bool,
          groups: list[Any], planner: Planner) -> Key | None:
    """If step b can replay as a graph, add its padded arrays, order its arrays so that the
    graph's fields are staged first, one after the other (the block `span` names), and return
    its graph key; else None. `caps`: the replay's capacities so far by (rows, W), grown here.
    `ok`: no prefix fill, no RoPE overrun, truth positions == engine's, queries == appends;
    `groups`: the reference's (`batch.RefGroup`); `prev`: the step prepared before b;
    `planner`: the replay's device and attention shape, for FA2's plan (`graph_block`)."""
    R = b.num_rows
    if (not candidate(b, ok, groups) or stale_plan(b, 0, R, "verify") is not None
            or any(kind != "nan" for kind, *_ in ops)):
        return None
    W = int(b.q_len[0])
    lay = layout(planner, R, W)
    plan = image(lay, b.kv_indptr) if (b.q_len == W).all() else None
    if plan is None:
        return None  # rows of other widths, or page counts FlashInfer's planner refuses
    touched = arrays.get("touched", np.zeros(0, dtype=np.int64))  # distinct, as the eager path's
    prows = np.concatenate([arrays[f"ev{a}"] for _, a, *_ in ops]) if ops else \
        np.zeros(0, dtype=np.int64)
    have = caps.get((R, W), (R, W, 0, 0, 0, 0, 0))
    # floors: a few growths at most over a replay (each one captures a graph)
    key = caps[(R, W)] = (R, W, max(have[2], _cap(len(b.kv_indices), 1)),
                          max(have[3], _cap(len(touched), 4 * R)),
                          max(have[4], _cap(len(wpages), 4 * R)),
                          max(have[5], _cap(len(prows), 16 * R)), lay.words)
    arrays["gr_plan"] = plan
    arrays["gr_params"] = np.array([len(touched), len(wpages), wcheck, b.step, prev, len(prows),
                                    0, 0], dtype=np.int64)
    for name, a, cap in (("gr_touched", touched, key[3]), ("gr_wpages", wpages, key[4]),
                         ("gr_prows", prows, key[5])):
        arrays[name] = np.zeros(cap, dtype=np.int64)
        arrays[name][: len(a)] = a
    first = {name: arrays.pop(name) for _, name, _ in _FIELDS}
    rest = dict(arrays)
    arrays.clear()
    arrays |= first | rest
    return key


def candidate(b: StepBatch, ok: bool, groups: list[Any]) -> bool:
    """Whether step b has the one shape a graph replays (`block` checks the rest): FA2, one
    verify launch over every row, the reference's one identity group; `ok` as `block`'s."""
    if b.backend != "fa2" or not ok or len(groups) != 1 or not groups[0].identity \
            or groups[0].pre != "g0_":
        return False
    runs = launch_runs(b)
    return len(runs) == 1 and runs[0][2] == "verify"


def span(dv: StepArrays) -> None:
    """Name the staged block `gblk` (int64 words): from the first field to the end of the
    last."""
    (_, _, first), (shape, _, last) = dv.slots["app_tok_m"], dv.slots["kv_indices"]
    dv.slots["gblk"] = ((last + shape[0] - first,), (1,), first)
