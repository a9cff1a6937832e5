"""gpu_backend/verdicts.py and the loop's read-backs (`loop._loop`): a long prompt step is
read back alone and judged once it arrives, the host never waiting for it there (a wait
there leaves the device idle while the host judges it); a settle judges each read-back as it arrives
and only then reads the watch's flag (a sync that waited for every step before any verdict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from replay_traces import named_trace

from gpu_backend import verdicts as verdicts_mod
from gpu_backend.replay import loop
from gpu_backend.replay.cpu import ReferenceKernels
from gpu_backend.replay.loop import replay
from gpu_backend.trace import TraceData, load_trace
from gpu_backend.verdicts import ReplayResult


def _replay(trace: TraceData) -> ReplayResult:
    m = trace.model
    return replay(trace, ReferenceKernels(m.num_q_heads, m.num_blocks), "cpu")


def _rows(res: ReplayResult) -> list[tuple[Any, ...]]:
    return [(r.step, r.row, r.request, r.verdict, r.err, r.message) for r in res.rows]


def test_a_long_prompt_step_is_read_back_alone_without_a_wait(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = load_trace(named_trace(tmp_path, "big", 40))
    want = _rows(_replay(trace))
    first = trace.steps[0].step
    prompts = int(trace.columns[first]["q_len"].sum())
    monkeypatch.setattr(loop, "SEND_TOKENS", prompts)  # the prompts' step alone reaches it
    log: list[tuple[str, list[int]]] = []
    send, settle = verdicts_mod.send, verdicts_mod.settle

    def logged_send(pending: list[Any], *flag: Any) -> Any:
        log.append(("send", [x.p.b.step for x in pending]))
        return send(pending, *flag)

    def logged_settle(res: Any, sent: Any, watch: Any) -> None:
        log.append(("settle", []))
        settle(res, sent, watch)

    monkeypatch.setattr(loop, "send", logged_send)
    monkeypatch.setattr(loop, "settle", logged_settle)
    assert _rows(_replay(trace)) == want
    assert log[0] == ("send", [first])  # the prompts' step alone, right after it
    assert [k for k, _ in log].count("settle") == 1 and log[-1][0] == "settle"  # at the end
    assert all(len(steps) <= loop.EARLY for k, steps in log if k == "send")


def test_a_settles_last_read_back_brings_the_flag_judged_after_every_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The incremental watch's stale flag travels with a settle's last read-back (no read of its
    own after the device's end: one sync less in the replay's tail), and the settle looks at it
    only once every read-back's verdicts are in; it reads the watch itself no more."""
    trace = load_trace(named_trace(tmp_path, "big", 40))
    order: list[str] = []
    verdicts, send, real = verdicts_mod._verdicts, verdicts_mod.send, verdicts_mod.settle
    flags: list[Any] = []

    def logged_verdicts(res: Any, s: Any, watch: Any) -> None:
        order.append("verdicts")
        verdicts(res, s, watch)

    class Flag:  # the flag as the read-back brought it: when the settle looks at it
        def __init__(self, t: Any) -> None:
            self.t = t

        def item(self) -> Any:
            order.append("flag")
            return self.t.item()

    def flagged_send(pending: list[Any], *flag: Any) -> Any:
        s = send(pending, *flag)
        flags.append(s.stale)
        if s.stale is not None:
            s.stale = Flag(s.stale)
        return s

    class Watched:  # the watch, as the settle sees it
        def __init__(self, watch: Any) -> None:
            self.watch = watch

        def __getattr__(self, name: str) -> Any:
            return getattr(self.watch, name)

        def stale(self) -> Any:
            order.append("watch")
            return self.watch.stale()

    monkeypatch.setattr(verdicts_mod, "_verdicts", logged_verdicts)
    monkeypatch.setattr(loop, "send", flagged_send)
    monkeypatch.setattr(loop, "settle",
                        lambda res, sent, watch: real(res, sent, Watched(watch)))
    res = _replay(trace)
    assert res.counts()["ok"] == len(res.rows) > 0
    assert flags[-1] is not None  # the last read-back, the settle's, brought the flag
    assert order[-1] == "flag" and order[-2] == "verdicts" and "watch" not in order
    assert order.count("flag") == 1


