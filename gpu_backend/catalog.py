"""The fault catalog on the GPU: every catalog scenario under its faulty and its fixed profile
(plus the worked example before and after the fix), simulated here, then replayed on both
backends by the agreement matrix.

    python -m gpu_backend.catalog --out docs/agreement.md [--traces DIR] [--backends ...]

A fault is confirmed on the GPU when some row of its faulty trace is not ok (nan, mismatch,
corrupt or fault); a fixed trace must be all ok. The table's summary lines count both per
backend; its `sim vs` column compares the simulator with each backend trace by trace.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from gpu_backend import agreement

ROOT = Path(__file__).resolve().parents[1]


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_backend.catalog", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
        command = "python -m gpu_backend.catalog " + " ".join(
            sys.argv[1:] if argv is None else argv)
        return agreement.main([*map(str, traces), "--out", str(a.out), "--backends",
                               a.backends, *extra], command=command)


if __name__ == "__main__":
    raise SystemExit(main())
