"""CPU reference replay (`--backend reference`): the whole replay path without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from replay_traces import EXPECTED, SCENARIOS, _two

from gpu_backend.device import pool as pool_mod
from gpu_backend.device.pool import KVPool, content, content_blocks, mod_m
from gpu_backend.host.batch import launch_runs, stale_plan
from gpu_backend.host.layout import build_step
from gpu_backend.replay.run import replay_isolated, run_replay
from gpu_backend.trace import load_trace
from gpu_backend.verdicts import DEFAULT_TOL, MISMATCH, NAN, OK, verdicts
from sim.errors import TraceError

ROOT = Path(__file__).resolve().parents[2]


def _bad(res: object) -> dict[tuple[int, int], str]:
    return {(r.step, r.request): r.verdict for r in res.rows if r.verdict != "ok"}  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reference_verdicts(tmp_path: Path, name: str) -> None:
    res = run_replay(SCENARIOS[name](tmp_path / name), "reference", DEFAULT_TOL)
    assert _bad(res) == EXPECTED[name]
    assert max(r.err for r in res.rows if r.verdict == "ok") < DEFAULT_TOL / 4


def test_content_is_deterministic_and_position_sensitive() -> None:
    t = torch.tensor([7, 7, 8])
    p = torch.tensor([3, 4, 3])
    a = content(t, p, 0, 2, 64, torch.bfloat16)
    assert torch.equal(a, content(t, p, 0, 2, 64, torch.bfloat16))
    assert (a[0] - a[1]).abs().max() > 0.5 and (a[0] - a[2]).abs().max() > 0.5
    assert a.abs().max() <= 1.0


@pytest.mark.parametrize("part", [1 << 14, 2])  # whole, or in parts of two tokens
def test_content_blocks_are_content_bit_for_bit(monkeypatch: pytest.MonkeyPatch,
                                                part: int) -> None:
    # one float64 pass for K, V and Q (the replay's) == the int64 definition, RoPE NaN included
    monkeypatch.setattr(pool_mod, "_TOKENS_AT_ONCE", part)
    t, p = np.array([7, 30011, 5, 1_000_010, 0]), np.array([3, 2047, 70, 9, 1_000_003])
    T, P = torch.as_tensor(t), torch.as_tensor(p)
    nan = torch.zeros((4, 5, 1, 1), dtype=torch.bool)  # K and Q blocks past a 64-row table
    nan[[0, 2, 3]] = torch.as_tensor(p >= 64)[:, None, None]
    x = content_blocks(torch.as_tensor(mod_m(t)), torch.as_tensor(mod_m(p)), 2, 4, 64,
                       torch.bfloat16, nan=nan)
    same = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(x[0], content(T, P, 0, 2, 64, torch.bfloat16, rope_rows=64), **same)
    torch.testing.assert_close(x[1], content(T, P, 1, 2, 64, torch.bfloat16), **same)
    q = x[2:].permute(1, 0, 2, 3).reshape(5, 4, 64)
    torch.testing.assert_close(q, content(T, P, 2, 4, 64, torch.bfloat16, rope_rows=64), **same)
    assert x[1].isnan().sum() == 0 and x[0].isnan().any()


@pytest.mark.parametrize("queries", [10, 3])  # a row a part; three queries a part
def test_attend_in_parts_is_attend_whole(monkeypatch: pytest.MonkeyPatch, queries: int) -> None:
    from gpu_backend.device import reference

    g = torch.Generator().manual_seed(queries)
    R, W, Hq, Hkv, D, L = 3, 10, 4, 2, 8, 16
    q = torch.rand(R, W, Hq, D, generator=g).bfloat16()
    k, v = (torch.rand(R, Hkv, L, D, generator=g).bfloat16() for _ in "kv")
    limit = torch.tensor([2, 6, 5])[:, None] + torch.arange(W)[None, :]  # row 1 reaches L - 1
    whole = reference.attend(q, k, v, limit, 3)
    monkeypatch.setattr(reference, "SCORES_BYTES", queries * Hq * L * 4)
    got = reference.attend(q, k, v, limit, 3)
    if queries == W:  # whole rows: the same products, the same bits
        assert torch.equal(got, whole)
    else:  # the CPU's matmul blocks fewer queries differently: rounding only
        torch.testing.assert_close(got, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("x", [[0, 5, 1_000_002], [7, 1_000_003, 2_000_007], [-1, 3], []])
def test_mod_m_is_the_floor_mod(x: list[int]) -> None:
    # in range it skips the int64 division; a value outside takes it for the whole array
    a = np.array(x, dtype=np.int64)
    got = mod_m(a)
    assert got.dtype == np.float64 and got.tolist() == [v % 1_000_003 for v in x]


def test_pool_poison_guards_and_checksum() -> None:
    pool = KVPool(4, 2, 16, 2, 64, torch.bfloat16, "cpu")
    assert pool.data.shape == (8, 2, 16, 2, 64) and torch.isnan(pool.data).all()
    before = pool.checksum()
    pool.data[pool.index(1), 0, 3] = 0.5
    assert (pool.checksum() != before).nonzero().flatten().tolist() == [3]


def test_append_past_alloc_targets_the_next_rows_page(tmp_path: Path) -> None:
    t = load_trace(SCENARIOS["append_past_alloc"](tmp_path / "t"))
    b = build_step(t.steps[3], t.rows[3], 16, 16)
    row1_first = t.rows[3][1].pages[0] + 16
    assert b.engine_write.tolist()[0] == row1_first and not b.write_ok[0] and b.write_ok[1]


def test_isolated_reference_equals_in_process(tmp_path: Path) -> None:
    trace = SCENARIOS["append_past_alloc"](tmp_path / "t")
    assert _bad(replay_isolated(trace, "reference", DEFAULT_TOL)) == EXPECTED["append_past_alloc"]


def test_an_append_past_the_table_lands_on_a_guard_page(tmp_path: Path) -> None:
    b = _two(29, 45)
    b.step([replace(b.gen(0, 0, 0), append_pos=(500,)), b.gen(1, 0, 0)])
    res = run_replay(b.write(tmp_path / "t", "wild"), "reference", DEFAULT_TOL)
    assert [r.verdict for r in res.rows if r.step == 1] == ["corrupt", "ok"]


def test_a_page_id_past_the_guard_band_is_a_fault_on_the_reference(tmp_path: Path) -> None:
    b = _two(29, 45)
    r0 = b.gen(0, 0, 0)
    b.step([replace(r0, pages=(10_000,) + r0.pages[1:]), b.gen(1, 0, 0)])
    res = run_replay(b.write(tmp_path / "t", "wild"), "reference", DEFAULT_TOL)
    assert [r.verdict for r in res.rows if r.step == 1] == ["fault", "fault"]
    assert "outside the pool" in res.rows[-1].message


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from sim.cli import main; main()", "replay",
                           *args], capture_output=True, text=True, cwd=ROOT)


def test_cli_exit_codes_and_json(tmp_path: Path) -> None:
    clean = SCENARIOS["clean_decode"](tmp_path / "clean")
    bad = SCENARIOS["overlong_fa2"](tmp_path / "bad")
    assert _cli(str(clean), "--backend", "reference").returncode == 0
    p = _cli(str(bad), "--backend", "reference", "--json", str(tmp_path / "r.json"))
    assert p.returncode == 1 and "mismatch" in p.stdout
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["counts"]["mismatch"] == 1 and len(out["rows"]) == 8
    p = _cli(str(tmp_path / "missing"), "--backend", "reference")
    assert p.returncode == 2 and "Traceback" not in p.stderr + p.stdout


def test_cli_watch_choices(tmp_path: Path) -> None:
    bad = SCENARIOS["append_past_alloc"](tmp_path / "bad")
    outs = {}
    for watch in ("full", "incremental"):
        p = _cli(str(bad), "--backend", "reference", "--watch", watch,
                 "--json", str(tmp_path / f"{watch}.json"))
        assert p.returncode == 1 and f"pages watched: {watch}" in p.stdout
        outs[watch] = json.loads((tmp_path / f"{watch}.json").read_text())
    assert outs["full"]["rows"] == outs["incremental"]["rows"]
    assert outs["full"]["counts"]["corrupt"] == 1
    p = _cli(str(bad), "--backend", "reference", "--watch", "sometimes")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr == ("error: kvsim replay: Invalid value for '--watch': 'sometimes' is not one "
                        "of 'incremental', 'full'. (see kvsim replay --help)\n")


@pytest.mark.parametrize(("error", "says"), [
    ("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried "
     "to allocate 34527715328 bytes", "out of memory during step 3 ("),
    ("CUDA error: an illegal memory access was encountered", "device fault during step 3 (")])
def test_cli_tells_out_of_memory_from_a_device_fault(monkeypatch: pytest.MonkeyPatch,
                                                     error: str, says: str) -> None:
    from gpu_backend.replay import run
    from sim.cli import replay_cmd
    from sim.errors import KvsimError

    def fails(*a: object, on_step: Any, **kw: object) -> None:
        on_step(3, "start")
        raise RuntimeError(error)

    monkeypatch.setattr(run, "run_replay", fails)
    with pytest.raises(KvsimError) as e:
        replay_cmd._run(ROOT, "reference", False, None, "incremental", True)
    assert says in str(e.value) and ("--isolate" in str(e.value)) == says.startswith("device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_cli_flashinfer_without_cuda_says_so(tmp_path: Path) -> None:
    p = _cli(str(SCENARIOS["clean_decode"](tmp_path / "t")))
    assert p.returncode == 2 and p.stdout == ""  # an error is stderr's, in one line
    assert p.stderr.splitlines() == ["error: no CUDA device: --backend flashinfer needs an NVIDIA "
                                     "GPU (use --backend reference on a CPU)"]


def test_an_incomplete_trace_is_refused(tmp_path: Path) -> None:
    t = SCENARIOS["clean_decode"](tmp_path / "t")
    m = json.loads((t / "manifest.json").read_text())
    (t / "manifest.json").write_text(json.dumps(dict(m, complete=False)))
    with pytest.raises(TraceError):
        load_trace(t)


def _mixed_step(tmp: Path, plan_batch: int) -> Path:
    """Step 1: request 2's prompt (ctx) beside request 0's decode, through a reused q_len-1
    decode plan built when the step's batch was `plan_batch` rows."""
    b = _two(29, 45)
    b.request(2, list(range(100, 120)))
    b.step([b.ctx(2), b.gen(0, 0, 0)], plan_q_len=1, plan_batch=plan_batch)
    return b.write(tmp, "mixed")