def test_read_backs_shrink_toward_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """A read-back holds at most one step more than are left after it, so they halve toward the
    end (one read-back at the end judges every step of a short replay after the device's end), and
    the verdicts are the same."""
    trace = load_trace(named_trace(tmp_path, "big", 40))
    monkeypatch.setattr(loop, "EARLY", 1 << 30)  # the old rule, a read-back at the end only
    log: list[list[int]] = []
    send = verdicts_mod.send

    def logged_send(pending: list[Any], *flag: Any) -> Any:
        log.append([x.p.b.step for x in pending])
        return send(pending, *flag)

    monkeypatch.setattr(loop, "send", logged_send)
    monkeypatch.setattr(loop, "SEND_TOKENS", 1 << 62)
    res = _replay(trace)
    steps = [s.step for s in trace.steps if trace.rows[s.step]]
    assert [x for got in log for x in got] == steps  # every step once, in order
    assert len(log) > 2 and log[-1] == steps[-1:]  # the last alone
    left = len(steps)
    for got in log:
        left -= len(got)
        assert len(got) <= left + 1, log
    monkeypatch.setattr(loop, "EARLY", 16)
    assert _rows(res) == _rows(_replay(trace))


def test_the_replay_leaves_its_heap_untrimmed(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`sim.heap.kept(trim=False)`: malloc_trim took 0.9-1.6 ms of a replay's wall on the H200's
    host after the device had finished."""
    from sim import heap

    if not heap.available():
        pytest.skip("no glibc mallopt here")
    calls: list[int] = []
    libc = heap._LIBC

    class Counted:
        def __getattr__(self, name: str) -> Any:
            return getattr(libc, name)

        def malloc_trim(self, pad: int) -> int:
            calls.append(pad)
            return int(libc.malloc_trim(pad))

    monkeypatch.setattr(heap, "_LIBC", Counted())
    _replay(load_trace(named_trace(tmp_path, "big", 4)))
    assert calls == []
    with heap.kept():
        pass
    assert calls == [0]  # the default still trims


def _in_arena(pending: list[Any], mode: str) -> list[Any]:
    """The steps' results moved into arenas as a CUDA graph step leaves them (`ArenaResults`, the
    bytes `graphs.Arena.put` copies): "one" arena for all, two "halves", or every
    other step ("mixed"; the others keep their tensors, as eager steps do)."""
    import torch

    from gpu_backend.device.graphs import ArenaResults

    out, arena, used = [], None, 0
    for i, x in enumerate(pending):
        boxable = isinstance(x.tok, torch.Tensor) and isinstance(x.changed, torch.Tensor)
        if not boxable or (mode == "mixed" and i % 2):
            out.append(x)
            continue
        if arena is None or (mode == "halves" and i == len(pending) // 2):
            arena, used = torch.full((1 << 20,), 0xAB, dtype=torch.uint8), 8
        n, w = int(x.tok.shape[1]), int(x.changed.numel())
        arena[used: used + 8 * n] = x.tok.contiguous().view(torch.uint8).flatten()
        arena[used + 8 * n: used + 8 * n + w] = x.changed.view(torch.uint8)
        box = ArenaResults(arena, used, n, w)
        out.append(verdicts_mod.Pending(x.p, box, box, x.fault))
        used += 8 * n + w + (-(8 * n + w) % 8)
    return out


@pytest.mark.parametrize("mode", ["one", "halves", "mixed"])
def test_results_read_back_from_an_arena_are_judged_as_tensors_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """A read-back of steps whose results lie in one arena comes home as its
    span in one copy and is cut into the steps' parts there; steps in two arenas, or among
    steps run eagerly, are read back as tensors. The verdicts are the same either way, a
    corrupt step's blame included."""
    trace = load_trace(named_trace(tmp_path, "shared_block_written", 9))
    want = _rows(_replay(trace))
    assert any(r[3] == "corrupt" for r in want)
    send = verdicts_mod.send
    homes: list[bool] = []

    def arena_send(pending: list[Any], *flag: Any) -> Any:
        s = send(_in_arena(pending, mode), *flag)
        homes.append(s.home is not None)
        pending.clear()
        return s

    monkeypatch.setattr(loop, "send", arena_send)
    monkeypatch.setattr(loop, "EARLY", 4)
    assert _rows(_replay(trace)) == want
    assert any(homes) if mode == "one" else not all(homes)
