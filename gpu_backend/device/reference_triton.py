"""The fp32 reference attention, the per-token errors and the K/V/Q content as Triton kernels
(GPU only; `reference.attend`, `reference.token_errors` and `pool.content_kv_q` elsewhere). The
content launch also writes the truth K/V and lays Q out as the kernels take it (no
index_put, no permute copy). Launches go through `pool_triton.Launcher` (less host time per call).

Why: in torch the reference took ~20 calls and 0.65 ms of device time per benchmark step (QKᵀ
and P·V as batched matmuls through an [R·H_kv, g·W, L] fp32 score tensor written and re-read,
softmax, the hi/lo split), more than four times the kernels it checks. Here one program per
(row, kv head, tile of queries) streams the row's truth K/V once (online softmax), so the
device reads each K/V byte once and the host queues one launch.

Precision is `reference.attend`'s: Q·Kᵀ on the tensor cores from the bf16/fp16 values with fp32
accumulation (every product exact in fp32), softmax in fp32, and P split into hi + lo halves of
V's dtype for two P·V products (P keeps ~16 bits). The online rescaling adds fp32 rounding
only (checked against fp64 on the H200: docs/gpu.md, Verdicts and tolerance).

Masking: query j of row r sees keys 0..limit[r, j], limit non-decreasing in j (causal rows);
keys past the last limit of a program's tile of queries are not visited at all (exp(-inf) is
exactly 0, so skipping them changes nothing). A launch of more than ONE_TILE queries a row and kv
head (prompts, chunks) masks only the blocks of keys some query of the tile does not see, and
takes its exponentials as exp2 with log2(e) folded into the scale (`LEAN`: 0.91x the
time of a 64 x 2k prompts' step, within 2e-7 of its error from fp64).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gpu_backend.device.pool_triton import Launcher


@triton.jit
def _block(q, base, n0, hi, lim, m, den, acc, c, skv_kv, skv_l, D: tl.constexpr,
           BLOCK_N: tl.constexpr, MASK: tl.constexpr, LOG2: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N - 1 into the online softmax (m, den, acc); MASK: keys past a
    query's limit or past hi are masked (else every query sees every key of the block); LOG2:
    c has log2(e) folded in and the exponentials are exp2."""
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    inside = (n < hi)[:, None]
    if MASK:
        k = tl.load(base + n[:, None] * skv_l + d[None, :], mask=inside, other=0.0)
    else:
        k = tl.load(base + n[:, None] * skv_l + d[None, :])
    s = tl.dot(q, tl.trans(k)) * c
    if MASK:
        s = tl.where(n[None, :] <= lim[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    if LOG2:
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
    else:
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
    den = den * alpha + tl.sum(p, 1)
    if MASK:
        v = tl.load(base + skv_kv + n[:, None] * skv_l + d[None, :], mask=inside, other=0.0)
    else:
        v = tl.load(base + skv_kv + n[:, None] * skv_l + d[None, :])
    p_hi = p.to(v.dtype)
    p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(p_hi, v) + tl.dot(p_lo, v)
    return m_new, den, acc


@triton.jit
def _attend_kernel(Q, KV, SLOTS, LIMIT, OUT, sq_r, sq_w, sq_h, skv_kv, skv_s, skv_h, skv_l,
                   so_r, so_w, so_h, sl_r, W, G, L, HKV, scale,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   RAGGED: tl.constexpr, LEAN: tl.constexpr):
    # the device starts programs in order, axis 0 first: a row's programs one after the other
    # (its K/V stays in L2 while its tiles read it; a launch of many prompt rows would
    # otherwise spread each wave over every row), and within a row the last tile of queries
    # first: a causal prompt's last tiles read the most keys (the longest first shortens the
    # tail). One row, or rows of one tile each, start in the order of the grid before it
    # (row * HKV + kv head, then the tiles): the same programs, the same bits
    pid = tl.program_id(0)  # tile of queries * HKV + kv head
    r = tl.program_id(1)
    h = pid % HKV
    tile = tl.num_programs(0) // HKV - 1 - pid // HKV
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
    # a finite start: a fully masked tile then gives alpha = 1, p = 0, not NaN
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if LEAN:
        # the blocks of keys every query of the tile sees go unmasked (a causal prompt's tile
        # masks its last one or two), and the logits are in log2 units, scale * log2(e) in one
        # multiply (tl.exp takes them there anyway): 0.91x the time of a 64 x 2k prompts' step.
        # Splitting the loop costs a generation step's launch 1.22x (its ~33 blocks
        # in two pipelined loops), so it takes the other way
        c = scale * 1.4426950408889634
        full = tl.minimum(tl.min(tl.where(valid, lim, L), 0) + 1, hi) // BLOCK_N * BLOCK_N
        for n0 in range(0, full, BLOCK_N):
            m, den, acc = _block(q, base, n0, hi, lim, m, den, acc, c, skv_kv, skv_l, D,
                                 BLOCK_N, False, True)
        for n0 in range(full, hi, BLOCK_N):
            m, den, acc = _block(q, base, n0, hi, lim, m, den, acc, c, skv_kv, skv_l, D,
                                 BLOCK_N, True, True)
    else:
        for n0 in range(0, hi, BLOCK_N):
            m, den, acc = _block(q, base, n0, hi, lim, m, den, acc, scale, skv_kv, skv_l, D,
                                 BLOCK_N, True, False)
    o = acc / den[:, None]
    tl.store(OUT + at_o[:, None] + head[:, None] * so_h + d[None, :], o, mask=valid[:, None])


def supported(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes: power-of-two head_dim 16..256, bf16/fp16 K/V."""
    d = int(q.shape[-1])
    return (kv.dtype in (torch.bfloat16, torch.float16) and q.dtype == kv.dtype
            and 16 <= d <= 256 and d & (d - 1) == 0 and kv.stride(-1) == 1)


def attend(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, limit: torch.Tensor,
           L: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 attention of q [R, W, Hq, D] over the truth store kv [2, slots, H_kv, span, D]:
    row r reads slot slots[r], keys 0..L-1, query j sees keys <= limit[r, j] (int64 [R, W]).
    Returns [R, W, Hq, D] fp32 (`reference.attend`'s result, one launch), written into `out` when
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
    bn, launch = _launch(g * W)
    launch((triton.cdiv(g * W, bm) * hkv, R), q, kv, slots, limit, out, q.stride(0),
           q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
           out.stride(0), out.stride(1), out.stride(2), limit.stride(0), W, g, L, hkv,
           1.0 / math.sqrt(D), D=D, BLOCK_M=bm, BLOCK_N=bn, RAGGED=False,
           LEAN=g * W > ONE_TILE)
    return out


def attend_rows(q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                W: int, L: int, out: torch.Tensor) -> torch.Tensor:
    """`attend` of context rows of several lengths in one launch (`truth`' together
    group): q [n, Hq, D] is the step's, row r's queries the tokens rows[0, r] ..
    rows[0, r] + rows[1, r] - 1, query j seeing keys <= rows[2, r] + j (its committed keys + j,
    as a causal context row's), over slot slots[r]; every row has a query; W: the longest row,
    L: the keys any row reads. Writes those tokens of out [n, Hq, D] fp32 (the step's) and
    nothing else. A row's bits are those of its own `attend` launch with the same tiles (W's
    tile height and kind of launch)."""
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
    bn, launch = _launch(g * W)
    launch((triton.cdiv(g * W, bm) * hkv, R), q, kv, slots, rows, out, 0, q.stride(0),
           q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), 0,
           out.stride(0), out.stride(1), rows.stride(0), W, g, L, hkv, 1.0 / math.sqrt(D), D=D,
           BLOCK_M=bm, BLOCK_N=bn, RAGGED=True, LEAN=g * W > ONE_TILE)
    return out


# (BLOCK_N, warps, stages) of the reference's launches: a generation step's (one tile of
# queries a row and kv head, ONE_TILE) and the others (prompts, chunks). The stages only
# pipeline the loads: the same bits. A step's: 2 stages took 0.88x 3's time at kv 2k-8k
# (36 configs); 32-key blocks on 3 stages 0.89-0.94x in a probe but not in a whole replay.
# The others: 3 stages 0.96x 2's at a 64 x 2k prompts' step (9.00 against 9.37 ms)
STEP_LAUNCH = (64, 4, 2)
ROWS_LAUNCH = (64, 4, 3)
ONE_TILE = 64


def _launch(queries: int) -> tuple[int, Launcher]:
    """(BLOCK_N, launcher) of a launch of `queries` a row and kv head."""
    bn, warps, stages = STEP_LAUNCH if queries <= ONE_TILE else ROWS_LAUNCH
    return bn, _launcher(warps, stages)


@functools.cache
def _launcher(warps: int, stages: int) -> Launcher:
    return Launcher(_attend_kernel, num_warps=warps, num_stages=stages)


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
    """`reference.token_errors` in one launch (one program per token): [2, nnz_q] fp32, max
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
        # not, gives the bits of torch's addcmul
        ph = c + tl.load(TOK + t, mask=live, other=0.0) * a \
            + tl.load(POS + t, mask=live, other=0.0) * p
        # x mod M, the bits of torch's remainder, every step exact: not `%`, whose float64
        # fmod is a loop of ~100 instructions (4.8 ms of a 128 x 2k prompts' step's content
        # went there). The quotient from 1/M may be one off; the remainder says which way
        m = ph - tl.floor(ph * (1.0 / 1000003.0)) * 1000003.0
        m = tl.where(m < 0.0, m + 1000003.0, m)
        ph = tl.where(m >= 1000003.0, m - 1000003.0, m)
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
        launch = _content_long if per > 1 else _content
        launch((triton.cdiv(n, per), blocks), tok, pos, a, p, c, kv, kv if q is None else q,
               tr, slot, tpos, n, hkv * d, turn, tr.stride(0), tr.stride(1), tr.stride(2),
               tr.stride(3) if tr.dim() > 3 else 0, GAIN=gain,
               BLOCK=triton.next_power_of_2(hkv * d), D=d, TRUTH=truth is not None,
               TOKENS=per)
    return kv, q


_token_err = Launcher(_token_err_kernel, num_warps=4)
_content = Launcher(_content_kernel, num_warps=4)
# a long step's (CONTENT_TOKENS a program) on 8 warps: a 64 x 2k prompts' step's content took
# 1.68 against 2.00 ms on 4 (128 x 2k 3.34 against 4.01, the same bits; 16 tokens a program or
# 2 warps were slower)
_content_long = Launcher(_content_kernel, num_warps=8)
