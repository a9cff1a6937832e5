"""The poisoned paged KV pool and the deterministic K/V/Q content (same function on CPU and GPU).

Pool layout (NHD, one 5-D tensor as FlashInfer takes it):

    index:  0 .. G-1        G .. G+N-1            G+N .. G+N+G-1
            [ guard, NaN ]  [ page id p at p+G ]  [ guard, NaN ]
    shape:  [N + 2G, 2, B, H_kv, D]   ([:, 0] = K, [:, 1] = V)

Every slot starts as NaN (never written); guards stay NaN, so any read outside live data shows up
as NaN in the row's output, and any write to a guard shows up in the page checksums.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Protocol

import numpy as np
import torch

from gpu_backend.device import reference
from gpu_backend.host.batch import StepBatch
from gpu_backend.host.staging import StepArrays
from sim.trace.records import RowRecord


class KernelFault(Exception):
    """The kernels refused the step (a host-side check) or the backend saw an invalid access."""


class Kernels(Protocol):
    name: str

    def run_step(self, pool: KVPool, b: StepBatch, rows: list[RowRecord],
                 dv: StepArrays, k: torch.Tensor, v: torch.Tensor,
                 q: torch.Tensor) -> torch.Tensor:
        """Append k/v [nnz_a, H_kv, D] and return attention out [nnz_q, H_q, D] for q.
        dv: the step's arrays (device int64, and typed reads: int32, bool, pinned host int32)."""
        ...

# Content: x = sin(2*pi * ((t*A + p*P + C) mod M) / M), exact integer phase so CPU and GPU agree
# bit for bit up to one ulp of fp32 sin (then rounded to bf16). Adjacent positions give unrelated
# values, so a K/V/Q built at the wrong RoPE position changes the output by O(0.1), far above
# the kernels' bf16 noise.
_M = 1_000_003
M = _M  # the content's phase modulus (`mod_m`)
_Q_GAIN = 4.0  # logits std ~2 at D=128: attention weights are far from uniform
_TURN = float(np.float32(2 * math.pi / _M))  # the fp32 factor torch's mul_ applies


@functools.lru_cache(maxsize=32)
def _coeffs(kind: int, heads: int, dim: int, device: str) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(0x6B76 + kind)
    return tuple(torch.as_tensor(rng.integers(1, _M, size=(heads, dim), dtype=np.int64),
                                 device=device) for _ in range(3))


def content(tokens: torch.Tensor, positions: torch.Tensor, kind: int, heads: int, dim: int,
            dtype: torch.dtype, rope_rows: int | None = None) -> torch.Tensor:
    """K (kind 0), V (kind 1) or Q (kind 2) of tokens at positions.

    Args: tokens, positions: int64 [n] on the target device. Returns [n, heads, dim] in dtype.
    rope_rows: rows of the engine's RoPE table (max_position_embeddings), engine side only. K and
    Q are rotated through that table: a position >= rope_rows reads past its end, so that token's
    K/Q is garbage, emulated as NaN (V is not rotated). The truth side passes None.
    """
    a, p, c = _coeffs(kind, heads, dim, str(tokens.device))
    t = tokens.to(torch.int64)[:, None, None] % _M
    q = positions.to(torch.int64)[:, None, None] % _M
    phase = (t * a + q * p + c) % _M
    x = torch.sin(phase.to(torch.float32) * (2 * math.pi / _M))
    if rope_rows is not None and kind != 1:
        x = torch.where((positions.to(torch.int64) >= rope_rows)[:, None, None],
                        float("nan"), x)
    return (x * _Q_GAIN if kind == 2 else x).to(dtype)


_TOKENS_AT_ONCE = 1 << 14  # torch's path in parts: its float64 phases of a 64 x 2k prompts' step
# (131k tokens, six blocks of 8 x 128) took 6.4 GB at once on the CPU


