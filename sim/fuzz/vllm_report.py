"""A `kvsim fuzz --engine vllm` campaign's result: the counts, and each shrunk class as a
scenario file with the command that reproduces it.

The folder is built in a temporary sibling and published by sim/outputs.py, as a profile
campaign's finding is (sim/fuzz/finding.py): `report.json` and one `CLASS.toml` per class.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sim.fuzz.toml_out import dumps
from sim.fuzz.vllm_campaign import Shrunk, Tally
from sim.outputs import Kind, write_folder


def file_name(cls: str) -> str:
    return cls.replace(":", "-") + ".toml"


def repro_command(cls: str, path: Path) -> str:
    """diff for a divergence, record (exit 1) for a violation or a vLLM crash, run for a
    crash of kvsim's profile."""
    if cls.startswith("diverged:"):
        return f"kvsim diff --engine vllm {path} --all"
    if cls == "crash:kvsim":
        return f"kvsim run {path} --profile vllm-v1"
    return f"kvsim record --engine vllm {path} --out {path.with_suffix('')}-trace"


def counts(t: Tally) -> dict[str, Any]:
    return {"workloads": t.workloads, "clean": t.clean, "refused": t.refused,
            "diverged": dict(t.diverged.most_common()),
            "differs": dict(t.differs.most_common()),
            "violations": dict(t.violations.most_common()),
            "crashes": dict(t.crashes.most_common()), "elapsed_s": round(t.elapsed, 3)}


def report(t: Tally, shrunk: list[Shrunk], seed: int, examples: int,
           out: Path | None) -> dict[str, Any]:
    found = [{"class": s.cls, "message": s.message,
              "requests": len(s.scenario["workload"]["requests"]),
              **({"scenario": str(out / file_name(s.cls)),
                  "reproduce": repro_command(s.cls, out / file_name(s.cls))} if out else {})}
             for s in shrunk]
    return {"engine": "vllm", "profile": "vllm-v1", "seed": seed, "examples": examples,
            **counts(t), "shrunk": found}


def write_report(rep: dict[str, Any], shrunk: list[Shrunk], out: Path) -> None:
    """Write `report.json` and the shrunk scenarios to folder `out`, replacing only an
    earlier finding (sim/outputs.py)."""
    files = {}
    for s, f in zip(shrunk, rep["shrunk"], strict=True):
        header = (f"Found by `kvsim fuzz --engine vllm --seed {rep['seed']} --examples "
                  f"{rep['examples']}`, shrunk.\n{s.cls}: {s.message}\n"
                  f"Reproduce: {f['reproduce']}")
        files[file_name(s.cls)] = dumps(s.scenario, header)
    files["report.json"] = json.dumps(rep, indent=2) + "\n"
    write_folder(out, Kind.FUZZ, files)
