"""gpu_backend/verdicts_jit.py: the compiled judge gives the numpy judge's codes and max errors
(`verdicts.judge_numpy`, its oracle), dtypes included, on random read-backs: empty rows and
steps, NaN errors with and without a NaN reference, infinities, errors at the tolerance."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_backend import verdicts, verdicts_jit

_VALUES = [0.0, 0.01, 0.02, 0.0200001, 0.5, np.nan, np.inf, -np.inf, -0.1]


@st.composite
def _read_back(draw: st.DrawFn) -> tuple[list[Any], np.ndarray, float]:
    steps = draw(st.lists(st.lists(st.integers(0, 4), max_size=5), min_size=1, max_size=4))
    batches = []
    for q_len in steps:
        qo = np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)
        batches.append(SimpleNamespace(qo_indptr=qo))
    n = sum(sum(q) for q in steps)
    tok = np.array([[draw(st.sampled_from(_VALUES)) for _ in range(n)] for _ in range(2)],
                   dtype=np.float32).reshape(2, n)
    return batches, tok, draw(st.sampled_from([0.02, 0.0, 1.0]))


@settings(max_examples=300, deadline=None)
@given(_read_back())
def test_the_compiled_judge_is_the_numpy_judge(case: tuple[list[Any], np.ndarray, float]
                                               ) -> None:
    batches, tok, tol = case
    code, err = verdicts.judge(batches, tok, tol)
    want_code, want_err = verdicts.judge_numpy(batches, tok, tol)
    assert code.dtype == want_code.dtype and code.tolist() == want_code.tolist()
    assert err.dtype == want_err.dtype and np.array_equal(err, want_err)


def test_its_codes_are_the_oracles() -> None:
    assert (verdicts_jit.OK, verdicts_jit.MISMATCH, verdicts_jit.NAN) == \
        (verdicts.OK, verdicts.MISMATCH, verdicts.NAN)
