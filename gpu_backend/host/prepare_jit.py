"""The host's threads for a long step's compiled passes (`layout_jit.split`,
`prepare_jit.content_split`): the prompts' step, whose preparation the device waits for before its
first launch. The passes release the GIL, so the parts run at once on the host's cores.

A generation step's small preparation passes, each one compiled (numba) call.

Why: a steady generation step at batch 64 x kv 2k took ~0.55 ms of host to prepare on a
development machine and 0.5-0.9 ms on the H200's hosts, longer than
the device's ~0.35 ms step, spread over ~150 small numpy calls of a few µs each (each cheap
alone, dear in a loop whose arrays are cold in the cache). These passes replace the largest
groups of them, one call each. The numpy code each replaces stays beside its caller as the
oracle it is tested against (tests/unit/test_prepare_jit.py).

A step's block events as pool operations in one compiled pass, for the usual generation
step: its events poison or keep pages, no block is shared or copied, no free is a double free.

Why: `events.event_ops` walks a 64 x 2k generation step's ~10 events in Python, then
`events.join_rewind` turns the poisoned pages into pool rows behind the last step's rewound
slots: ~12 µs of a ~75 µs preparation on a development machine, ~35 on the H200's host.
Here that is one call. `event_ops` and `join_rewind` stay as the oracle: tests/unit/
test_events_jit.py holds every step of the replay test traces to them (the ops, their arrays,
the touched pages, the shared blocks after).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gpu_backend.host.batch import PoolOp
from gpu_backend.trace import EVENT_CODES, EventColumns, TraceData
from sim.jit_cache import drop_stale

drop_stale(__file__)

import numba as nb  # noqa: E402

THREADS = 8  # at most (fewer where the host has fewer cores)
# a step of at least this many appends is split: the prompts' step; a generation step's few
# hundred are one call each
SPLIT = 1 << 15
_POOL: tuple[int, ThreadPoolExecutor] | None = None


_CPUS = os.cpu_count() or 1  # asked once: each call reads the kernel's CPU list (twice a step)


def threads() -> int:
    """Threads a long step's passes are split across on this host (1: not split)."""
    return min(THREADS, _CPUS)


def parts(n: int) -> int:
    """Parts a pass over n appends (or queries) is split into: 1, one call, below SPLIT."""
    return threads() if n >= SPLIT else 1


def pool() -> ThreadPoolExecutor:
    """This process's threads, started on first use (a forked process starts its own)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(threads(), thread_name_prefix="kvsim-host"))
    return _POOL[1]

# `truth` sorts with numba's quicksort, ~5x slower than numpy's vectorized sort: a prompts'
# step's 131k appends (64 x 2k) took 3.1 ms that way against 1.3 in numpy; `content`'s loop
# loses to numpy's vectorized passes there too. They take the steps of at most this many
# appends, where a call's overhead is what counts
SMALL = 4096


def takes(n: int) -> bool:
    """Whether a pass takes a step of n appends (else its numpy does)."""
    return n <= SMALL


@nb.njit(cache=True)
def targets(ew: np.ndarray, pages: int, touched: np.ndarray, has_touched: bool,
            allowed: np.ndarray, write_ok: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """`truth._numpy_targets` and `truth._blameless` in one pass: (wpages, wcheck, wok).
    ew: each append's pool index (`engine_write`); touched: the pages the events touched,
    sorted and distinct (has_touched: there were any); allowed: the pages the truth lets the
    step write; write_ok: per append, its row may write that page."""
    keep = np.empty(len(ew), np.int64)
    m = nw = 0
    wrong = np.empty(len(ew), np.int64)
    for k in range(len(ew)):
        v = ew[k]
        # a page's appends come in a run: the sort below sees ~a page count (131k -> 8k
        # values in a 64 x 2k prompts' step)
        if 0 <= v < pages and (m == 0 or keep[m - 1] != v):
            keep[m] = v
            m += 1
        if not write_ok[k] and (nw == 0 or wrong[nw - 1] != v):
            wrong[nw] = v
            nw += 1
    w = distinct(keep[:m])
    wpages = np.empty(len(w), np.int64)
    n_new = 0
    if has_touched:  # the pages the events did not touch first, then those they did
        for x in w:
            if not has(touched, x):
                wpages[n_new] = x
                n_new += 1
        at = n_new
        for x in w:
            if has(touched, x):
                wpages[at] = x
                at += 1
    else:
        wpages[:] = w
        n_new = len(w)
    ok_keys = distinct(allowed.astype(np.int64))
    wrong_keys = distinct(wrong[:nw])
    wok = np.empty(len(wpages), np.bool_)
    for i in range(len(wpages)):
        wok[i] = has(ok_keys, wpages[i]) and not has(wrong_keys, wpages[i])
    return wpages, n_new, wok


@nb.njit(cache=True)
def distinct(a: np.ndarray) -> np.ndarray:
    """np.unique of int64 values, sorted: numba's np.unique builds lists (~10 µs of
    `layout_jit.flatten`'s ~45 at batch 64) and compiles for seconds more."""
    s = a.copy()  # contiguous whatever the slice: one sort compiled, not one a layout
    i = 1
    while i < len(s) and s[i - 1] <= s[i]:
        i += 1
    if i < len(s):  # a prompts' step's ~8k own pages come in order: 54 µs of sorting saved
        s.sort()
    n = 0
    for i in range(len(s)):
        if i == 0 or s[i] != s[n - 1]:
            s[n] = s[i]
            n += 1
    return s[:n]


