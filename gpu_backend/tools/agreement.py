"""Agreement matrix: per trace, the simulator's violations, the expected verdicts, the CPU
reference's and FlashInfer's verdicts per row, and whether they agree (docs/design.md §6).

python -m gpu_backend.tools.agreement TRACE_DIR... --out docs/agreement.md [--expected E.json]
                                            [--json OUT.json] [--backends reference,flashinfer]
E.json: {trace name: {"STEP,REQUEST": verdict}} for the rows that are not ok.

The fault catalog on the GPU: every catalog scenario under its faulty and its fixed profile
(plus the worked example before and after the fix), simulated here, then replayed on both
backends by the agreement matrix.

    python -m gpu_backend.tools.agreement --catalog --out docs/agreement.md [--traces DIR]
                                          [--json OUT.json] [--backends ...]

A fault is confirmed on the GPU when some verdict of its faulty trace is not ok: a row's (nan,
mismatch, corrupt or fault) or the plan cache's (growth past I14's bound); a fixed trace must
be all ok. The table's summary lines count both per
backend; its `sim vs` column compares the simulator with each backend trace by trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_backend.replay.run import run_replay, to_json
from gpu_backend.tools.fidelity import meta as gpu_meta
from gpu_backend.trace import TraceData, load_trace
from gpu_backend.verdicts import DEFAULT_TOL, ReplayResult, max_ok_error, plan_cache_verdict
from sim.check.view import Model

# Per fault scenario (trace name without .fault/.fixed): what the replay can and cannot show.
NOTES = {
    "plan_without_width": "a decode plan built for q_len 2 run with q_len 4 rows: FlashInfer "
                          "0.7.2's run() refuses a query whose width differs from the plan's "
                          "(flashinfer/decode.py, ValueError -> fault); the CPU reference "
                          "emulates that host check, it has no plans",
    "plan_keyed_by_batch": "no kernel-visible effect: eager TRT-LLM re-plans every cached "
                           "wrapper in prepare() (flashinfer.py _clean_cached_plans), so the "
                           "per-batch keys only add wrappers: the plan cache's own verdict, "
                           "growth past I14's bound (FlashInfer: the wrappers held; the CPU "
                           "reference: the trace's cache size)",
    "double_free": "the second free lands on a block that stays cached; the next request with "
                   "the same prompt reuses it and reads the poisoned pages",
    "draft_past_limit": "RoPE table of max_position_embeddings rows: the engine's K/Q at a "
                        "position past it are NaN in both backends",
    "free_in_flight": "worst legal timing: pages freed before the step's done event are refilled "
                      "(poisoned) before the step runs",
}


def note(trace: str) -> str:
    base, _, tag = trace.rpartition(".")
    return NOTES.get(base, "") if tag == "fault" else ""


def plan_cache_note(row: dict[str, Any]) -> str:
    """FlashInfer's measured plan-cache memory, where the engine held more than one plan."""
    st = row.get("flashinfer_stats") or {}
    n = st.get("plan_cache_entries", 0)
    if n <= 1:
        return ""
    pinned = st.get("plan_cache_pinned_bytes")
    pin = "" if pinned is None else f" + {pinned / 2**20:.0f} MiB pinned host"
    return (f"plan cache held: {n} wrapper pairs, {st['plan_cache_device_bytes'] / 2**20:.0f} "
            f"MiB device{pin} (measured)")


def versus_sim(row: dict[str, Any], be: str) -> str:
    """The simulator's verdict (any violation) against backend `be`'s (any verdict not ok)."""
    bad = row.get(be)
    if bad is None:
        return "not run"
    if "*" in bad:
        return "**error**"
    flagged = bool(row["violations"])
    if flagged:
        return "confirmed" if bad else "**missed**"
    return "**unflagged**" if bad else "clean"


