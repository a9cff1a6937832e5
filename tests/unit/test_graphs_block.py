"""Which steps `prepare` lays out for a CUDA graph, and what their input block holds
(gpu_backend/device/graphs.py; the graphs themselves run on the GPU: tests/gpu/test_graphs.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from replay_traces import SCENARIOS, big_verify

from gpu_backend.host import graph_block
from gpu_backend.host.graph_block import H200, Planner, image, layout
from gpu_backend.host.prepare import HostState, Prepared, prepared_steps
from gpu_backend.host.staging import I32
from gpu_backend.host.truth import truth_shape
from gpu_backend.replay.loop import GUARD_PAGES
from gpu_backend.trace import TraceData, load_trace


def _prepared(trace: TraceData, use_graphs: bool) -> list[Prepared]:
    slots, _, last = truth_shape(trace)
    plan = Planner.for_model(trace.model, H200) if use_graphs else None
    st = HostState(trace, GUARD_PAGES, trace.model.max_position, last=last,
                   free=list(range(slots))[::-1], graphs=plan)
    return list(prepared_steps(trace, st, "cpu"))


@pytest.fixture(scope="module")
def verify_trace(tmp_path_factory: pytest.TempPathFactory) -> TraceData:
    return load_trace(big_verify(tmp_path_factory.mktemp("g") / "big", batch=8, kv=256, steps=5))


def test_the_generation_steps_get_a_graph_key_and_the_prompt_step_none(
        verify_trace: TraceData) -> None:
    ps = _prepared(verify_trace, True)
    assert ps[0].graph is None  # ctx rows: a prefill of 8 different lengths
    keys = {p.graph for p in ps[1:]}
    assert len(keys) == 1  # capacities with room: one graph for the whole replay
    R, W, cap_p, cap_t, cap_w, cap_r, plan = keys.pop()  # type: ignore[misc]
    assert (R, W) == (8, 4)
    assert plan == layout(Planner.for_model(verify_trace.model, H200), R, W).words
    for p in ps[1:]:
        rows = sum(len(p.dv[f"ev{a}"]) for _, a, *_ in p.ops)
        assert len(p.b.kv_indices) <= cap_p and len(p.wpages) <= cap_w and rows <= cap_r
        assert (len(p.dv["touched"]) if p.touched else 0) <= cap_t


def test_capacities_only_grow(verify_trace: TraceData) -> None:
    """A replay keeps the largest capacities it has seen for a shape: no new graph when a step
    needs less than an earlier one."""
    words = layout(Planner.for_model(verify_trace.model, H200), 8, 4).words
    big = (8, 4, 1 << 15, 1024, 1024, 4096, words)
    slots, _, last = truth_shape(verify_trace)
    st = HostState(verify_trace, GUARD_PAGES, verify_trace.model.max_position, last=last,
                   free=list(range(slots))[::-1],
                   graphs=Planner.for_model(verify_trace.model, H200), graph_caps={(8, 4): big})
    assert {p.graph for p in prepared_steps(verify_trace, st, "cpu")} == {None, big}
    assert graph_block._cap(5, 4) == 8 and graph_block._cap(3, 4) == 4
    assert graph_block._cap(0, 0) == 1


def test_the_block_holds_each_field_at_its_offset(verify_trace: TraceData) -> None:
    prev = -1
    for p in _prepared(verify_trace, True):
        if p.graph is None:
            prev = p.b.step
            continue
        b, dv = p.b, p.dv
        blk = dv["gblk"].numpy()
        at = graph_block.offsets(p.graph)
        touched = dv["touched"].numpy() if p.touched else np.zeros(0, dtype=np.int64)
        prows = np.concatenate([dv[f"ev{a}"].numpy() for _, a, *_ in p.ops])
        want = {"app_tok_m": dv.app_tok_m_f64.numpy().view(np.int64),
                "app_pos_m": dv.app_pos_m_f64.numpy().view(np.int64),
                "tslot": dv["tslot"].numpy(), "true_pos": b.true_pos, "app_row": b.app_row,
                "append_pos": b.append_pos, "qo": dv["run0_qo"].numpy(),
                "kv_indptr": b.kv_indptr, "last_page_len": b.last_page_len,
                "slots": dv["g0_slots"].numpy(), "limit": dv["g0_limit"].numpy().ravel(),
                "params": [len(touched), len(p.wpages), p.wcheck, b.step, prev, len(prows), 0, 0],
                "touched": touched, "wpages": p.wpages, "prows": prows,
                "plan": image(layout(Planner.for_model(verify_trace.model, H200), 8, 4),
                              b.kv_indptr),
                "kv_indices": b.kv_indices}
        assert set(want) == set(at)
        for name, (o, n) in at.items():
            got = blk[o: o + n] if name != "kv_indices" else blk[o:]
            w = np.asarray(want[name])
            np.testing.assert_array_equal(got[: len(w)], w, err_msg=name)
            assert not got[len(w):].any(), name  # padding: zeros, past the counts
        # the int32 twin the kernels and the planner read
        o, n = at["kv_indices"]
        np.testing.assert_array_equal(dv.view("gblk", I32).numpy()[o:], b.kv_indices)
        assert all(o % 32 == 0 for o, _ in at.values())
        prev = b.step


def test_without_graphs_nothing_changes_but_the_block(verify_trace: TraceData) -> None:
    on, off = _prepared(verify_trace, True), _prepared(verify_trace, False)
    for a, b in zip(on, off, strict=True):
        assert b.graph is None and "gblk" not in b.dv
        assert {k for k in a.dv if k != "gblk" and not k.startswith("gr_")} == set(b.dv)
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
        assert all(kind == "nan" for kind, *_ in p.ops)  # no slot copies
        assert np.all(b.q_len == b.q_len[0]) and b.q_len[0] > 1 and not b.is_ctx.any()
    if name != "overlong_fa2":
        assert all(p.graph is None for p in _prepared(trace, True))