@nb.njit(cache=True)
def runs(x: np.ndarray) -> np.ndarray:
    """`truth.runs` in one branchless pass: each run of equal values down to its first (a
    prompts' step's 131k write targets to ~8k in 53 µs, against 114 for numpy's compare and
    compress on a development machine)."""
    out = np.empty(len(x), x.dtype)
    if not len(x):
        return out
    out[0] = x[0]
    m = 1
    for k in range(1, len(x)):
        v = x[k]
        out[m] = v
        m += v != x[k - 1]
    return out[:m]


@nb.njit(cache=True)
def has(sorted_keys: np.ndarray, x: int) -> bool:
    """x is in sorted_keys (a binary search: numba's np.searchsorted compiles for longer).
    `layout_jit` shares it."""
    lo, hi = 0, len(sorted_keys)
    while lo < hi:
        mid = (lo + hi) >> 1
        if sorted_keys[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo < len(sorted_keys) and sorted_keys[lo] == x


@nb.njit(cache=True)
def identity_group(committed: np.ndarray, slots: np.ndarray, W: int
                   ) -> tuple[np.ndarray, bool, int, int]:
    """`truth._identity_group`'s numbers: (limit [R, W]: committed + j, the slots
    consecutive, the longest row's committed + W, the smallest limit + 1). R >= 1."""
    R = len(committed)
    limit = np.empty((R, W), np.int64)
    top, low = committed[0], committed[0]
    consecutive = True
    for r in range(R):
        c = committed[r]
        top, low = max(top, c), min(low, c)
        for j in range(W):
            limit[r, j] = c + j
        if r and slots[r] - slots[r - 1] != 1:
            consecutive = False
    return limit, consecutive, top + W, low + 1


@nb.njit(cache=True)
def seq_lens(indptr: np.ndarray, last_page_len: np.ndarray, B: int) -> np.ndarray:
    """FlashInfer's `get_seq_lens`: (pages - 1) * B + the last page's tokens, per row (int32,
    as `layout.kernel_arrays`' numpy gave it)."""
    R = len(last_page_len)
    out = np.empty(R, np.int32)
    for r in range(R):
        out[r] = max(indptr[r + 1] - indptr[r] - 1, 0) * B + last_page_len[r]
    return out


@nb.njit(cache=True)
def rewind(reject_page: np.ndarray, reject_slot: np.ndarray, pz: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """`prepare._rewind`'s (pool rows, pages) of the rejected drafts' slots: each slot's K row,
    then its V row a page size on; the pages sorted and distinct."""
    n = len(reject_page)
    rows = np.empty(2 * n, np.int64)
    for i in range(n):
        rows[i] = reject_page[i] * 2 * pz + reject_slot[i]
        rows[n + i] = rows[i] + pz
    return rows, distinct(reject_page.astype(np.int64))


@nb.njit(cache=True)
def pool_rows(pages: np.ndarray, rows: int, lead: np.ndarray) -> np.ndarray:
    """`prepare._pool_ops`' rows of a run of poisoned pages: `lead` (the last step's rewound
    rows, or none), then each page's `rows` pool rows, page by page (int64)."""
    n = len(lead)
    out = np.empty(n + len(pages) * rows, np.int64)
    out[:n] = lead
    for i in range(len(pages)):
        base = pages[i] * rows
        for j in range(rows):
            out[n + i * rows + j] = base + j
    return out


@nb.njit(cache=True)
def content(tokens: np.ndarray, rope: np.ndarray, rope_pos: np.ndarray, true_pos: np.ndarray,
            M: int) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """`truth.content_arrays`' numbers for a step whose queries are its appends:
    (tokens mod M, RoPE positions mod M, both float64 as `pool.mod_m` gives them; the largest
    RoPE position (-1: none); the engine's RoPE positions are the truth's)."""
    n = len(tokens)
    tok_m, pos_m = np.empty(n, np.float64), np.empty(n, np.float64)
    top, same = content_part(tokens, rope, rope_pos, true_pos, M, tok_m, pos_m, 0, n)
    return tok_m, pos_m, top, same and len(rope_pos) == len(true_pos)


@nb.njit(cache=True, nogil=True)
def content_part(tokens: np.ndarray, rope: np.ndarray, rope_pos: np.ndarray,
                 true_pos: np.ndarray, M: int, tok_m: np.ndarray, pos_m: np.ndarray, i0: int,
                 i1: int) -> tuple[int, bool]:
    """`content` over [i0, i1) into tok_m and pos_m: (the largest RoPE position there, -1 if
    none; rope_pos == true_pos there, as far as both reach). Releases the GIL
    (`content_split`)."""
    top = -1
    for i in range(i0, i1):
        t, p = tokens[i], rope[i]
        top = max(top, p)
        tok_m[i] = t if 0 <= t < M else t % M  # an int64 % is ~40 cycles: only when needed
        pos_m[i] = p if 0 <= p < M else p % M
    same = True
    for i in range(i0, min(i1, len(rope_pos), len(true_pos))):
        if rope_pos[i] != true_pos[i]:
            same = False
            break
    return top, same


def content_split(tokens: np.ndarray, rope: np.ndarray, rope_pos: np.ndarray,
                  true_pos: np.ndarray, M: int) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """`content` in parts, one a thread (`prepare_jit`): a long step's (the prompts' step's,
    whose preparation the device waits for)."""
    n, parts = len(tokens), threads()
    tok_m, pos_m = np.empty(n, np.float64), np.empty(n, np.float64)
    cuts = [i * n // parts for i in range(parts + 1)]
    got = list(pool().map(
        lambda i: content_part(tokens, rope, rope_pos, true_pos, M, tok_m, pos_m, cuts[i],
                               cuts[i + 1]), range(parts)))
    top = max((t for t, _ in got), default=-1)
    return tok_m, pos_m, top, all(s for _, s in got) and len(rope_pos) == len(true_pos)


@nb.njit(cache=True)
def token_rows(q_len: np.ndarray, committed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`layout.prompts_batch`'s (row_of_token int32, true_pos int64): row r's q_len[r] tokens
    in order, at committed[r] + j. Two numpy repeats and an arange took ~0.3 ms of a 64 x 2k
    prompts' step on a development machine, before its first launch."""
    n = 0
    for r in range(len(q_len)):
        n += q_len[r]
    row, true_pos = np.empty(n, np.int32), np.empty(n, np.int64)
    t = 0
    for r in range(len(q_len)):
        c, ql = committed[r], q_len[r]
        row[t: t + ql] = r  # the slice and the loop below vectorize: ~0.6x one loop of both
        for j in range(ql):
            true_pos[t + j] = c + j
        t += ql
    return row, true_pos


@nb.njit(cache=True)
def row_positions(tokens: np.ndarray, rope_pos: np.ndarray, q_len: np.ndarray,
                  committed: np.ndarray, M: int) -> int:
    """`truth.row_content`'s check of a prompts' step: the largest RoPE position when row
    r's queries are tokens qo[r].. at RoPE positions committed[r] + j (the truth's) and every
    token and position is in [0, M); else -1. Reads each token once and writes nothing."""
    if len(tokens) != len(rope_pos):
        return -1
    t, top = 0, -1
    for r in range(len(q_len)):
        c, ql = committed[r], q_len[r]
        if t + ql > len(tokens) or c < 0 or c + ql > M:
            return -1
        # reductions LLVM vectorizes (xor-or, min, max over the row's slices): 24 against 129
        # µs at a 64 x 2k prompts' step with the comparisons or-ed as booleans
        x, k = rope_pos[t: t + ql], tokens[t: t + ql]
        bad, lo, hi = 0, 0, 0
        for j in range(ql):
            bad |= x[j] ^ (c + j)
            lo = min(lo, k[j])
            hi = max(hi, k[j])
        if bad != 0 or lo < 0 or hi >= M:
            return -1
        t += ql
        if ql:
            top = max(top, c + ql - 1)
    return top if t == len(tokens) else -1

_ALLOC, _COPY, _EVICT, _DONE = (EVENT_CODES.index(e) for e in ("alloc", "copy", "evict", "done"))
_NONE = np.zeros(0, dtype=np.int64)
_EMPTY = EventColumns(_NONE, _NONE, _NONE, _NONE, _NONE, _NONE)


def pool_ops(trace: TraceData, step: int, guard: int, late: list[int], shared: set[int],
             rewind: tuple[np.ndarray, np.ndarray] | None, arrays: dict[str, np.ndarray]
             ) -> tuple[list[PoolOp], np.ndarray] | None:
    """What `events.join_rewind(event_ops(...))` makes of step `step`'s events (after launch
    step - 1, before launch step) and `late` (the in-flight poison before it), behind the last
    step's `rewind` (rows, pages): (ops, touched pages), the poisoned rows in `arrays`, and
    `shared` kept. None, nothing changed: an event copies a slot or leaves a block shared
    (the trace's double frees are the caller's to rule out: `events.InFlight`)."""
    a = trace.event_columns.get((step - 1, "proc"), _EMPTY)
    b = trace.event_columns.get((step, "sched"), _EMPTY)
    lead, pages = rewind if rewind is not None else (_NONE, _NONE)
    rows, touched, n = _pass(a.code, a.block, a.refcount, a.src, b.code, b.block, b.refcount,
                             b.src, np.asarray(late, dtype=np.int64), guard,
                             2 * trace.model.page_size, lead, pages)
    if n < 0:
        return None
    if shared:  # every block an event names has one holder or none now
        for c in (a, b):
            shared.difference_update(c.block[c.code != _DONE].tolist())
    if n:
        arrays["ev0"] = rows
        return [("nan", 0, 0, 0)], touched
    if rewind is None:
        return [], touched
    arrays["ev-1"] = rows
    return [("nan", -1, 0, 0)], touched


@nb.njit(cache=True)
def _pass(code_a, block_a, count_a, src_a, code_b, block_b, count_b, src_b, late, guard,
          rows, lead, lead_pages):  # pragma: no cover  (compiled; its oracle is `event_ops`)
    """(the pool rows: `lead`, then each poisoned page's `rows`, the touched pages (the
    poisoned ones in order, then `lead_pages`), how many pages are poisoned), or n = -1 when
    an event copies a slot or leaves its block shared."""
    pages = np.empty(len(code_a) + len(code_b) + len(late), np.int64)
    n = _poisoned(code_a, block_a, count_a, src_a, guard, pages, 0)
    if n >= 0:
        n = _poisoned(code_b, block_b, count_b, src_b, guard, pages, n)
    if n < 0:
        return pool_rows(pages[:0], rows, lead), pages[:0], -1
    for blk in late:
        pages[n] = blk + guard
        n += 1
    touched = np.empty(n + len(lead_pages), np.int64)
    touched[:n] = pages[:n]
    touched[n:] = lead_pages
    return pool_rows(pages[:n], rows, lead), touched, n


@nb.njit(cache=True)
def _poisoned(code, block, count, src, guard, pages, n):  # pragma: no cover  (compiled)
    """The pool indices of the pages these events poison (alloc, evict) into pages[n:], in
    order; returns the new n, or -1 when one copies a slot or leaves its block shared."""
    for i in range(len(code)):
        k = code[i]
        if k == _DONE:
            continue
        if count[i] > 1 or (k == _COPY and src[i] >= 0):
            return -1
        if k == _ALLOC or k == _EVICT:
            pages[n] = block[i] + guard
            n += 1
    return n
