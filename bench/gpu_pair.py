"""Two settings of the replay side by side: the whole replay under A and under B, alternated.

python bench/gpu_pair.py --set replay.loop.BANK=0 [--sweep 64x2048:96,64x2048:12]
    [--reps 8] [--json OUT] [--backend flashinfer|reference] [--work DIR] [--commit C]

The lent GPU machines' hosts differ a lot in speed: the same code's whole replay at 64 x 2k,
96 steps, took 85-191 ms on different calls of one day. A change is
judged on pairs instead: A (the code as it is) and B (the same code with `--set`) alternate
in one process (A B, B A, A B, ...), each on the benchmark trace of
`bench/gpu_replay.py --sweep` (`tests/unit/replay_traces.py` big_verify, batch x kv_len, MTP)
with N generation steps. Each replay is `loop.replay` from the call to its return and a
device sync, every step, as `bench/gpu_replay.py`'s `whole`; one warm-up replay of each first.

`--set MODULE.NAME=VALUE` sets an attribute of a `gpu_backend` module (VALUE a Python literal)
for B's replays only; repeat it for several. The JSON keeps every wall, the medians, B's median
over A's, how many pairs B finished first, the steps each prepared ahead (`loop.ReadySteps`), and
whether both gave the same rows.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from environment import ROOT, environment, host_speed

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from gpu_backend.replay import loop
from gpu_backend.replay.run import make_kernels
from gpu_backend.trace import TraceData, load_trace
from sim.errors import KvsimError  # noqa: E402

Setting = tuple[Any, str, Any]  # (module, attribute, value)


def _settings(exprs: list[str], ap: argparse.ArgumentParser) -> list[Setting]:
    out = []
    for e in exprs:
        name, eq, text = e.partition("=")
        mod, dot, attr = name.strip().rpartition(".")
        if not eq or not dot:
            ap.error(f"--set {e!r}: write MODULE.NAME=VALUE (e.g. replay.loop.BANK=0)")
        try:
            m = importlib.import_module(f"gpu_backend.{mod}")
        except ImportError:
            ap.error(f"--set {e!r}: no module gpu_backend.{mod}")
        if not hasattr(m, attr):
            ap.error(f"--set {e!r}: gpu_backend.{mod} has no {attr}")
        try:
            out.append((m, attr, ast.literal_eval(text.strip())))
        except (ValueError, SyntaxError):
            ap.error(f"--set {e!r}: {text.strip()!r} is not a Python literal")
    return out


def _sizes(text: str, ap: argparse.ArgumentParser) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(","):
        try:
            size, _, steps = part.partition(":")
            b, kv = (int(x) for x in size.split("x"))
            n = int(steps or 12)
        except ValueError:
            ap.error(f"--sweep {part!r}: write BATCHxKV or BATCHxKV:STEPS (e.g. 64x2048:96)")
        if min(b, kv, n) < 1:
            ap.error(f"--sweep {part!r}: batch, kv_len and steps must be positive")
        out.append((b, kv, n))
    return out


@contextmanager
def _applied(settings: list[Setting]) -> Iterator[None]:
    old = [(m, a, getattr(m, a)) for m, a, _ in settings]
    try:
        for m, a, v in settings:
            setattr(m, a, v)
        yield
    finally:
        for m, a, v in old:
            setattr(m, a, v)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def one(trace: TraceData, backend: str, settings: list[Setting]) -> dict[str, Any]:
    """One whole replay under `settings`: wall and first generation step's start in ms, and
    `environment.host_speed` just before it."""
    steps = [s.step for s in trace.steps if trace.rows[s.step]]
    marks: dict[str, float] = {}

    def on_step(step: int, what: str) -> None:
        if len(steps) > 1 and (step, what) == (steps[1], "start"):
            marks["first"] = time.perf_counter()

    with _applied(settings):
        kernels, device = make_kernels(backend, trace)
        host = host_speed()
        _sync(device)
        t0 = time.perf_counter()
        res = loop.replay(trace, kernels, device, on_step=on_step)
        _sync(device)
        wall = time.perf_counter() - t0
    return {"wall_ms": wall * 1e3, "first_gen_ms": (marks.get("first", t0) - t0) * 1e3,
            "prepared_ahead": res.stats.get("prepared_ahead", 0), "host_ms": host,
            "rows": [(r.step, r.row, r.verdict) for r in res.rows]}


def pair(trace: TraceData, backend: str, b_settings: list[Setting], reps: int
         ) -> dict[str, Any]:
    configs = {"a": [], "b": b_settings}
    for s in configs.values():  # warm-up: compiles, caches, the allocators' first blocks
        one(trace, backend, s)
    runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    for i in range(reps):
        for name in ("a", "b") if i % 2 == 0 else ("b", "a"):
            runs[name].append(one(trace, backend, configs[name]))
    out: dict[str, Any] = {}
    for name, rs in runs.items():
        walls = [r["wall_ms"] for r in rs]
        out[name] = {"wall_ms_median": statistics.median(walls), "wall_ms": walls,
                     "first_gen_ms_median": statistics.median(r["first_gen_ms"] for r in rs),
                     "prepared_ahead": [r["prepared_ahead"] for r in rs],
                     "host_ms": [round(r["host_ms"], 2) for r in rs]}
    out["b_over_a"] = out["b"]["wall_ms_median"] / out["a"]["wall_ms_median"]
    out["pairs_b_faster"] = sum(b["wall_ms"] < a["wall_ms"]
                                for a, b in zip(runs["a"], runs["b"], strict=True))
    out["same_rows"] = all(r["rows"] == runs["a"][0]["rows"] for r in runs["a"] + runs["b"])
    return out


def _write(path: Path, data: dict[str, Any]) -> None:
    """All or nothing: a run stopped halfway leaves no partial JSON behind."""
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[5:]))
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="MOD.NAME=VALUE",
                    help="B only: set gpu_backend.MOD.NAME to VALUE (repeatable)")
    ap.add_argument("--sweep", default="64x2048:96,64x2048:12",
                    help="BATCHxKV[:STEPS],...: the benchmark traces (default %(default)s)")
    ap.add_argument("--reps", type=int, default=8, help="replays of each (default 8)")
    ap.add_argument("--backend", choices=("flashinfer", "reference"), default="flashinfer",
                    help="reference: the CPU backend (small sizes; a check of this script)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvsim-gpu-pair"),
                    help="where the traces are written")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--commit", default="",
                    help="commit to record (the GPU host's copy of the tree has no .git)")
    a = ap.parse_args()
    settings = _settings(a.sets, ap)
    sizes = _sizes(a.sweep, ap)
    if not settings:
        ap.error("B is A: give --set")
    if a.reps < 1:
        ap.error("--reps must be at least 1")
    from replay_traces import big_verify

    out: dict[str, Any] = environment() | {"backend": a.backend, "b": a.sets,
                                           "reps": a.reps}
    if a.backend == "flashinfer":
        try:
            import torch

            from gpu_backend.tools.fidelity import meta
        except ImportError as e:
            ap.error(f"--backend flashinfer needs torch and flashinfer ({e}); "
                     "try --backend reference")
        if not torch.cuda.is_available():
            ap.error("--backend flashinfer needs a CUDA device; try --backend reference")
        out |= meta("python " + out["command"])
    if a.commit:
        out["commit"] = a.commit
    out["sizes"] = []
    for b, kv, n in sizes:
        trace = load_trace(big_verify(a.work / f"big_{b}x{kv}_{n}", batch=b, kv=kv, steps=n))
        try:
            r = pair(trace, a.backend, settings, a.reps)
        except KvsimError as e:
            print(f"gpu_pair: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        out["sizes"].append({"batch": b, "kv": kv, "steps": n} | r)
        print(f"{b}x{kv}, {n} steps: A {r['a']['wall_ms_median']:.1f} ms, B "
              f"{r['b']['wall_ms_median']:.1f} ms (B/A {r['b_over_a']:.3f}, B first in "
              f"{r['pairs_b_faster']} of {a.reps} pairs; ahead A {r['a']['prepared_ahead']} "
              f"B {r['b']['prepared_ahead']}; same rows: {r['same_rows']})", flush=True)
    if a.json:
        _write(a.json, out)


if __name__ == "__main__":
    main()
