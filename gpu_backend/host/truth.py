"""Sorted-integer set operations for the preparation's page and key arrays, cheaper than
numpy's general ones at its sizes (tens to a million values a step).

The pages a step's appends target, for the page watch (`watch.IncrementalWatch`): which it
checks, and on which a moved checksum blames nobody. One compiled pass (`prepare_jit.targets`) where
the step is long enough to pay its call, else numpy (its oracle, tests/unit/test_prepare_jit.py).

The truth side of a step's preparation (`gpu_backend.host.prepare`): the truth store's shape, the
live requests' slots in it (admission with their prefixes, release after their last step), and
the content's inputs (token and position mod M, the RoPE-overrun NaN mask) that the truth and the
engine's K/V/Q are built from.

The fp32 reference's batches of a step (`gpu_backend.host.prepare` stages their index arrays): the
gen rows in one group, each context row alone. A group is one batched attention over the truth
store (`reference_triton.attend`, `reference.attend`); its arrays are named with the group's prefix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gpu_backend.device.pool import M, mod_m
from gpu_backend.host import prepare_jit
from gpu_backend.host.batch import RefGroup, StepBatch
from gpu_backend.trace import TraceData
from sim.errors import TraceError

if TYPE_CHECKING:
    from gpu_backend.host.prepare import HostState


def unique(x: np.ndarray, collapse: bool = True) -> np.ndarray:
    """np.unique of an integer array, by a sort: numpy 2.4's hashing np.unique took 0.7 ms for
    8k page ids that sort in 0.04 ms, and 22 µs for 300 values against 4 this way, on a
    development machine. A long array loses its runs first (a page's tokens come one after
    another: a prompts' step's 131k write targets are ~8k runs); collapse=False: x is already
    `runs`' output (masked), which a second pass would barely shrink."""
    if collapse and len(x) > 4096:
        x = runs(x)
    s = ascending(x)  # x itself only past ASCENDING values: the gather below copies it
    return s[_starts(s)] if len(s) > 1 else s


ASCENDING = 256  # past this many values a sort first checks whether it has anything to do


def ascending(x: np.ndarray) -> np.ndarray:
    """x sorted: x itself when it is already in order (past ASCENDING values), else a sorted
    copy. A prompts' step's ~8k targets and allowed pages come in order, and numpy's sort took
    ~0.19 ms for them on a development machine against ~0.01 for the check (host work of the
    prompts' step while the device runs its reference)."""
    if len(x) > ASCENDING and bool((x[1:] >= x[:-1]).all()):
        return x
    return np.sort(x)


def runs(x: np.ndarray) -> np.ndarray:
    """x with each run of equal values down to its first (x not empty). np.compress: 43
    against 62 µs for boolean indexing at a prompts' step's 131k targets."""
    return np.compress(_starts(x), x)


def _starts(x: np.ndarray) -> np.ndarray:
    """Where a run of equal values starts (x not empty)."""
    keep = np.empty(len(x), dtype=bool)
    keep[0] = True
    np.not_equal(x[1:], x[:-1], out=keep[1:])
    return keep


