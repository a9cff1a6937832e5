"""The fp32 reference attention, the per-token errors and the K/V/Q content as Triton kernels
(GPU only; `oracle.attend`, `oracle.token_errors` and `pool.content_kv_q` elsewhere). The
content launch also writes the truth K/V and lays Q out as the kernels take it (round 3: no
index_put, no permute copy). Launches go through `tlaunch.Launcher` (less host time per call).

Why: in torch the reference took ~20 calls and 0.65 ms of device time per benchmark step (QKᵀ
and P·V as batched matmuls through an [R·H_kv, g·W, L] fp32 score tensor written and re-read,
softmax, the hi/lo split), more than four times the kernels it checks. Here one program per
(row, kv head, tile of queries) streams the row's truth K/V once (online softmax), so the
device reads each K/V byte once and the host queues one launch.

Precision is `oracle.attend`'s: Q·Kᵀ on the tensor cores from the bf16/fp16 values with fp32
accumulation (every product exact in fp32), softmax in fp32, and P split into hi + lo halves of
V's dtype for two P·V products (P keeps ~16 bits). The online rescaling adds fp32 rounding
only (checked against fp64 on the H200: docs/gpu.md).

Masking: query j of row r sees keys 0..limit[r, j], limit non-decreasing in j (causal rows);
keys past the last limit of a program's tile of queries are not visited at all (exp(-inf) is
exactly 0, so skipping them changes nothing).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gpu_backend.poolk import (  # noqa: F401  (pool reaches the kernels through here)
    post_check,
    resum,
    resum_pre,
)
from gpu_backend.tlaunch import Launcher


@triton.jit
def _attend_kernel(Q, KV, SLOTS, LIMIT, OUT, PART, sq_r, sq_w, sq_h, skv_kv, skv_s, skv_h,
                   skv_l, so_r, so_w, so_h, sl_r, W, G, L, HKV, S, CHUNK, scale,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   RAGGED: tl.constexpr, SPLIT: tl.constexpr):
    # the device starts programs in order, axis 0 first: a row's programs one after the other
    # (its K/V stays in L2 while its tiles read it; a launch of many prompt rows would
    # otherwise spread each wave over every row), and within a row the last tile of queries
    # first: a causal prompt's last tiles read the most keys (the longest first shortens the
    # tail). One row, or rows of one tile each, start in the order of the grid before it
    # (row * HKV + kv head, then the tiles): the same programs, the same bits
    # SPLIT: S programs share a (tile, kv head), each the keys of one chunk of CHUNK (the
    # innermost index of axis 0); their partial softmax states go to PART, `_merge_kernel` joins
    pid = tl.program_id(0)  # (tile of queries * HKV + kv head) * S + chunk
    r = tl.program_id(1)
    c = pid % S
    pid = pid // S
    h = pid % HKV
    tile = tl.num_programs(0) // S // HKV - 1 - pid // HKV
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query = (group head gi, position w)
    if RAGGED:  # LIMIT: [3, R] rows (first token, queries, committed keys); Q, OUT by token
        wr = tl.load(LIMIT + sl_r + r)
        valid = i < G * wr
        w = i % wr
        head = h * G + i // wr
        at_q = (tl.load(LIMIT + r) + w) * sq_w
        at_o = (tl.load(LIMIT + r) + w) * so_w
        lim = tl.load(LIMIT + 2 * sl_r + r) + w  # query j of a context row: committed + j
    else:
        valid = i < G * W
        w = i % W
        head = h * G + i // W
        at_q = r * sq_r + w * sq_w
        at_o = r * so_r + w * so_w
        lim = tl.load(LIMIT + r * sl_r + w, mask=valid, other=0)  # padding queries see key 0
    d = tl.arange(0, D)
    q = tl.load(Q + at_q[:, None] + head[:, None] * sq_h + d[None, :], mask=valid[:, None],
                other=0.0)
    base = KV + tl.load(SLOTS + r) * skv_s + h * skv_h
    # the tile's last visible key + 1: every key past it is masked for all of the tile's queries
    # (a causal prompt's early tiles stop early: half the work of a prefill row, bit for bit the
    # same output, since a fully masked block leaves m, den and acc exactly as they were)
    hi = tl.minimum(tl.max(tl.where(valid, lim, 0), 0) + 1, L)
    lo = c * CHUNK  # 0 unsplit (CHUNK >= L)
    hi = tl.minimum(hi, lo + CHUNK)
    # a finite start: a fully masked tile then gives alpha = 1, p = 0, not NaN
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        inside = (n < hi)[:, None]
        k = tl.load(base + n[:, None] * skv_l + d[None, :], mask=inside, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(n[None, :] <= lim[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        v = tl.load(base + skv_kv + n[:, None] * skv_l + d[None, :], mask=inside, other=0.0)
        p_hi = p.to(v.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_hi, v) + tl.dot(p_lo, v)
        m = m_new
    if SPLIT:  # PART: acc [S, R, W, Hq, D], then (m, den) [S, R, W, Hq, 2] (past hi: -1e30, 0)
        n_acc = tl.cast(S, tl.int64) * tl.num_programs(1) * W * G * HKV
        at = ((c.to(tl.int64) * tl.num_programs(1) + r) * W + w) * (G * HKV) + head
        tl.store(PART + at[:, None] * D + d[None, :], acc, mask=valid[:, None])
        tl.store(PART + n_acc * D + 2 * at, m, mask=valid)
        tl.store(PART + n_acc * D + 2 * at + 1, den, mask=valid)
    else:
        o = acc / den[:, None]
        tl.store(OUT + at_o[:, None] + head[:, None] * so_h + d[None, :], o, mask=valid[:, None])


@triton.jit
def _merge_kernel(PART, OUT, so_r, so_w, so_h, R, W, S, D: tl.constexpr):
    # one program a (row, query, head): the chunks' states rescaled to their common max, as the
    # online softmax rescales a chunk's blocks, summed in chunk order. A chunk past the row's
    # keys adds exact zeros (m -1e30, den 0), so the bits do not depend on S, and one chunk
    # gives acc / den exactly as the unsplit kernel (alpha = exp(0) = 1); chunk 0 always sees
    # key 0, so the max is finite
    rw = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    hq = tl.num_programs(1)
    d = tl.arange(0, D)
    rw_all = tl.cast(R, tl.int64) * W
    states = PART + S * rw_all * hq * D
    top = tl.load(states + 2 * (rw * hq + head))
    for c in range(1, S):
        top = tl.maximum(top, tl.load(states + 2 * ((c * rw_all + rw) * hq + head)))
    acc = tl.zeros([D], tl.float32)
    den = 0.0
    for c in range(0, S):
        at = (c * rw_all + rw) * hq + head
        alpha = tl.exp(tl.load(states + 2 * at) - top)
        acc += tl.load(PART + at * D + d) * alpha
        den += tl.load(states + 2 * at + 1) * alpha
    tl.store(OUT + (rw // W) * so_r + (rw % W) * so_w + head * so_h + d, acc / den)


def supported(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes: power-of-two head_dim 16..256, bf16/fp16 K/V."""
    d = int(q.shape[-1])
    return (kv.dtype in (torch.bfloat16, torch.float16) and q.dtype == kv.dtype
            and 16 <= d <= 256 and d & (d - 1) == 0 and kv.stride(-1) == 1)