def test_a_reused_plan_of_the_same_shape_in_a_mixed_step_is_not_stale(tmp_path: Path) -> None:
    # plan_batch counts every row of the step (the simulator's I14 compares it with the row
    # count); the decode launch has one row. Comparing plan_batch with the launch's rows made
    # FlashInfer plan a batch-2 CUDA-core decode for a 1-row query: q/out read and written past
    # their end (docs/design.md §3.5).
    t = load_trace(_mixed_step(tmp_path / "t", plan_batch=2))
    b = build_step(t.steps[1], t.rows[1], 16, 16)
    assert [(s, e, k) for s, e, k in launch_runs(b)] == [(0, 1, "ctx"), (1, 2, "decode")]
    assert stale_plan(b, 1, 2, "decode") is None
    assert run_replay(t.path, "reference", DEFAULT_TOL).ok


def test_a_plan_built_for_a_bigger_step_is_stale_by_the_difference(tmp_path: Path) -> None:
    t = load_trace(_mixed_step(tmp_path / "t", plan_batch=3))
    b = build_step(t.steps[1], t.rows[1], 16, 16)
    assert stale_plan(b, 1, 2, "decode") == (2, 1)
    assert stale_plan(b, 0, 1, "ctx") is None  # prefill rows have their own plan


@pytest.mark.parametrize(("plan_q_len", "says"), [
    (1, "q implies q_len_per_req=4, but the non-tensor-core decode kernel only supports"),
    (2, "q implies q_len_per_req=4 but plan() used 2"),
])
def test_a_plan_for_another_width_is_refused_as_flashinfer_does(tmp_path: Path, plan_q_len: int,
                                                                says: str) -> None:
    b = _two(29, 45)
    b.step([b.gen(0, 3, 1), b.gen(1, 3, 2)], plan_q_len=plan_q_len, plan_batch=2)
    b.step([b.gen(0, 3, 1), b.gen(1, 3, 2)])
    res = run_replay(b.write(tmp_path / "t", "stale"), "reference", DEFAULT_TOL)
    assert _bad(res) == {(1, 0): "fault", (1, 1): "fault"}  # the next step is planned afresh
    assert says in res.rows[2].message



