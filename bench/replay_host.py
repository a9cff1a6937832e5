"""The GPU replay's host work per generation step, measured on any machine (no GPU needed).

python bench/replay_host.py [--sweep 64x2048,64x8192,128x8192] [--steps 96] [--json OUT]

At batch 64 x kv 2k the H200 runs a replay step in ~0.32 ms (2.1x the kernels' own time),
so the replay's end-to-end ratio is set by what the host does around
it. This bench times that host work without a device, on the same benchmark trace as
`bench/gpu_replay.py --sweep` (`tests/unit/replay_traces.py` big_verify, MTP W=4), by stage of
the pipeline (`gpu_backend/host/prepare.py`), in µs per generation step
(the prompts' step left out):

- start: what `loop.replay` does on the host before it prepares the prompts' step and that
  the device does not wait on (`truth.truth_shape`, the `HostState`, `in_flight_poison`), in
  ms: serial before anything runs, like the prompt's;
- prompt: `prepare.prepare_step` on the prompts' step, in ms (the loop prepares it before
  anything runs: at batch 64 it is tens of ms of a whole replay, `bench/gpu_replay.py`'s
  `whole`);
- first: the prompts' step as the replay loop prepares it, until its first launch (its
  content's and reference's arrays, uploaded), in ms: what the device waits for after the
  start; rest: the remainder of its preparation (`prepare.complete`), which the loop does
  while the device runs those launches;
- prepare: `prepare.prepare_step` (what the loop's own preparation costs a step).

Each size is measured twice, each time in a process forked for it: as `loop.replay` runs,
with freed memory kept in the heap (`sim.heap`), and with glibc's default heap (`heap_default`,
and `kept_over_default` the ratios; `--no-heap-default` skips it).

Each figure is the median over --reps passes (after one warm-up pass) of the pass's mean per
step: the stages' own costs. The H200's host ran this
Python 1.5-4.5x slower than a development machine: compare figures
within one run (`--before`: the same bench's JSON for the code before a change, run just
before on the same machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from environment import ROOT, environment, positive

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from gpu_backend.host import graph_block, prepare, staging, truth
from gpu_backend.host.events import in_flight_poison
from gpu_backend.trace import TraceData, load_trace
from sim import heap  # noqa: E402


def _host_load(self: staging.Chunk, h64: Any) -> None:
    """`Chunk.load` without the device: the host words only (see the module's docstring)."""
    self.bufs, self.parts, self.h64, self.host = {"h64": h64}, [], None, None


def _state(trace: TraceData) -> prepare.HostState:
    slots, _, last = truth.truth_shape(trace)
    return prepare.HostState(trace, 16, trace.model.max_position, last=last,
                             free=list(range(slots))[::-1],
                             graphs=graph_block.Planner.for_model(trace.model, graph_block.H200))


def _prepare_pass(trace: TraceData) -> float:
    """µs per generation step of `prepare_step` on one thread."""
    st, flight = _state(trace), in_flight_poison(trace)
    spent = []
    for s in (x for x in trace.steps if trace.rows[x.step]):
        t0 = time.perf_counter()
        prepare.prepare_step(st, s, trace.rows[s.step], flight, staging.Chunk("cpu"))
        spent.append(time.perf_counter() - t0)
    return sum(spent[1:]) / max(len(spent) - 1, 1) * 1e6


def _start_pass(trace: TraceData) -> float:
    """ms of the replay's host start before the prompts' step (`loop._replay`, the device's
    allocations aside)."""
    t0 = time.perf_counter()
    _state(trace)
    in_flight_poison(trace)
    return (time.perf_counter() - t0) * 1e3


def _prompt_pass(trace: TraceData) -> float:
    """ms of `prepare_step` on the prompts' step (the first step with rows)."""
    st, flight = _state(trace), in_flight_poison(trace)
    s = next(x for x in trace.steps if trace.rows[x.step])
    t0 = time.perf_counter()
    prepare.prepare_step(st, s, trace.rows[s.step], flight, staging.Chunk("cpu"))
    return (time.perf_counter() - t0) * 1e3


def _first_pass(trace: TraceData) -> dict[str, float]:
    """ms of the prompts' step as the replay loop prepares it: until its first launch
    (`prepare_step(defer=True)` and its chunk's upload; the context rows' reference in one
    group, as on CUDA), and the rest after it (`prepare.complete`)."""
    st, flight = _state(trace), in_flight_poison(trace)
    st.together = True
    s = next(x for x in trace.steps if trace.rows[x.step])
    chunk = staging.Chunk("cpu")
    t0 = time.perf_counter()
    p = prepare.prepare_step(st, s, trace.rows[s.step], flight, chunk, True)
    chunk.upload()
    t1 = time.perf_counter()
    prepare.complete(p)
    return {"first_ms": (t1 - t0) * 1e3, "rest_ms": (time.perf_counter() - t1) * 1e3}


def _median(fn: Callable[[], Any], reps: int) -> Any:
    fn()  # warm-up: numba's load, first-touch pages
    runs = [fn() for _ in range(reps)]
    if isinstance(runs[0], dict):
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return statistics.median(runs)


def measure(trace: TraceData, reps: int, kept: bool = True) -> dict[str, float]:
    """The stages' figures; kept: with freed memory kept in the heap, as `loop.replay` runs
    them (`sim.heap`), else with glibc's defaults. In a process forked for them: a `kept()`
    block changes glibc's settings for good, and every figure starts from this process's."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_measure_into, args=(send, trace, reps, kept))
    proc.start()
    send.close()
    try:
        out: dict[str, float] = recv.recv()
    except EOFError:
        proc.join()
        raise SystemExit(f"replay_host: the measuring process died (exit {proc.exitcode})"
                         ) from None
    proc.join()
    return out


def _measure_into(send: Any, trace: TraceData, reps: int, kept: bool) -> None:
    staging.Chunk.load = _host_load  # type: ignore[method-assign]
    with heap.kept() if kept else contextlib.nullcontext():
        send.send(_measure(trace, reps))


def _measure(trace: TraceData, reps: int) -> dict[str, float]:
    out = {"start_ms": _median(lambda: _start_pass(trace), reps),
           "prompt_ms": _median(lambda: _prompt_pass(trace), reps),
           **_median(lambda: _first_pass(trace), reps),
           "prepare_us": _median(lambda: _prepare_pass(trace), reps)}
    return out


def _show(batch: int, kv: int, r: dict[str, Any], what: str = "") -> None:
    print(f"batch {batch:4d} kv {kv:6d}{what}: " + ", ".join(
        f"{k} {v:.1f}" for k, v in r.items() if isinstance(v, float)), flush=True)


def _read_before(ap: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """--before's JSON, or a usage error naming the file and what is wrong with it."""
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        ap.error(f"--before {path}: {e}")
    if not isinstance(before, dict) or not isinstance(before.get("sizes"), list):
        ap.error(f"--before {path}: not a JSON written by this bench (no 'sizes' list)")
    return before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[2:]))
    ap.add_argument("--sweep", default="64x2048,64x8192,128x8192", metavar="BxKV,...",
                    help="batch x kv_len of the benchmark trace (default %(default)s)")
    ap.add_argument("--steps", type=positive, default=96, help="generation steps (default 96)")
    ap.add_argument("--reps", type=positive, default=5,
                    help="timed passes per figure (default 5)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvsim-replay-host"),
                    help="where the benchmark traces are written")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--before", type=Path,
                    help="this bench's JSON for the code before a change (same machine, just "
                    "before): kept under 'before', with after/before ratios")
    ap.add_argument("--note", default="", help="context to keep in the JSON")
    ap.add_argument("--no-heap-default", dest="heap_default", action="store_false",
                    help="skip the second pass of each size with glibc's default heap (by "
                    "default both run, for the ratio `kept_over_default`: sim.heap)")
    a = ap.parse_args()
    before = _read_before(ap, a.before) if a.before else None
    from replay_traces import big_verify

    out: dict[str, Any] = environment() | {"steps": a.steps, "reps": a.reps, "sizes": []}
    if a.note:
        out["note"] = a.note
    for size in a.sweep.split(","):
        try:
            batch, kv = (int(x) for x in size.lower().split("x"))
        except ValueError:
            ap.error(f"--sweep: {size!r} is not BATCHxKV (e.g. 64x2048)")
        if batch < 1 or kv < 16:
            ap.error(f"--sweep: {size!r}: batch must be 1 or more, kv 16 (a page) or more")
        trace = load_trace(big_verify(a.work / f"big_{batch}x{kv}_{a.steps}", batch=batch, kv=kv,
                                      steps=a.steps))
        r: dict[str, Any] = {"batch": batch, "kv": kv} | measure(trace, a.reps)
        _show(batch, kv, r)
        if a.heap_default and heap.available():
            r["heap_default"] = d = measure(trace, a.reps, kept=False)
            _show(batch, kv, d, " (glibc's default heap)")
            r["kept_over_default"] = {k: round(r[k] / v, 3) for k, v in d.items() if v}
        out["sizes"].append(r)
    if before is not None:
        out["before"] = before
        out["after_over_before"] = [
            {"batch": x["batch"], "kv": x["kv"]} | {
                k: round(x[k] / y[k], 3) for k in x
                if isinstance(x[k], float) and isinstance(y.get(k), float) and y[k]}
            for x, y in zip(out["sizes"], before["sizes"], strict=False)]
        print(json.dumps(out["after_over_before"], indent=1))
    if a.json:
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(a.json)


if __name__ == "__main__":
    main()