def content_blocks(tok: torch.Tensor, pos: torch.Tensor, kv_heads: int, q_heads: int,
                   dim: int, dtype: torch.dtype, q: bool = True,
                   nan: torch.Tensor | None = None) -> torch.Tensor:
    """K, V and (q=True) Q of n tokens in one pass: [2 + q_heads // kv_heads, n, kv_heads, dim]
    (block 0 K, 1 V, 2.. Q heads in groups of kv_heads), bit for bit `content` of each kind.

    tok, pos: float64 [n] holding (token mod M) and (position mod M) (the staging uploads them
    so); integer arithmetic in float64 is exact below 2^53 and the phase stays below 3 M^2, so
    one pass of float64 ops replaces three int64 passes (int64 `%` is slow on the GPU).
    nan: bool [blocks, n, 1, 1], elements to set NaN (the engine's RoPE table overrun)."""
    coeffs = _block_coeffs(kv_heads, q_heads if q else 0, dim, str(tok.device))
    fused = _fused() if tok.is_cuda else None
    if fused is not None:  # one launch; Q comes in the kernels' layout: back to blocks
        kv, qh = fused.content_kv_q(tok, pos, coeffs, dtype, _TURN, _Q_GAIN)
        x = kv if qh is None else torch.cat(
            [kv, qh.view(qh.shape[0], -1, kv_heads, dim).permute(1, 0, 2, 3)])
        return x if nan is None else x.masked_fill_(nan, float("nan"))
    n = int(tok.shape[0])
    if n > _TOKENS_AT_ONCE:  # elementwise: the parts are the whole's bits
        return torch.cat([content_blocks(tok[i:i + _TOKENS_AT_ONCE], pos[i:i + _TOKENS_AT_ONCE],
                                         kv_heads, q_heads, dim, dtype, q,
                                         None if nan is None else nan[:, i:i + _TOKENS_AT_ONCE])
                          for i in range(0, n, _TOKENS_AT_ONCE)], dim=1)
    a, p, c = coeffs
    ph = torch.addcmul(c, tok[None, :, None, None], a)
    ph.addcmul_(pos[None, :, None, None], p).remainder_(_M)
    x = ph.to(torch.float32).mul_(2 * math.pi / _M).sin_()
    if q:
        x[2:].mul_(_Q_GAIN)
    if nan is not None:
        x.masked_fill_(nan, float("nan"))
    return x.to(dtype)