def attend(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, limit: torch.Tensor,
           L: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 attention of q [R, W, Hq, D] over the truth store kv [2, slots, H_kv, span, D]:
    row r reads slot slots[r], keys 0..L-1, query j sees keys <= limit[r, j] (int64 [R, W]).
    Returns [R, W, Hq, D] fp32 (`oracle.attend`'s result, one launch), written into `out` when
    given (fp32 [R, W, Hq, D], last dim contiguous: a slice of the step's output)."""
    R, W, Hq, D = q.shape
    hkv = int(kv.shape[2])
    g = Hq // hkv
    q = q if q.stride(-1) == 1 else q.contiguous()
    limit = limit if limit.stride(-1) == 1 else limit.contiguous()
    if out is None:
        out = torch.empty((R, W, Hq, D), dtype=torch.float32, device=q.device)
    elif out.shape != (R, W, Hq, D) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out: fp32 {tuple(q.shape)} with a contiguous last dim, not "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    bm = _block_m(g * W, R)
    tiles = triton.cdiv(g * W, bm) * hkv
    S, chunk = _chunks(g * W, L, R * W * Hq * (D + 2) * 4)
    part = torch.empty(S * R * W * Hq * (D + 2), dtype=torch.float32, device=q.device) \
        if S > 1 else out
    _attend((tiles * S, R), q, kv, slots, limit, out, part, q.stride(0), q.stride(1),
            q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), out.stride(0),
            out.stride(1), out.stride(2), limit.stride(0), W, g, L, hkv, S, chunk,
            1.0 / math.sqrt(D), D=D, BLOCK_M=bm, BLOCK_N=BLOCK_N, RAGGED=False, SPLIT=S > 1)
    if S > 1:
        _merge((R * W, Hq), part, out, out.stride(0), out.stride(1), out.stride(2), R, W, S,
               D=D)
    return out


BLOCK_N = 64
# a launch whose queries of a row and kv head fit one small tile (a generation step's: 16 at
# MTP W = 4 and GQA 4, 512 programs at 64 rows of 8 kv heads) splits the keys into chunks of
# SPLIT_KEYS, one program a chunk, as FlashInfer's decode splits the kv: a program had streamed
# a whole row's keys alone, the SMs a few programs each. The chunks are fixed (not L's share),
# so a row's bits do not depend on L (a graph's key bound is the truth store's span, an eager
# step's its longest row), unless their fp32 states would pass PART_BYTES: then twice as many
# keys a chunk, as often as it takes. 0: no split
SPLIT_KEYS = 512
SPLIT_QUERIES = 32
PART_BYTES = 1 << 28


def _chunks(queries: int, L: int, chunk_bytes: int) -> tuple[int, int]:
    """(chunks, keys a chunk) of a launch of `queries` a row and kv head (group heads x width)
    over L keys, `chunk_bytes` of states a chunk: (1, L) unsplit (one chunk's bits are the
    unsplit kernel's)."""
    if SPLIT_KEYS <= 0 or queries > SPLIT_QUERIES:
        return 1, max(L, 1)
    chunk = SPLIT_KEYS
    while triton.cdiv(L, chunk) > 1 and triton.cdiv(L, chunk) * chunk_bytes > PART_BYTES:
        chunk *= 2
    S = triton.cdiv(L, chunk)
    return (S, chunk) if S > 1 else (1, max(L, 1))


def attend_rows(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                W: int, L: int, out: torch.Tensor) -> torch.Tensor:
    """`attend` of context rows of several lengths in one launch (`refgroups`' together
    group): q [n, Hq, D] is the step's, row r's queries the tokens rows[0, r] ..
    rows[0, r] + rows[1, r] - 1, query j seeing keys <= rows[2, r] + j (its committed keys + j,
    as a causal context row's), over slot slots[r]; every row has a query; W: the longest row,
    L: the keys any row reads. Writes those tokens of out [n, Hq, D] fp32 (the step's) and
    nothing else. A row's bits are those of its own `attend` launch with the same tiles (W's
    tile height)."""
    n, Hq, D = q.shape
    hkv = int(kv.shape[2])
    g, R = Hq // hkv, int(rows.shape[1])
    q = q if q.stride(-1) == 1 else q.contiguous()
    if out.shape != q.shape or out.dtype != torch.float32 or out.stride(-1) != 1 or \
            rows.dtype != torch.int64 or rows.stride(-1) != 1:
        raise ValueError(f"out: fp32 {tuple(q.shape)} with a contiguous last dim, rows: int64 "
                         f"[3, R] contiguous; not {out.dtype} {tuple(out.shape)}, "
                         f"{rows.dtype} {tuple(rows.shape)}")
    bm = _block_m(g * W, R)
    _attend((triton.cdiv(g * W, bm) * hkv, R), q, kv, slots, rows, out, out, 0, q.stride(0),
            q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), 0,
            out.stride(0), out.stride(1), rows.stride(0), W, g, L, hkv, 1, max(L, 1),
            1.0 / math.sqrt(D), D=D, BLOCK_M=bm, BLOCK_N=BLOCK_N, RAGGED=True, SPLIT=False)
    return out


def _block_m(queries: int, rows: int) -> int:
    """The tile of queries for rows of `queries` (group heads x width) each; the rows are the
    grid's axis 1 (at most 65,535)."""
    if rows > 65_535:
        raise ValueError(f"{rows} rows in one reference launch: at most 65,535")
    return 16 if queries <= 16 else 32 if queries <= 32 else 64


@triton.jit
def _token_err_kernel(OUT, REF, TOK, n, N, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    inside = i < N
    row = t.to(tl.int64) * N  # a prompt step's nnz * Hq * D can pass 2^31
    o = tl.load(OUT + row + i, mask=inside, other=0.0).to(tl.float32)
    r = tl.load(REF + row + i, mask=inside, other=0.0)
    d = tl.abs(o - r)
    # torch's amax: NaN as soon as one element is NaN, else the max
    err = tl.max(tl.where(d != d, 0.0, d), 0)
    err = tl.where(tl.max((d != d).to(tl.int32), 0) > 0, float("nan"), err)
    top = tl.max(tl.where(inside & (r == r), r, float("-inf")), 0)
    top = tl.where(tl.max((r != r).to(tl.int32), 0) > 0, float("nan"), top)
    tl.store(TOK + t, err)
    tl.store(TOK + n + t, top)


def token_errors(out: torch.Tensor, ref: torch.Tensor,
                 into: torch.Tensor | None = None) -> torch.Tensor:
    """`oracle.token_errors` in one launch (one program per token): [2, nnz_q] fp32, max
    |out - ref| and max ref per token, NaN where the token holds one (written into `into`, a
    contiguous [2, nnz_q] fp32, when given: a CUDA graph's output)."""
    n = int(out.shape[0])
    N = out[0].numel() if n else 0
    tok = torch.empty((2, n), dtype=torch.float32, device=out.device) if into is None else into
    if n:
        _token_err((n,), out.contiguous(), ref.contiguous(), tok, n, N,
                   BLOCK=triton.next_power_of_2(N))
    return tok


@triton.jit
def _content_kernel(TOK, POS, A, P, C, KV, QO, TR, SLOT, TPOS, n, N, turn, st_c, st_s, st_h,
                    st_l, GAIN: tl.constexpr, BLOCK: tl.constexpr, D: tl.constexpr,
                    TRUTH: tl.constexpr, TOKENS: tl.constexpr):
    # TOKENS tokens a program, on grid x (y and z stop at 65,535: a prompt step has more): a
    # block's coefficients are loaded once for them (`CONTENT_TOKENS`)
    blk = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    inside = i < N
    a = tl.load(A + blk * N + i, mask=inside)
    p = tl.load(P + blk * N + i, mask=inside)
    c = tl.load(C + blk * N + i, mask=inside)
    for j in tl.static_range(TOKENS):
        t = tl.program_id(0) * TOKENS + j
        live = t < n
        keep = inside & live
        # float64 integer arithmetic, exact below 2^53 (pool.content_blocks): any order, fma or
        # not, and fmod give the bits of torch's addcmul/remainder
        ph = (c + tl.load(TOK + t, mask=live, other=0.0) * a
              + tl.load(POS + t, mask=live, other=0.0) * p) % 1000003.0
        x = libdevice.sin(ph.to(tl.float32) * turn)  # __nv_sinf: CUDA's sinf, as torch's sin
        t64 = t.to(tl.int64)
        if blk >= 2:  # Q, in the kernels' [n, heads, D] layout (head = (blk - 2) * H_kv + h)
            tl.store(QO + (t64 * (tl.num_programs(1) - 2) + blk - 2) * N + i,
                     (x * GAIN).to(QO.dtype.element_ty), mask=keep)
        else:  # K, V: [2, n, H_kv, D]
            tl.store(KV + (blk * n + t64) * N + i, x.to(KV.dtype.element_ty), mask=keep)
            if TRUTH:  # and the truth store at (slot, true position): [2, slots, H_kv, span, D]
                at = blk * st_c + tl.load(SLOT + t, mask=live, other=0) * st_s + \
                    tl.load(TPOS + t, mask=live, other=0) * st_l
                tl.store(TR + at + (i // D) * st_h + i % D, x.to(TR.dtype.element_ty),
                         mask=keep)


# tokens a content program writes in a long step (a prompts' step): each program loaded its
# block's three float64 coefficient rows (24 KB at H_kv x D = 1024) for one token, 786k
# programs at 64 x 2k; a step of fewer tokens keeps one a program (enough programs for the SMs)
CONTENT_TOKENS = 8
CONTENT_LONG = 1 << 14


def content_kv_q(tok: torch.Tensor, pos: torch.Tensor, coeffs: tuple[torch.Tensor, ...],
                 dtype: torch.dtype, turn: float, gain: float,
                 truth: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`pool.content_kv_q` in one launch: coeffs (a, p, c) float64 [blocks, 1, H_kv, D].
    Returns K/V [2, n, H_kv, D] and Q [n, (blocks - 2) * H_kv, D] (None when blocks == 2) in
    dtype; truth = (store [2, slots, H_kv, span, D], slot [n], position [n]): K/V written there
    too, in the same launch."""
    a, p, c = coeffs
    blocks, _, hkv, d = a.shape
    n = int(tok.shape[0])
    kv = torch.empty((2, n, hkv, d), dtype=dtype, device=tok.device)
    q = torch.empty((n, (blocks - 2) * hkv, d), dtype=dtype, device=tok.device) \
        if blocks > 2 else None
    if n:
        tr, slot, tpos = truth if truth is not None else (kv, tok, tok)
        per = CONTENT_TOKENS if n >= CONTENT_LONG else 1
        _content((triton.cdiv(n, per), blocks), tok, pos, a, p, c, kv, kv if q is None else q,
                 tr, slot, tpos, n, hkv * d, turn, tr.stride(0), tr.stride(1), tr.stride(2),
                 tr.stride(3) if tr.dim() > 3 else 0, GAIN=gain,
                 BLOCK=triton.next_power_of_2(hkv * d), D=d, TRUTH=truth is not None,
                 TOKENS=per)
    return kv, q


# num_stages 2, not 3: bit-identical output, 12% less device time at kv 2k-8k, the same at
# batch 256 kv 8k (36 configs timed on the H200, docs/gpu.md round 5). A generation step's
# launch on 32-key blocks and 3 stages timed 0.89-0.94x in a probe (round 24), but a whole
# replay's device-bound steps did not move (2.33-2.36x against 2.34-2.35): not kept
_attend = Launcher(_attend_kernel, num_warps=4, num_stages=2)
_merge = Launcher(_merge_kernel, num_warps=4)
_token_err = Launcher(_token_err_kernel, num_warps=4)
_content = Launcher(_content_kernel, num_warps=4)