def summary(rows: list[dict[str, Any]], backends: list[str]) -> list[str]:
    """Catalog lines: faults confirmed (some verdict not ok) and fixed runs all ok, per
    backend."""
    fault = [r for r in rows if r["trace"].endswith(".fault")]
    fixed = [r for r in rows if r["trace"].endswith(".fixed")]
    if not fault and not fixed:
        return []
    out = []
    for be in backends:
        conf = [r["trace"].removesuffix(".fault") for r in fault
                if r.get(be) and "*" not in r[be]]
        missed = [r["trace"].removesuffix(".fault") for r in fault if r["trace"].removesuffix(
            ".fault") not in conf]
        ok = sum(1 for r in fixed if r.get(be) == {})
        out.append(f"- {be}: {len(conf)}/{len(fault)} faulty runs confirmed (a verdict not ok)"
                   + (f"; not seen: {', '.join(missed)}" if missed else "")
                   + f"; {ok}/{len(fixed)} fixed runs all ok")
    return out


def _bad(res: ReplayResult | None, plan_cache: str | None = None) -> dict[str, str]:
    """The verdicts that are not ok: each row's by "step,request", and the plan cache's."""
    if res is None:
        return {}
    bad = {f"{r.step},{r.request}": r.verdict for r in res.rows if r.verdict != "ok"}
    return bad | ({"plan cache": plan_cache} if plan_cache else {})


def plan_cache_held(res: ReplayResult, trace: TraceData) -> str | None:
    """`plan_cache_verdict` of a replay: the wrapper pairs FlashInfer held (measured), or, on a
    backend without plans, the engine's cache size as the trace records it."""
    held = res.stats.get("plan_cache_entries")
    if held is None:
        held = max((s.plan_cache_size for s in trace.steps), default=0)
    return plan_cache_verdict(held, Model.from_dict(trace.manifest["model"]).plan_cache_limit)


def _fmt(bad: dict[str, str] | None) -> str:
    if bad is None:
        return "not run"
    if not bad:
        return "all ok"
    items = sorted(bad.items(), key=lambda kv: [int(x) if x.lstrip("-").isdigit() else 0
                                                  for x in kv[0].split(",")])
    cell = "; ".join(f"({k}) {v}" for k, v in items[:4])
    counts: dict[str, int] = {}
    for v in bad.values():
        counts[v] = counts.get(v, 0) + 1
    more = f" (+{len(items) - 4} more; " + ", ".join(f"{v} {n}" for v, n in
                                                    sorted(counts.items())) + ")"
    return cell + (more if len(items) > 4 else "")


def evaluate(traces: list[Path], backends: list[str], expected: dict[str, Any], tol: float,
             on_row: Callable[[list[dict[str, Any]]], None] | None = None
             ) -> list[dict[str, Any]]:
    """One matrix row per trace; `on_row(rows so far)` after each (partial tables survive a
    timeout)."""
    out: list[dict[str, Any]] = []
    for t in traces:
        trace = load_trace(t)
        first = sorted({(int(v[1]), str(v[0])) for v in trace.violations})[:6]  # earliest
        viol = [f"{inv}@{step}" for step, inv in first]
        row: dict[str, Any] = {"trace": t.name, "rows": sum(len(r) for r in trace.rows.values()),
                               "violations": viol, "expected": expected.get(t.name)}
        for be in backends:
            try:
                res = run_replay(t, be, tol)
                row[be] = _bad(res, plan_cache_held(res, trace))
                row[f"{be}_noise"] = max_ok_error(res)
                row[f"{be}_json"] = to_json(res)
                row[f"{be}_stats"] = res.stats
            except Exception as e:  # noqa: BLE001 - a backend's failure is a matrix cell
                row[be] = {"*": f"error: {type(e).__name__}: {str(e)[:160]}"}
        seen = [row.get(be) for be in backends]
        row["agree"] = all(s == seen[0] for s in seen) and (
            row["expected"] is None or seen[0] == row["expected"])
        out.append(row)
        if on_row:
            on_row(out)
    return out