@given(st.lists(st.integers(-5, 40), max_size=30), st.lists(st.integers(-5, 40), max_size=30))
def test_member_is_isin_on_sorted_keys(xs: list[int], keys: list[int]) -> None:
    from gpu_backend.host.truth import member

    x, k = np.array(xs, dtype=np.int64), np.sort(np.array(keys, dtype=np.int64))
    assert member(x, k).tolist() == np.isin(x, k).tolist()


@given(st.lists(st.integers(-5, 40), min_size=1, max_size=30), st.integers(0, 29),
       st.integers(-7, 45))
def test_member_of_keys_of_its_own_length_is_isin(keys: list[int], at: int, value: int) -> None:
    # the keys themselves take a shortcut (a prompts' step's targets are its allocated pages);
    # an array of their length that differs in one value must not
    from gpu_backend.host.truth import member

    k = np.sort(np.array(keys, dtype=np.int64))
    off = k.copy()
    off[at % len(k)] = value
    for x in (k, off):
        assert member(x, k).tolist() == np.isin(x, k).tolist()


@given(st.lists(st.integers(-5, 40), max_size=30), st.integers(1, 700))
def test_unique_is_np_unique(xs: list[int], repeat: int) -> None:
    # repeated in runs past 4096 values: the runs are collapsed before the sort
    from gpu_backend.host.truth import unique

    x = np.repeat(np.array(xs, dtype=np.int64), repeat)
    got = unique(x)
    assert got.dtype == np.int64 and got.tolist() == np.unique(x).tolist()
    assert unique(x, collapse=False).tolist() == got.tolist()  # runs left in: the same set


