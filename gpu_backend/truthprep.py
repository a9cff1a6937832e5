"""The truth side of a step's preparation (`gpu_backend.prepare`): the truth store's shape, the
live requests' slots in it (admission with their prefixes, release after their last step), and
the content's inputs (token and position mod M, the RoPE-overrun NaN mask) that the truth and the
engine's K/V/Q are built from."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gpu_backend import hostpool, prepk
from gpu_backend.layout import StepBatch
from gpu_backend.pool import M, mod_m
from gpu_backend.tracedata import TraceData
from sim.errors import TraceError

if TYPE_CHECKING:
    from gpu_backend.prepare import HostState


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
    whether it did; if not, nothing is added. b: `promptbatch.prompts_batch`'s (its appends are its
    queries), per token or not."""
    top = prepk.row_positions(b.tokens, b.rope_pos, b.q_len, b.committed, M)
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
    split = hostpool.parts(n) > 1
    if len(b.app_tokens) == n and (prepk.takes(n) or split):
        tok_m, pos_m, top, same = (prepk.content_split if split else prepk.content)(
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
        # the content's queries are the appends' (`driver._content` reads no q2a): a prompts'
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
