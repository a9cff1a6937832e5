"""Agreement matrix: per trace, the simulator's violations, the expected verdicts, the CPU
reference's and FlashInfer's verdicts per row, and whether they agree (DESIGN §6).

python -m gpu_backend.agreement TRACE_DIR... --out docs/agreement.md [--expected E.json]
                                            [--json OUT.json] [--backends reference,flashinfer]
E.json: {trace name: {"STEP,REQUEST": verdict}} for the rows that are not ok.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_backend.driver import ReplayResult, max_ok_error
from gpu_backend.oracle import DEFAULT_TOL
from gpu_backend.run import run_replay, to_json
from gpu_backend.tracedata import load_trace

# Per fault scenario (trace name without .fault/.fixed): what the replay can and cannot show.
NOTES = {
    "plan_without_width": "stale decode plan (steps carry plan_q_len/plan_batch): emulated on "
                          "FlashInfer (FA2 planned for the stale shape); the CPU reference has "
                          "no plans, so reference all ok vs a FlashInfer verdict is a legitimate "
                          "disagreement, not a miss",
    "plan_keyed_by_batch": "host memory growth (a plan cache keyed by batch size, I14 / "
                           "plan_cache_size), not a kernel access: no row verdict is expected "
                           "(FlashInfer may still react to the stale plan shapes it records)",
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


def _bad(res: ReplayResult | None) -> dict[str, str]:
    if res is None:
        return {}
    return {f"{r.step},{r.request}": r.verdict for r in res.rows if r.verdict != "ok"}


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
        viol = sorted({f"{v[0]}@{v[1]}" for v in trace.violations})[:6]
        row: dict[str, Any] = {"trace": t.name, "rows": sum(len(r) for r in trace.rows.values()),
                               "violations": viol, "expected": expected.get(t.name)}
        for be in backends:
            try:
                res = run_replay(t, be, tol)
                row[be] = _bad(res)
                row[f"{be}_noise"] = max_ok_error(res)
                row[f"{be}_json"] = to_json(res)
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
              + ", ".join(f"{be} {v:.3g}" for be, v in noise.items()), "",
              "Cells list the rows that are not ok as (step,request) verdict.", "",
              "| trace | rows | sim violations | expected | " + " | ".join(backends)
              + " | agree | note |",
              "|---|---|---|---|" + "---|" * len(backends) + "---|---|"]
    for r in rows:
        cells = [r["trace"], str(r["rows"]), ", ".join(r["violations"]) or "none",
                 "—" if r["expected"] is None else _fmt(r["expected"])]
        cells += [_fmt(r.get(be)) for be in backends]
        lines.append("| " + " | ".join(cells) + " | " + ("yes" if r["agree"] else "**no**")
                     + " | " + note(r["trace"]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_backend.agreement")
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
        from gpu_backend.calibrate import meta as gpu_meta

        meta = gpu_meta("python -m gpu_backend.agreement "
                        + " ".join(sys.argv[1:] if argv is None else argv))

    def partial(done: list[dict[str, Any]]) -> None:
        left = {"partial": f"{len(done)} of {len(a.traces)} traces (run cut short?)"}
        a.out.write_text(markdown(done, backends, meta | left, a.tol))

    rows = evaluate(a.traces, backends, expected, a.tol, on_row=partial)
    a.out.write_text(markdown(rows, backends, meta, a.tol))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["agree"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
