"""Which steps `prepare` lays out for a CUDA graph, and what their input block holds
(gpu_backend/graphs.py; the graphs themselves run on the GPU: tests/gpu/test_graphs.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from replay_traces import SCENARIOS, big_verify

from gpu_backend import graphs
from gpu_backend.driver import GUARD_PAGES
from gpu_backend.prepare import HostState, Prepared, prepared_steps, truth_shape
from gpu_backend.tracedata import TraceData, load_trace


def _prepared(trace: TraceData, use_graphs: bool) -> list[Prepared]:
    slots, _, last = truth_shape(trace)
    st = HostState(trace, GUARD_PAGES, trace.model.max_position, last=last,
                   free=list(range(slots))[::-1], graphs=use_graphs)
    return list(prepared_steps(trace, st, "cpu"))


@pytest.fixture(scope="module")
def verify_trace(tmp_path_factory: pytest.TempPathFactory) -> TraceData:
    return load_trace(big_verify(tmp_path_factory.mktemp("g") / "big", batch=8, kv=256, steps=5))


def test_the_generation_steps_get_a_graph_key_and_the_prompt_step_none(
        verify_trace: TraceData) -> None:
    ps = _prepared(verify_trace, True)
    assert ps[0].graph is None  # ctx rows: a prefill of 8 different lengths
    keys = {p.graph for p in ps[1:]}
    assert len(keys) == 1
    R, W, cap = keys.pop()  # type: ignore[misc]
    assert (R, W) == (8, 4)
    assert all(len(p.b.kv_indices) <= cap < 2 * len(p.b.kv_indices) for p in ps[1:])


def test_the_block_holds_each_field_at_its_offset(verify_trace: TraceData) -> None:
    for p in _prepared(verify_trace, True)[1:]:
        b, dv = p.b, p.dv
        blk = dv["gblk"].numpy()
        at = graphs.offsets(b.num_rows, 4, len(b.kv_indices))
        want = {"app_tok_m": dv["app_tok_m@f64"].numpy().view(np.int64),
                "app_pos_m": dv["app_pos_m@f64"].numpy().view(np.int64),
                "tslot": dv["tslot"].numpy(), "true_pos": b.true_pos, "app_row": b.app_row,
                "append_pos": b.append_pos, "qo": dv["run0_qo"].numpy(),
                "kv_indptr": b.kv_indptr, "last_page_len": b.last_page_len,
                "slots": dv["g0_slots"].numpy(), "limit": dv["g0_limit"].numpy().ravel(),
                "kv_indices": b.kv_indices}
        assert set(want) == set(at)
        for name, (o, n) in at.items():
            np.testing.assert_array_equal(blk[o: o + n], want[name], err_msg=name)
        # the int32 twin the kernels and the planner read
        o, n = at["kv_indices"]
        np.testing.assert_array_equal(dv["gblk@32"].numpy()[o: o + n], b.kv_indices)
        assert all(o % 32 == 0 for o, _ in at.values())


def test_without_graphs_nothing_changes_but_the_block(verify_trace: TraceData) -> None:
    on, off = _prepared(verify_trace, True), _prepared(verify_trace, False)
    for a, b in zip(on, off, strict=True):
        assert b.graph is None and "gblk" not in b.dv
        assert set(a.dv) - {"gblk"} == set(b.dv)
        for k in b.dv:
            np.testing.assert_array_equal(a.dv[k].numpy(), b.dv[k].numpy(), err_msg=k)


@pytest.mark.parametrize("name", ["clean_decode", "clean_mtp_xqa", "overlong_fa2"])
def test_steps_a_graph_does_not_cover_run_eagerly(tmp_path: Path, name: str) -> None:
    """Decode rows (another wrapper), XQA steps, ragged widths: no key, no block."""
    trace = load_trace(SCENARIOS[name](tmp_path / name))
    for p in _prepared(trace, True):
        if p.graph is None:
            assert "gblk" not in p.dv
            continue
        b = p.b  # what a key promises
        assert b.backend == "fa2" and not p.fill and not p.engine_nan
        assert np.all(b.q_len == b.q_len[0]) and b.q_len[0] > 1 and not b.is_ctx.any()
    if name != "overlong_fa2":
        assert all(p.graph is None for p in _prepared(trace, True))