def member(x: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    """np.isin(x, sorted_keys) for sorted keys: one binary search per value, no sort of both."""
    if not len(sorted_keys):
        return np.zeros(len(x), dtype=bool)
    if len(x) == len(sorted_keys) and np.array_equal(x, sorted_keys):
        # a prompts' step's ~8k targets are the pages its events allocated and the ones it may
        # write: 3 µs against 110 for the searches on a development machine
        return np.ones(len(x), dtype=bool)
    i = np.minimum(np.searchsorted(sorted_keys, x), len(sorted_keys) - 1)
    return sorted_keys[i] == x

_NONE = np.zeros(0, dtype=np.int64)


def distinct(pages: np.ndarray) -> np.ndarray:
    """The pages, sorted and distinct."""
    return prepare_jit.distinct(pages) if prepare_jit.takes(len(pages)) else unique(pages)


def targets(b: StepBatch, pages: int, touched: np.ndarray | None
            ) -> tuple[np.ndarray, int, np.ndarray]:
    """(wpages, wcheck, wok): the pages inside the pool that step b's appends target, those
    its events did not touch first, how many of the latter, and per page whether the step may
    write it through every append that does (`_blameless`). touched: the pages the events
    touched, sorted and distinct, or None."""
    if prepare_jit.takes(len(b.engine_write)):
        return prepare_jit.targets(b.engine_write, pages, _NONE if touched is None else touched,
                             touched is not None, b.allowed_pages, b.write_ok)
    w, n = _numpy_targets(b, pages, touched)
    return w, n, _blameless(b, w)


def _numpy_targets(b: StepBatch, pages: int, touched: np.ndarray | None) -> tuple[np.ndarray, int]:
    """(the pages the step's appends target inside the pool, those its events did not touch
    first; how many of the latter). touched: the pages the events touched, sorted, distinct."""
    ew, long = b.engine_write, len(b.engine_write) > 4096
    if long:  # a page's appends come in runs: ~16x fewer values to mask (131k -> 8k)
        ew = prepare_jit.runs(ew)
    w = unique(ew[(ew >= 0) & (ew < pages)], collapse=not long)
    if touched is None:
        return w, len(w)
    hit = member(w, touched)
    return np.concatenate([w[~hit], w[hit]]), int((~hit).sum())


def _blameless(b: StepBatch, wpages: np.ndarray) -> np.ndarray:
    """[len(wpages)] bool: the page is one the step may write (`allowed_pages`) and every append
    that targets it may write it (`write_ok`). A moved checksum on such a page is no row's
    fault (`verdicts.blame` finds none), so the usual step needs no blame at all."""
    ok = member(wpages, ascending(b.allowed_pages.astype(np.int64)))
    ew = b.engine_write
    wrong = unique(ew[~b.write_ok])
    return ok & ~member(wpages, wrong) if len(wrong) else ok


def truth_shape(trace: TraceData) -> tuple[int, int, dict[int, int]]:
    """(slots, span, last step of each request): the truth store holds the live requests'
    contiguous K/V; a request keeps its slot from its first row to its last row. Over the
    trace's row columns, all steps at once: the device waits for this before the prompts'
    step's first launch (a loop over the rows took 3.5-5 ms of a replay's start at 64 x 2k and
    128 x 8k, 96 steps; a loop over the steps and two np.unique 0.92 ms at 64 x 2k, 256 steps,
    on a development machine)."""
    steps = sorted(trace.rows)
    cols = [trace.columns[s] for s in steps]
    if not cols:
        return 1, 1, {}
    req = np.concatenate([c["request"] for c in cols])
    if not len(req):
        return 1, 1, {}
    ends = np.concatenate([c["committed"] for c in cols]) + \
        np.concatenate([c["q_len"] for c in cols])
    span = max(1, int(ends.max()))
    at = np.repeat(np.arange(len(steps)), [len(c["request"]) for c in cols])  # step positions
    # one stable sort: a request's rows in order, its first and last row at its run's ends
    order = np.argsort(req, kind="stable")
    by_req = req[order]
    run = np.flatnonzero(np.concatenate([[True], by_req[1:] != by_req[:-1]]))
    ids, first = by_req[run], order[run]
    last = order[np.concatenate([run[1:], [len(req)]]) - 1]
    # live at each step: started by it, less ended before it
    live = np.cumsum(np.bincount(at[first], minlength=len(steps))) - \
        np.concatenate([[0], np.cumsum(np.bincount(at[last], minlength=len(steps)))[:-1]])
    last_step = np.asarray(steps)[at[last]]
    return max(int(live.max()), 1), span, dict(zip(ids.tolist(), last_step.tolist(),
                                                   strict=True))


def release(st: HostState, step: int, requests: list[int] | np.ndarray) -> None:
    """A request's slot is free for the next step's admissions after its last step (in row
    order: the order of the free list decides later admissions)."""
    if st.ends is None:  # the steps where requests end: most steps end none (~6 µs a step
        # at batch 64 to find that by asking each row)
        st.ends = {}
        for req, last in st.last.items():
            st.ends.setdefault(last, set()).add(req)
    ending = st.ends.get(step)
    if not ending:
        return
    for req in _ints(requests):
        if req in ending and req in st.slot:
            st.free.append(st.slot.pop(req))


def _ints(requests: list[int] | np.ndarray) -> list[int]:
    return requests.tolist() if isinstance(requests, np.ndarray) else requests


def admit(st: HostState, b: StepBatch, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, bool]:
    """Truth slots of the step's rows; new requests that start at committed > 0 get their prefix
    (prompt tokens 0..committed-1) written into the store (`fill_*` arrays)."""
    return admit_rows(st, b.requests, b.committed, arrays)


def admit_rows(st: HostState, req: np.ndarray, committed: np.ndarray,
               arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, bool]:
    """`admit` of rows of these requests and committed tokens (the step's before its batch)."""
    # the last step's requests, all live: their slots. Compared as their dtype and bytes (the
    # same dtype and bytes: the same values): ~0.5 against np.array_equal's 3.9 µs at batch 64
    # on a development machine
    held = req.dtype.str.encode() + req.tobytes()
    if st.held is not None and held == st.held[0]:
        return st.held[1], False
    fs: list[np.ndarray] = []
    ft: list[np.ndarray] = []
    requests = req.tolist()
    for s, toks in take_slots(st, requests, committed.tolist()):
        fs.append(np.full(len(toks), s, dtype=np.int64))
        ft.append(np.asarray(toks, dtype=np.int64))
    slots = np.array([st.slot[r] for r in requests], dtype=np.int64)
    st.held = (held, slots)
    if not fs:
        return slots, False
    pos = np.concatenate([np.arange(len(t)) for t in ft])
    tok = np.concatenate(ft)
    arrays |= {"fill_slot": np.concatenate(fs), "fill_pos": pos, "fill_tok_m": mod_m(tok),
               "fill_pos_m": mod_m(pos)}
    return slots, True


def take_slots(st: HostState, requests: list[int], committed: list[int]
                ) -> list[tuple[int, tuple[int, ...]]]:
    """Give the step's new requests truth slots; returns (slot, prefix tokens) of those that
    start at committed > 0."""
    out = []
    for req, n in zip(requests, committed, strict=True):
        if req in st.slot:
            continue
        st.slot[req] = s = st.free.pop()
        if n > 0:
            toks = st.trace.prompts.get(req, ())
            if len(toks) < n:
                raise TraceError(f"request {req} starts at committed {n} but "
                                 f"requests.parquet holds {len(toks)} of its tokens")
            out.append((s, toks[:n]))
    return out


def row_content(st: HostState, b: StepBatch, slots: np.ndarray,
                arrays: dict[str, np.ndarray]) -> bool:
    """A prompts' step's content inputs from its rows, where they follow from them: every
    query's RoPE position is its row's committed + j (the truth's), under the RoPE table, and
    every token and position is in [0, M) (mod M changes none). Then only the tokens (`ptok`)
    and three numbers a row (`prow`: queries, truth slot, committed less the first token) are
    staged, and the device makes each token's float64 token and position, truth slot and true
    position from them (`staging.FromRows`): `content_arrays` staged four words a token and
    took most of the host's time before a 64 x 2k prompts' step's first launch. Returns
    whether it did; if not, nothing is added. b: `layout.prompts_batch`'s (its appends are its
    queries), per token or not."""
    top = prepare_jit.row_positions(b.tokens, b.rope_pos, b.q_len, b.committed, M)
    if top < 0 or (st.rope_rows is not None and top >= st.rope_rows):
        return False
    arrays |= {"ptok": b.tokens,
               "prow": np.stack([b.q_len.astype(np.int64), slots.astype(np.int64),
                                 b.committed.astype(np.int64) - b.qo_indptr[:-1]])}
    return True


def content_arrays(st: HostState, b: StepBatch, arrays: dict[str, np.ndarray]
                    ) -> tuple[bool, bool]:
    """Content inputs. Returns (engine NaN mask needed, truth content == engine content)."""
    # the usual step in one pass; a long one (the prompts' step) in parts on the host's
    # threads; else in numpy, whose vectorized min and max beat the compiled loop (1.3 against
    # ~0.3 ms at a 64 x 2k prompts' step's 131k tokens)
    n = b.num_tokens
    split = prepare_jit.parts(n) > 1
    if len(b.app_tokens) == n and (prepare_jit.takes(n) or split):
        tok_m, pos_m, top, same = (prepare_jit.content_split if split else prepare_jit.content)(
            b.app_tokens, b.app_rope, b.rope_pos, b.true_pos, M)
        arrays |= {"app_tok_m": tok_m, "app_pos_m": pos_m}
        if st.rope_rows is None or top < st.rope_rows:
            if not same:
                arrays |= {"tok_m": mod_m(b.tokens), "true_pos_m": mod_m(b.true_pos)}
            return False, same
    else:
        arrays |= {"app_tok_m": mod_m(b.app_tokens), "app_pos_m": mod_m(b.app_rope)}
    over = (b.app_rope >= st.rope_rows) if st.rope_rows is not None else \
        np.zeros(len(b.app_rope), dtype=bool)
    nq = st.trace.model.num_q_heads // st.trace.model.num_kv_heads
    if over.any():  # K and Q blocks of those tokens read past the RoPE table: NaN; V is not rotated
        mask = np.repeat(over[None, :], 2 + nq, axis=0)
        mask[1] = False
        arrays["eng_nan"] = mask[:, :, None, None]
    nan = bool(over.any())
    if len(b.app_tokens) == b.num_tokens:  # no device-ahead appends: query t is append t, and
        # the content's queries are the appends' (`loop._content` reads no q2a): a prompts'
        # step at 128 x 8k staged a million-word identity here
        q_nan = nan
    else:
        a_start = np.concatenate([[0], np.cumsum(np.bincount(b.app_row, minlength=b.num_rows))])
        q2a = a_start[b.row_of_token] + (np.arange(b.num_tokens) - b.qo_indptr[b.row_of_token])
        arrays["q2a"] = q2a
        q_nan = bool(over[q2a].any())
    same = not q_nan and bool(np.array_equal(b.rope_pos, b.true_pos))
    if not same:
        arrays |= {"tok_m": mod_m(b.tokens), "true_pos_m": mod_m(b.true_pos)}
    return nan, same


# context rows of at most this many keys go together (`ref_groups(together=)`): on the H200 a
# 64 x 2k prompts' step's reference in one launch moved the first generation step 0.7 ms sooner,
# but at 64 x 8k and 128 x 8k 4 and 13 ms later: a row's K/V (33 MB at 8k) then no
# longer shares the 50 MB L2 with the next row's, as a launch a row keeps it alone. 4k untried
TOGETHER_KEYS = 4096


def ref_groups(b: StepBatch, slots: np.ndarray, arrays: dict[str, np.ndarray],
               fast: bool = True, together: bool = False) -> list[RefGroup]:
    """The reference's batches: the gen rows in one group, each ctx row alone (as before).
    fast: a step of equal-width gen rows takes `_identity_group`, a ctx row
    `_single_row_group` (the general path is their oracle in tests). together: the ctx rows
    with queries and at most TOGETHER_KEYS keys in one group instead (`_ragged_group`; where
    `reference_triton`'s kernel runs, which alone takes such a group)."""
    if fast and not b.is_ctx.any() and b.num_rows and b.q_len[0] > 0 and \
            (b.q_len == b.q_len[0]).all():
        return [_identity_group(b, slots, arrays)]
    gen, ctx = np.flatnonzero(~b.is_ctx), np.flatnonzero(b.is_ctx)
    some = _together(b, ctx) if together else None
    if some is not None and some.sum() > 1:
        rows_of = [gen] if gen.size else []
        rows_of += [ctx[some]] + [np.array([i]) for i in ctx[~some]]
    else:
        rows_of = ([gen] if gen.size else []) + [np.array([i]) for i in ctx]
    out = []
    for g, rows in enumerate(rows_of):
        pre = f"g{g}_"
        if len(rows) > 1 and b.is_ctx[rows[0]]:
            out.append(_ragged_group(b, rows, slots, arrays, pre))
            continue
        if fast and len(rows) == 1 and b.q_len[rows[0]] > 0:
            out.append(_single_row_group(b, int(rows[0]), slots, arrays, pre))
            continue
        ql = b.q_len[rows]
        W = int(ql.max())
        j = np.arange(W)
        vr, vj = np.nonzero(j[None, :] < ql[:, None])
        sl = slots[rows]
        consecutive = sl.size == 1 or bool(np.all(np.diff(sl) == 1))
        tok = b.qo_indptr[rows][:, None] + np.minimum(j[None, :], ql[:, None] - 1)
        limit = b.committed[rows][:, None] + j[None, :]
        dst, src = tok[vr, vj], vr * W + vj
        identity = len(rows) == b.num_rows and bool(np.all(ql == W))
        run = bool(np.all(src == np.arange(len(src))) and np.all(np.diff(dst) == 1))
        arrays |= {pre + "limit": limit, pre + "slots": sl}
        group = RefGroup(pre, len(rows), W, int((b.committed[rows] + ql).max()),
                         int(sl[0]) if consecutive else -1, int(limit.min()) + 1, identity,
                         (int(dst[0]), int(dst[-1]) + 1) if run else None)
        if not group.view:
            arrays[pre + "tok"] = tok
        if not run:
            arrays |= {pre + "src": src, pre + "dst": dst}
        out.append(group)
    return out


def _single_row_group(b: StepBatch, r: int, slots: np.ndarray, arrays: dict[str, np.ndarray],
                      pre: str) -> RefGroup:
    """`ref_groups`' group of row r alone (a context row): its W queries are tokens
    qo[r] .. qo[r] + W - 1 in order, query j sees keys up to committed + j: the tokens' true
    positions (`RefGroup.true_limit`). A prompts' step has one per row: the general arithmetic
    took ~55 µs a row on a development machine, and its staged limits were a word a query (4 MB
    at 64 x 8k, ~1 ms of the host's time before the step's first launch)."""
    W, c, q0 = int(b.q_len[r]), int(b.committed[r]), int(b.qo_indptr[r])
    arrays[pre + "slots"] = slots[r: r + 1]
    return RefGroup(pre, 1, W, c + W, int(slots[r]), c + 1, b.num_rows == 1, (q0, q0 + W),
                    true_limit=True)


def _together(b: StepBatch, ctx: np.ndarray) -> np.ndarray:
    """Which of the context rows `ctx` may share a launch: with queries, at most
    TOGETHER_KEYS keys."""
    keys = b.committed[ctx].astype(np.int64) + b.q_len[ctx]
    return (b.q_len[ctx] > 0) & (keys <= TOGETHER_KEYS)


def _ragged_group(b: StepBatch, rows: np.ndarray, slots: np.ndarray,
                  arrays: dict[str, np.ndarray], pre: str) -> RefGroup:
    """`ref_groups`' context rows together: one launch for a prompts' step instead of one a
    row (each a tail of idle programs, ~20 µs of host for its arrays and launch), and a few
    numbers a row staged instead of each query's limit (the kernel takes committed + j)."""
    sl = slots[rows]
    ql, c = b.q_len[rows].astype(np.int64), b.committed[rows].astype(np.int64)
    arrays |= {pre + "slots": sl, pre + "rows": np.stack([b.qo_indptr[rows].astype(np.int64),
                                                            ql, c])}
    consecutive = bool(np.all(np.diff(sl) == 1))
    return RefGroup(pre, len(rows), int(ql.max()), int((c + ql).max()),
                    int(sl[0]) if consecutive else -1, int(c.min()) + 1, False, None, True)


def _identity_group(b: StepBatch, slots: np.ndarray, arrays: dict[str, np.ndarray]) -> RefGroup:
    """`ref_groups` of a step of gen rows all W wide (the steady MTP step) without its general
    index arithmetic: the group is the step in token order, token (r, j) at r * W + j."""
    R, W = b.num_rows, int(b.q_len[0])
    lim, consecutive, top, low = prepare_jit.identity_group(b.committed, slots, W)
    arrays |= {"g0_limit": lim, "g0_slots": slots}
    return RefGroup("g0_", R, W, int(top), int(slots[0]) if consecutive else -1, int(low),
                    True, (0, R * W))
