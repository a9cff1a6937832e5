"""`verdicts.judge` as one compiled (numba) pass over a read-back's tokens.

Why: a read-back of 16 generation steps at batch 64 x kv 2k (4k tokens) took the numpy judge
~0.23 ms of host on a development machine, ~15 numpy calls and two loops over the steps in
Python, on the replay loop's thread. Here one call walks the steps' rows and their tokens. The
numpy judge stays as its oracle (`verdicts.judge_numpy`, tests/unit/test_verdicts_jit.py).
"""

from __future__ import annotations

import numpy as np

from sim.jit_cache import drop_stale

drop_stale(__file__)

import numba as nb  # noqa: E402

OK, MISMATCH, NAN = 0, 1, 2  # `reference`'s codes (its module holds them to these)


@nb.njit(cache=True)
def judge(err: np.ndarray, ref_max: np.ndarray, qo: np.ndarray, rows: np.ndarray,
          tol: float) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover  (compiled)
    """Per-row codes and max errors of steps end to end: err / ref_max [tokens] float32 (the
    steps' `token_errors` rows), qo the steps' qo_indptr end to end (int64, R_i + 1 each),
    rows each step's row count. A NaN error where the reference has none makes its row NAN
    and counts as 0 in the max; infinities count as float32's extremes (`np.nan_to_num`)."""
    total = 0
    for i in range(len(rows)):
        total += rows[i]
    code = np.zeros(total, np.int64)
    row_err = np.zeros(total, np.float32)
    big = np.float32(np.finfo(np.float32).max)
    t32 = np.float32(tol)
    r = at = base = 0  # the row, its step's first entry of qo, the step's first token
    for i in range(len(rows)):
        for j in range(rows[i]):
            s, e = base + qo[at + j] - qo[at], base + qo[at + j + 1] - qo[at]
            m = np.float32(0.0)
            nan = False
            for t in range(s, e):
                x = err[t]
                if np.isnan(x):
                    nan = nan or not np.isnan(ref_max[t])
                    x = np.float32(0.0)
                elif np.isinf(x):
                    x = big if x > 0 else -big
                m = x if t == s else max(m, x)
            row_err[r] = m
            code[r] = NAN if nan else MISMATCH if m > t32 else OK
            r += 1
        base += qo[at + rows[i]] - qo[at]
        at += rows[i] + 1
    return code, row_err