def markdown(rows: list[dict[str, Any]], backends: list[str], meta: dict[str, Any],
             tol: float) -> str:
    lines = ["# Agreement: simulator vs CPU reference vs FlashInfer", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    noise = {be: max((r.get(f"{be}_noise", 0.0) for r in rows), default=0.0) for be in backends}
    lines += [f"- tolerance: {tol:g} (max |out - ref| of an ok row)",
              "- measured noise (max |out - ref| over ok rows): "
              + ", ".join(f"{be} {v:.3g}" for be, v in noise.items())]
    lines += summary(rows, backends)
    lines += ["", "Cells list the rows that are not ok as (step,request) verdict, and the "
              "plan cache's growth as (plan cache). `sim vs` "
              "compares the simulator (any violation) with each backend (any verdict not ok): "
              "confirmed, clean, **missed** (flagged, all ok), **unflagged** (not flagged, a row "
              "not ok). `agree`: the backends give the same verdicts (and the expected ones).",
              "",
              "| trace | rows | sim violations | expected | " + " | ".join(backends)
              + " | sim vs " + "/".join(backends) + " | agree | note |",
              "|---|---|---|---|" + "---|" * len(backends) + "---|---|---|"]
    for r in rows:
        cells = [r["trace"], str(r["rows"]), ", ".join(r["violations"]) or "none",
                 "—" if r["expected"] is None else _fmt(r["expected"])]
        cells += [_fmt(r.get(be)) for be in backends]
        vs = [versus_sim(r, be) for be in backends]
        cells.append(vs[0] if len(set(vs)) == 1 else " / ".join(vs))
        notes = "; ".join(x for x in (note(r["trace"]), plan_cache_note(r)) if x)
        lines.append("| " + " | ".join(cells) + " | " + ("yes" if r["agree"] else "**no**")
                     + " | " + notes + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, command: str | None = None) -> int:
    """`command`: the command line to record in the table's meta (default: this one's)."""
    ap = argparse.ArgumentParser(prog="python -m gpu_backend.tools.agreement")
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--expected", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--backends", default="reference,flashinfer")
    ap.add_argument("--tol", type=float, default=DEFAULT_TOL)
    a = ap.parse_args(argv)
    backends = a.backends.split(",")
    expected = json.loads(a.expected.read_text()) if a.expected else {}
    meta: dict[str, Any] = {}
    if "flashinfer" in backends:
        meta = gpu_meta(command or "python -m gpu_backend.tools.agreement "
                        + " ".join(sys.argv[1:] if argv is None else argv))

    def partial(done: list[dict[str, Any]]) -> None:
        left = {"partial": f"{len(done)} of {len(a.traces)} traces (run cut short?)"}
        a.out.write_text(markdown(done, backends, meta | left, a.tol))

    rows = evaluate(a.traces, backends, expected, a.tol, on_row=partial)
    a.out.write_text(markdown(rows, backends, meta, a.tol))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["agree"] for r in rows) else 1

ROOT = Path(__file__).resolve().parents[2]


def write_traces(out: Path) -> list[Path]:
    from sim.api import load_scenario, run
    from sim.profiles import FAULTS

    jobs = [("worked_example", "worked_example", p)
            for p in ("trtllm-pre-17264", "trtllm-post-17264")]
    for name in FAULTS:
        jobs += [(f"faults/{name}", name, f"trtllm-post-17264+{name}"),
                 (f"faults/{name}", name, "trtllm-post-17264")]
    traces = []
    for scenario, name, profile in jobs:
        sc, base = load_scenario(ROOT / "scenarios" / f"{scenario}.toml")
        tag = "fixed" if "+" not in profile and "pre" not in profile else "fault"
        t = out / f"{name}.{tag}"
        run(sc, out=t, profile=profile, base_dir=base)
        traces.append(t)
    return traces


def catalog(argv: list[str]) -> int:
    """`--catalog`: simulate the catalog's traces (`write_traces`), then `main` over them."""
    ap = argparse.ArgumentParser(prog="python -m gpu_backend.tools.agreement --catalog")
    ap.add_argument("--out", type=Path, required=True, help="agreement markdown to write")
    ap.add_argument("--traces", type=Path, help="where to keep the traces (default: temp)")
    ap.add_argument("--backends", default="reference,flashinfer")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        d = a.traces or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        traces = write_traces(d)
        extra = ["--json", str(a.json)] if a.json else []
        command = "python -m gpu_backend.tools.agreement --catalog " + " ".join(argv)
        return main([*map(str, traces), "--out", str(a.out), "--backends", a.backends, *extra],
                    command=command)


if __name__ == "__main__":
    args = sys.argv[1:]
    raise SystemExit(catalog([x for x in args if x != "--catalog"]) if "--catalog" in args
                     else main(args))