@given(st.lists(st.integers(-5, 40), max_size=40), st.integers(1, 40), st.booleans())
def test_ascending_is_np_sort_in_order_or_not(xs: list[int], times: int, in_order: bool) -> None:
    # past ASCENDING values an array already in order is returned as it is, not sorted
    from gpu_backend.host.truth import ascending, unique

    x = np.tile(np.array(xs, dtype=np.int64), times)  # up to 1,600 values, across ASCENDING
    x = np.sort(x) if in_order else x
    assert ascending(x).tolist() == np.sort(x).tolist()
    assert unique(x).tolist() == np.unique(x).tolist()



@pytest.mark.parametrize("order", [("--big", "{out}"), ("{out}", "--big")])
def test_trace_writer_script_takes_the_flag_on_either_side(tmp_path: Path,
                                                           order: tuple[str, str]) -> None:
    """`make bench-gpu` runs `replay_traces.py --big DIR`: the directory is DIR, not '--big'
    (it once was, and the benchmark then found no trace)."""
    args = [a.format(out=tmp_path / "t") for a in order]
    subprocess.run([sys.executable, str(ROOT / "tests" / "unit" / "replay_traces.py"), *args],
                   check=True, capture_output=True, cwd=tmp_path)
    assert (tmp_path / "t" / "big_verify" / "manifest.json").is_file()
    assert not (tmp_path / "--big").exists()


@pytest.mark.parametrize("name", ["clean_mtp", "clean_mtp_xqa"])
def test_only_xqa_steps_carry_a_block_table(tmp_path: Path, name: str) -> None:
    """XQA reads the block table (each row's pages, padded with -1 -> the guard page); the other
    backends get an empty one instead of every row's pages flattened a second time."""
    t = load_trace(SCENARIOS[name](tmp_path / name))
    for s in t.steps:
        if not t.rows[s.step]:
            continue
        rows = t.rows[s.step]
        bt = build_step(s, rows, t.model.page_size, 16).block_table
        if s.backend != "xqa":
            assert bt.shape == (len(rows), 0)
            continue
        assert bt.shape == (len(rows), max(len(r.pages) for r in rows))
        for r, line in zip(rows, bt.tolist(), strict=True):
            assert line == [p + 16 for p in r.pages] + [15] * (bt.shape[1] - len(r.pages))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_page_moved_gives_the_verdicts_of_an_all_false_changed(tmp_path: Path,
                                                                   name: str) -> None:
    """`verdicts.verdicts` with changed=None (the driver's fast path when no checksum moved)
    gives what an all-False changed gives: mismatch and nan by the errors, no blame."""
    t = load_trace(SCENARIOS[name](tmp_path / name))
    rng = np.random.default_rng(0)
    seen: set[int] = set()
    for s in t.steps:
        if not t.rows[s.step]:
            continue
        b = build_step(s, t.rows[s.step], t.model.page_size, 16)
        tok = rng.random((2, b.num_tokens), dtype=np.float32) * 0.1
        tok[0, rng.random(b.num_tokens) < 0.1] = np.nan
        none = verdicts(b, tok, None, 0.05)
        zeros = verdicts(b, tok, np.zeros(t.model.num_blocks + 32, dtype=bool), 0.05)
        assert all(np.array_equal(x, y) for x, y in zip(none, zeros, strict=True))
        assert set(none[0].tolist()) <= {OK, MISMATCH, NAN}
        seen |= set(none[0].tolist())
    assert NAN in seen


