"""The incremental page watch on the GPU: its Triton kernels (gpu_backend/device/pool_triton.py
resum_pre,
post_check) against the torch path, and FlashInfer replays with stray writes, as in
tests/unit/test_watch.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from replay_traces import SCENARIOS
from watch_cases import CASES, Stray, find_case

from gpu_backend.device import reference
from gpu_backend.device.pool import KVPool
from gpu_backend.replay.loop import replay
from gpu_backend.trace import TraceData, load_trace
from gpu_backend.verdicts import ReplayResult

pytestmark = pytest.mark.gpu


def _run(pool: KVPool, off: int | None, stray: int | None) -> tuple[dict[str, torch.Tensor],
                                                                    torch.Tensor]:
    """Two steps of the watch's kernels: events write pages 50 and 60 (touched), the targets are
    10, 40 (checked) and 50 (touched: re-summed, not checked), written by "the kernels"; pages
    12, 30 and 40 are ahead. `off`: that page's expected sum is wrong; `stray`: that page is
    written by the kernels too."""
    sums = pool.checksum()
    if off is not None:
        sums[off] += 1
    s = {"sums": sums, "pre": torch.zeros_like(sums), "stamp": torch.full_like(sums, -1),
         "flag": torch.zeros(1, dtype=torch.int32, device="cuda")}
    touched, idx, ahead = (torch.tensor(x, device="cuda")
                           for x in ([50, 60], [10, 40, 50], [12, 30, 40]))
    for step in (1, 2):  # the second launch goes through tlaunch's direct path
        pool.data[[50, 60], 1, 0] += 1
        pool.resum_pre(touched, idx, 2, s["sums"], s["pre"], s["stamp"], s["flag"], step)
        pool.data[[10, 40, 50], 0, 0] += 1
        if stray is not None:
            pool.data[stray, 1, 3] += 1
        moved = pool.post_check(idx, ahead, s["sums"], s["pre"], s["stamp"], s["flag"], step)
    return s, moved


@pytest.mark.parametrize(("off", "stray", "flagged"), [
    (None, None, False),  # targets written, ahead page 40 is a target: nothing to flag
    (10, None, True),  # a checked target's expected sum is wrong: resum_pre
    (50, None, False),  # a touched target's: re-summed by the same launch, not checked
    (30, None, True),  # an ahead page's expected sum is wrong: post_check
    (None, 12, True),  # an ahead page written by the step: post_check
    (None, 77, False),  # a page neither aimed at nor ahead: left to the whole-pool check
])
def test_resum_pre_and_post_check_kernels_are_the_torch_path(
        monkeypatch: pytest.MonkeyPatch, off: int | None, stray: int | None,
        flagged: bool) -> None:
    got = []
    real = reference.triton_kernels
    for fused in (True, False):
        monkeypatch.setattr(reference, "triton_kernels", real if fused else lambda: None)
        pool = KVPool(200, 4, 16, 2, 64, torch.bfloat16, "cuda")
        g = torch.Generator(device="cuda").manual_seed(3)
        pool.data.copy_(torch.randn(pool.data.shape, device="cuda", generator=g))
        got.append(_run(pool, off, stray))
    (a, ma), (b, mb) = got
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(ma, mb) and ma.dtype == torch.bool and ma.tolist() == [True] * 3
    assert bool(a["flag"].item()) == flagged


def _flashinfer(trace: TraceData) -> Any:
    from gpu_backend.replay.flashinfer import FlashInferKernels

    return FlashInferKernels(trace.model.num_q_heads, "cuda")


def _rows(res: ReplayResult) -> list[tuple[Any, ...]]:
    return [(r.step, r.row, r.request, r.verdict, r.message) for r in res.rows]


def test_flashinfer_incremental_gives_the_full_watch_verdicts(tmp_path: Path) -> None:
    trace = load_trace(SCENARIOS["clean_mtp"](tmp_path / "t"))
    full = replay(trace, _flashinfer(trace), "cuda", watch="full")
    inc = replay(trace, _flashinfer(trace), "cuda")
    assert (full.watch, inc.watch) == ("full", "incremental")
    assert _rows(inc) == _rows(full)


@pytest.mark.parametrize("case", CASES)
def test_flashinfer_stray_writes_are_found_and_replayed_in_full(tmp_path: Path,
                                                                case: str) -> None:
    trace, at = find_case(tmp_path, case)
    full = replay(trace, Stray(_flashinfer(trace), *at), "cuda", watch="full")
    inc = replay(trace, Stray(_flashinfer(trace), *at), "cuda")
    assert inc.watch.startswith("full (incremental found a page changed outside")
    assert _rows(inc) == _rows(full)
    assert {r.verdict for r in full.rows if r.step == at[0]} == {"corrupt"}


def _graph_vs_eager(dev: str, off: int | None, stray: int | None, stamped: int | None
                    ) -> tuple[dict[str, Any], ...]:
    """One step's events and checks, eagerly (the previous step's ahead check, the poison,
    resum_pre, post_check) and as the graph's kernels read them (counts in PARAMS, arrays padded
    past them): the same pool, sums, stamps, flag and moved flags."""
    from gpu_backend.device import pool_triton

    touched, idx = [50, 60, 12], [10, 40, 50]
    rows = [50 * 32 + 3, 60 * 32, 60 * 32 + 17, 12 * 32 + 31]  # (page, K|V, slot) rows
    out = []
    for graph in (False, True):
        pool = KVPool(200, 4, 16, 2, 64, torch.bfloat16, dev)
        g = torch.Generator(device=dev).manual_seed(5)
        pool.data.copy_(torch.randn(pool.data.shape, device=dev, generator=g))
        s = {"sums": pool.checksum(), "pre": torch.zeros(208, dtype=torch.int64, device=dev),
             "stamp": torch.full((208,), -1, dtype=torch.int64, device=dev),
             "flag": torch.zeros(1, dtype=torch.int32, device=dev)}
        if stamped is not None:  # a target of the previous step (6): not checked ahead
            s["stamp"][stamped] = 6
        if off is not None:
            s["sums"][off] += 1
        t, i, r = (torch.tensor(x + [0] * 5, device=dev) for x in (touched, idx, rows))
        params = torch.tensor([3, 3, 2, 7, 6, 4, 0, 0], device=dev)
        if graph:
            pool_triton.graph_events(pool.words, pool.rows, params, t, r, s["sums"], s["stamp"],
                               s["flag"])
            pool_triton.graph_pre(pool.words, params, t, i, s["sums"], s["pre"], s["stamp"],
                                  s["flag"])
        else:
            pool.post_check(None, t[:3], s["sums"], s["pre"], s["stamp"], s["flag"], 6)
            pool.poison_rows(r[:4])
            pool.resum_pre(t[:3], i[:3], 2, s["sums"], s["pre"], s["stamp"], s["flag"], 7)
        pool.data[[10, 40, 50], 0, 0] += 1  # "the kernels"
        if stray is not None:
            pool.data[stray, 1, 3] += 1
        if graph:
            moved = torch.zeros(8, dtype=torch.int8, device=dev)
            pool_triton.graph_post(pool.words, params, i, s["sums"], s["pre"], moved)
            s["moved"] = moved[:3].view(torch.bool)
        else:
            s["moved"] = pool.post_check(i[:3], None, s["sums"], s["pre"], s["stamp"],
                                         s["flag"], 7)
        s["words"] = pool.words.clone()
        out.append(s)
    return tuple(out)


GRAPH_CASES = [
    (None, None, None, False),
    (12, None, None, True),  # an events' page changed since its last sum: the ahead check
    (12, None, 12, False),  # ... unless it was the previous step's target (its sum is fresh)
    (10, None, None, True),  # a checked target: resum_pre
    (None, 77, None, False),  # a page neither aimed at nor touched: the whole-pool check's
]


@pytest.mark.parametrize(("off", "stray", "stamped", "flagged"), GRAPH_CASES)
def test_graph_kernels_are_the_eager_events_and_checks(off: int | None, stray: int | None,
                                                       stamped: int | None,
                                                       flagged: bool) -> None:
    eager, graph = _graph_vs_eager("cuda", off, stray, stamped)
    for k in eager:
        assert torch.equal(eager[k], graph[k]), k
    assert bool(graph["flag"].item()) == flagged
    assert graph["moved"].tolist() == [True, True, True]
