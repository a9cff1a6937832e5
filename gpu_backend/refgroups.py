"""The fp32 reference's batches of a step (`gpu_backend.prepare` stages their index arrays): the
gen rows in one group, each context row alone. A group is one batched attention over the truth
store (`refattn.attend`, `oracle.attend`); its arrays are named with the group's prefix."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpu_backend import prepk
from gpu_backend.layout import StepBatch


@dataclass(frozen=True)
class RefGroup:
    """Rows whose fp32 reference is one batched attention: R rows x W queries over L keys.
    s0 >= 0: their truth slots are s0.. s0+R-1 (views, no gather). Keys below `lo` are visible
    to every query (only [lo, L) is masked). identity: the group is the whole step in token
    order (q and the output need no gather); else `span` = (start, stop) when its tokens are one
    contiguous run in order, or None (index arrays `{pre}src`/`{pre}dst`). The queries are
    `{pre}tok` gathered, or a view of the step's (`view`)."""
    pre: str
    R: int
    W: int
    L: int
    s0: int
    lo: int
    identity: bool
    span: tuple[int, int] | None
    # context rows of any lengths in one launch (`ref_groups(together=)`, `refattn.attend_rows`):
    # `{pre}rows` [3, R] holds each row's first token, queries and committed keys; q and the
    # output are the step's own, by token
    ragged: bool = False
    # a context row alone: its limits (committed + j) are the step's true positions over
    # `span`, which the step stages anyway, not `{pre}limit` (`oracle.group_limit`)
    true_limit: bool = False

    @property
    def view(self) -> bool:
        """The group's queries and outputs are the step's own in order, [R * W] from span[0]:
        no `{pre}tok` gather, and the reference writes the step's output in place. A context
        row's group (a prompts' step has one a row: 64 gathers and 64 copies of its 2k
        queries' outputs at 64 x 2k)."""
        return self.identity or (self.R == 1 and self.span is not None)


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
    `refattn`'s kernel runs, which alone takes such a group)."""
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
    lim, consecutive, top, low = prepk.identity_group(b.committed, slots, W)
    arrays |= {"g0_limit": lim, "g0_slots": slots}
    return RefGroup("g0_", R, W, int(top), int(slots[0]) if consecutive else -1, int(low),
                    True, (0, R * W))