def test_the_heap_is_frozen_during_the_replay_and_handed_back_after(tmp_path: Path) -> None:
    """The objects from before the replay are out of the collector's way while it runs
    (`loop._frozen_heap`), and back in its oldest generation after, also when it raises."""
    import gc

    from gpu_backend.replay.cpu import ReferenceKernels
    from gpu_backend.replay.loop import replay

    t = load_trace(SCENARIOS["clean_mtp"](tmp_path / "t"))
    seen: list[int] = []

    def on_step(step: int, what: str) -> None:
        seen.append(gc.get_freeze_count())
        if step == t.steps[2].step:
            raise KeyboardInterrupt  # as a user's Ctrl-C in the middle

    assert gc.get_freeze_count() == 0
    with pytest.raises(KeyboardInterrupt):
        replay(t, ReferenceKernels(t.model.num_q_heads, t.model.num_blocks), "cpu",
               on_step=on_step)
    assert seen and min(seen) > 0
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("mismatches", [0, 2])
def test_the_summary_says_when_graph_shapes_ran_eagerly(mismatches: int) -> None:
    """A replay whose FA2 plans disagreed with FlashInfer's (`graphs.StepGraphs`) tells the
    user: nothing else would show it but the stats in --json."""
    from rich.console import Console

    from gpu_backend.verdicts import ReplayResult
    from sim.cli.replay_cmd import _summary

    console = Console(record=True, width=200)
    _summary(console, ReplayResult("flashinfer", "t", 1e-2,
                                   stats={"plan_mismatches": mismatches}))
    said = "CUDA-graph shape(s) ran eagerly" in console.export_text()
    assert said == bool(mismatches)


class _Arrival:
    """A read-back's event that has not fired yet; `synchronize` is the host's wait for it."""

    def __init__(self, waits: list[int], i: int):
        self.waits, self.i = waits, i

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.waits.append(self.i)


def test_the_host_waits_for_the_oldest_read_back_beyond_the_lead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop judges a read-back once it has arrived, and waits for the oldest while more
    than LEAD are on their way: the host stays within a few read-backs of the device."""
    from collections import deque

    from gpu_backend import verdicts as verdicts_mod

    judged: list[int] = []
    monkeypatch.setattr(verdicts_mod, "_verdicts", lambda res, s, watch: judged.append(s.steps[0]))
    waits: list[int] = []
    sent = deque(verdicts_mod.Sent([i], None, None, _Arrival(waits, i)) for i in range(5))  # type: ignore[list-item, arg-type]
    verdicts_mod.drain(None, sent, None, 2)  # type: ignore[arg-type]
    assert waits == judged == [0, 1, 2] and len(sent) == 2
    verdicts_mod.drain(None, sent, None, 2)  # type: ignore[arg-type]
    assert judged == [0, 1, 2]  # within the lead, nothing arrived: no wait


class _Busy:
    """A device event that fires after `left` queries."""

    def __init__(self, left: int):
        self.left = left

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0


@pytest.mark.parametrize(("busy", "bank", "words", "banked"), [
    (3, 8, 1 << 25, 3), (50, 4, 1 << 25, 4), (50, 8, 1 << 25, 6), (3, 0, 1 << 25, 0),
    (50, 8, 250, 4)])  # the chunk that crosses the words is the last
def test_the_loop_prepares_ahead_while_the_device_is_busy(
        monkeypatch: pytest.MonkeyPatch, busy: int, bank: int, words: int, banked: int) -> None:
    """`loop.ReadySteps` pulls steps while the awaited event has not fired, up to its bank (in
    steps, and in words of their chunks) and the trace's end, and hands every step out once,
    in order."""
    from types import SimpleNamespace

    from gpu_backend.replay import loop

    monkeypatch.setattr("gpu_backend.replay.loop.BANK_WORDS", words)
    chunks = [SimpleNamespace(n=100) for _ in range(4)]  # two steps a chunk
    pulled: list[int] = []

    def steps() -> Any:
        for i in range(7):
            pulled.append(i)
            yield SimpleNamespace(i=i, dv=SimpleNamespace(chunk=chunks[i // 2]))

    ahead = loop.ReadySteps(steps(), bank)  # type: ignore[arg-type]
    assert ahead.next().i == 0  # type: ignore[union-attr]
    ahead.fill(_Busy(busy))  # type: ignore[arg-type]
    assert len(ahead.banked) == ahead.pulled == banked and len(pulled) == 1 + banked
    ahead.fill(None)  # nothing to wait for: nothing pulled
    assert len(pulled) == 1 + banked
    got = [ahead.next() for _ in range(7)]
    assert [x.i for x in got[:6]] == [1, 2, 3, 4, 5, 6] and got[6] is None  # type: ignore[union-attr]