def content_kv_q(tok: torch.Tensor, pos: torch.Tensor, kv_heads: int, q_heads: int, dim: int,
                 dtype: torch.dtype, q: bool = True, nan: torch.Tensor | None = None,
                 truth: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`content_blocks` as the replay uses it: (K/V [2, n, kv_heads, dim], Q [n, q_heads, dim]
    or None), Q already in the kernels' head order (head = block * kv_heads + h). truth =
    (store [2, slots, kv_heads, span, dim], slot [n], position [n]): K/V also written there
    (truth[0][c, slot[t], :, position[t]] = K/V of token t). On the GPU all of it is one launch
    (no Q copy, no index_put for the truth); the values are the same bits either way."""
    fused = _fused() if tok.is_cuda else None
    if fused is not None and nan is None:
        coeffs = _block_coeffs(kv_heads, q_heads if q else 0, dim, str(tok.device))
        return fused.content_kv_q(tok, pos, coeffs, dtype, _TURN, _Q_GAIN, truth)
    x = content_blocks(tok, pos, kv_heads, q_heads, dim, dtype, q, nan)
    if truth is not None:
        store, slot, tpos = truth
        store[:, slot, :, tpos] = x[:2].permute(1, 0, 2, 3)
    qh = x[2:].permute(1, 0, 2, 3).reshape(x.shape[1], -1, dim) if q else None
    return x[:2], qh


@functools.lru_cache(maxsize=32)
def _block_coeffs(kv_heads: int, q_heads: int, dim: int, device: str) -> tuple[torch.Tensor, ...]:
    """The coefficients of `content` as float64 [blocks, 1, kv_heads, dim] (K, V, Q blocks)."""
    kinds = [_coeffs(0, kv_heads, dim, device), _coeffs(1, kv_heads, dim, device)]
    if q_heads:
        kinds.append(_coeffs(2, q_heads, dim, device))
    return tuple(torch.cat([k[i].reshape(-1, 1, kv_heads, dim) for k in kinds]).double()
                 for i in range(3))


def _fused() -> Any:
    return reference.triton_kernels()  # by name: tests take the torch path through it


def mod_m(x: np.ndarray) -> np.ndarray:
    """(x mod M) as float64, the input `content_blocks` takes. Token ids and positions are
    almost always in [0, M) already: the check costs 0.7 ms for a million values where int64 %
    costs 5-9 (a prompts' step at batch 128 x kv 8k has four such arrays)."""
    x = np.asarray(x, dtype=np.int64)
    if x.size and (x.min() < 0 or x.max() >= _M):
        x = x % _M
    return x.astype(np.float64)


def torch_dtype(name: str) -> torch.dtype:
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16}
    if name not in names:
        from sim.errors import TraceError

        raise TraceError(f"model dtype {name!r}: the replay supports {sorted(names)}")
    return names[name]


class KVPool:
    """The pool tensor plus the poison/copy/checksum operations the replay applies between steps."""

    def __init__(self, num_pages: int, guard: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.guard, self.num_pages, self.page_size = guard, num_pages, page_size
        shape = (num_pages + 2 * guard, 2, page_size, kv_heads, head_dim)
        self.data = torch.full(shape, float("nan"), dtype=dtype, device=device)
        # the same memory as raw 64-bit words per page (checksums) and as rows of H_kv * D
        # elements, one per (page, K|V, slot) (`slot_rows` numbers them; poison)
        self.words = self.data.view(shape[0], -1).view(torch.int64)
        self.rows = self.data.view(-1, kv_heads * head_dim)

    @property
    def total(self) -> int:
        return int(self.data.shape[0])

    def index(self, page_id: int) -> int:
        return page_id + self.guard

    def poison_rows(self, rows: torch.Tensor) -> None:
        """Poison (page, K|V, slot) rows of the pool seen as [pages * 2 * B, H_kv * D]
        (`slot_rows` numbers them; a whole page is its 2 * B rows): new pages, rejected drafts.
        index_fill_ takes the scalar as a kernel argument (`data[idx] = nan` would copy a CPU
        scalar tensor to the device: a stream sync); 7 µs of host on the H200."""
        self.rows.index_fill_(0, rows, float("nan"))

    def resum(self, sums: torch.Tensor, idx: torch.Tensor) -> None:
        """sums[idx] = checksum(idx): the pages an operation between steps touched."""
        fused = _fused() if idx.is_cuda else None
        if fused is not None:
            fused.resum(self.words, sums, idx)
        else:
            sums.index_copy_(0, idx, self.checksum(idx))

    def sums_and_changes(self, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(checksum(), checksum() != before): the pool after a step's kernels."""
        after = self.checksum()
        return after, after != before

    def resum_pre(self, touched: torch.Tensor | None, idx: torch.Tensor | None, check: int,
                  sums: torch.Tensor, pre: torch.Tensor, stamp: torch.Tensor,
                  flag: torch.Tensor, step: int) -> None:
        """After a step's events, before its kernels (`watch.IncrementalWatch`): sums[touched] =
        the touched pages' sums (`resum`); pre[idx] = the target pages' sums, stamp[idx] = step,
        and flag = 1 if one of the first `check` targets (none touched) differs from its
        expected sum."""
        fused = _fused() if flag.is_cuda else None
        if fused is not None:
            fused.resum_pre(self.words, touched, idx, check, sums, pre, stamp, flag, step)
            return
        if touched is not None:
            sums[touched] = self.checksum(touched)
        if idx is not None:
            s = self.checksum(idx)
            pre[idx], stamp[idx] = s, step
            flag |= (s[:check] != sums[idx[:check]]).any().to(flag.dtype)

    def post_check(self, idx: torch.Tensor | None, ahead: torch.Tensor | None,
                   sums: torch.Tensor, pre: torch.Tensor, stamp: torch.Tensor,
                   flag: torch.Tensor, step: int) -> torch.Tensor:
        """After a step's kernels: for pages idx (resum_pre's), moved = sum != pre[idx] (the
        result, bool) and sums[idx] = the sum; pages `loop` not stamped with this step: flag = 1
        if a sum differs from its expected value."""
        fused = _fused() if flag.is_cuda else None
        if fused is not None:
            return fused.post_check(self.words, idx, ahead, sums, pre, stamp, flag, step)
        moved = torch.zeros(0, dtype=torch.bool, device=flag.device)
        if idx is not None:
            s = self.checksum(idx)
            moved = s != pre[idx]
            sums[idx] = s
        if ahead is not None:
            ahead = ahead[stamp[ahead] != step]
            flag |= (self.checksum(ahead) != sums[ahead]).any().to(flag.dtype)
        return moved

    def full_check(self, sums: torch.Tensor, flag: torch.Tensor) -> None:
        """flag = 1 if any page's sum differs from its expected value."""
        flag |= (self.checksum() != sums).any().to(flag.dtype)

    def copy_slots(self, dst: int, src: int, n: int) -> None:
        self.data[dst, :, :n] = self.data[src, :, :n]

    def checksum(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        """[pages] (or [len(idx)]) int64: the page's raw 64-bit words summed modulo 2^64 (so
        NaN patterns compare exactly, and the order of the sum does not matter). A write of
        different bits changes the sum unless it cancels exactly, which deterministic content
        never does. int64 words, not int32 words summed into int64: the promoting reduction ran
        at 0.73 ms over the benchmark's 556 MB pool on the H200, this one at 0.13 ms."""
        words = self.words if idx is None else self.words.index_select(0, idx)
        return words.sum(dim=1)

    def fresh_checksum(self) -> torch.Tensor:
        """`checksum()` of a pool nothing has written since it was made: every page holds the
        same NaN, so one page's sum, repeated. Reading the whole pool for the watch's first look
        (`loop.Rig`) costs 0.13 ms of device at 64 x 2k on the H200."""
        return self.words[:1].sum(dim=1).expand(self.total).contiguous()

    def slot_rows(self, pages: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Row numbers of (page, K and V, slot) in `poison_rows`'s view."""
        base = np.asarray(pages, dtype=np.int64) * 2 * self.page_size + slots
        return np.concatenate([base, base + self.page_size])
