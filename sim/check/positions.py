"""Length and position invariants I8, I9, I11, I12, I16: host estimates against device truth.

    slots:  0 ........ committed ........ committed + q_len ........ max_pos
                       '-- new tokens j --'   append_pos[j] == rope_pos[j] == committed + j
"""

from __future__ import annotations

import numpy as np

from sim.check.view import Model, StepView, ceil_div, first_in_row, row_violations, seg_max
from sim.trace.records import Violation


def check_host_width(v: StepView, m: Model) -> list[Violation]:
    """I12 alone: it is the earliest sign of the first-generation-step fault."""
    need = ceil_div(v.col["kv_len_host"], m.B)
    return row_violations("I12", v, need > v.n_alloc, lambda r: (
        f"host page-table row needs {need[r]} blocks (kv_len_host {v.col['kv_len_host'][r]}, "
        f"B={m.B}) but {v.n_alloc[r]} are allocated"))


def check_positions(v: StepView) -> list[Violation]:
    return i9_positions(v) + i8_kernel_len(v) + i11_host_offset(v) + i16_limit(v)


def i8_kernel_len(v: StepView) -> list[Violation]:
    want = v.col["committed"] + v.col["q_len"]
    klen = v.acc.kernel_len
    return row_violations("I8", v, v.is_gen & (klen != want), lambda r: (
        f"kernel kv_len {klen[r]} != committed {v.col['committed'][r]} + q_len "
        f"{v.col['q_len'][r]} = {want[r]}"))


def i9_positions(v: StepView) -> list[Violation]:
    q = v.col["q_len"]
    n_app, n_rope = np.diff(v.lay.append_ptr), np.diff(v.rope_ptr)
    # A gen row may append the draft layers' extra KV past its q_len tokens (MTP-Eagle's own
    # draft KV); those continue the same positions and have no RoPE entry of their own.
    bad_len = (n_app < q) | (n_rope != q) | (~v.is_gen & (n_app != q))
    out = row_violations("I9", v, bad_len, lambda r: (
        f"{n_app[r]} append positions and {n_rope[r]} RoPE positions for q_len {q[r]}"))
    row = np.repeat(np.arange(v.n), n_app)
    j = np.arange(len(row)) - v.lay.append_ptr[row]
    want = v.col["committed"][row] + j
    app = v.lay.append_pos
    # compare RoPE element-wise only where both lists have q_len entries
    ok_len = (~bad_len)[row]
    same = ok_len & (j < q[row])
    rope = np.where(same, v.rope_pos[np.where(same, v.rope_ptr[row] + j, 0)]
                    if len(v.rope_pos) else -1, want)
    first = first_in_row(ok_len & ((app != want) | (rope != want)), row, v.n)
    return out + row_violations("I9", v, first >= 0, lambda r: (
        f"token {j[first[r]]}: append_pos {app[first[r]]}, rope_pos {rope[first[r]]}, expected "
        f"committed {v.col['committed'][r]} + {j[first[r]]} = {want[first[r]]}"))


def i11_host_offset(v: StepView) -> list[Violation]:
    c, host = v.col["committed"], v.col["cached_host"]
    first = v.is_gen & (v.col["first_gen"] != 0)
    out = row_violations("I11", v, first & (host != c), lambda r: (
        f"first generation step: cached_host {host[r]} != committed {c[r]} "
        f"(must use the prompt boundary)"))
    # overlap: the host assumed all W of the previous step accepted; the device knows 1 + a
    ahead = v.is_gen & ~first & (v.col["prev_in_flight"] != 0) & (v.col["prev_new_tokens"] >= 0)
    want = v.col["q_len"] - v.col["prev_new_tokens"]
    return out + row_violations("I11", v, ahead & (host - c != want), lambda r: (
        f"cached_host {host[r]} - committed {c[r]} = {host[r] - c[r]}, expected q_len "
        f"{v.col['q_len'][r]} - prev_new_tokens {v.col['prev_new_tokens'][r]} = {want[r]}"))


def i16_limit(v: StepView) -> list[Violation]:
    lim = v.col["max_pos"]
    top_w = seg_max(v.lay.append_pos, v.lay.append_ptr)
    top_r = seg_max(v.rope_pos, v.rope_ptr)
    top_k = v.acc.kernel_len - 1
    top = np.maximum(np.maximum(top_w, top_r), top_k)
    return row_violations("I16", v, top >= lim, lambda r: (
        f"position {top[r]} (append max {top_w[r]}, rope max {top_r[r]}, read max {top_k[r]}) "
        f"is not below the limit max_pos {lim[r]}"))
