"""Write a shrunk finding to disk: `scenario.toml` (reproduces it) and `finding.json`.

The output folder is built in a temporary sibling and published by sim/outputs.py, so a reader
never sees half a finding, a campaign killed mid-write leaves the old one intact, and only an
earlier finding (a folder with kvsim.json {"kind": "fuzz"}) is ever replaced.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sim.fuzz.campaign import Finding
from sim.fuzz.toml_out import dumps
from sim.outputs import Kind, write_folder


def scenario_with_profile(f: Finding) -> dict[str, Any]:
    return {"seed": f.scenario.get("seed", 0), "profile": f.profile,
            **{k: v for k, v in f.scenario.items() if k not in ("seed", "profile")}}


def repro_command(out: Path, profile: str) -> str:
    return f"kvsim run {out / 'scenario.toml'} --profile {profile}"


def finding_record(f: Finding) -> dict[str, Any]:
    return {"invariant": f.hit.invariant, "message": f.hit.message, "profile": f.profile,
            "seed": f.seed, "examples": f.examples, "found_after_s": round(f.found_s, 3),
            "found_at_example": f.found_example,
            "shrunk_after_s": round(f.shrunk_s, 3),
            "requests": len(f.scenario["workload"]["requests"])}


def write_finding(f: Finding, out: Path) -> Path:
    """Write the finding to folder `out`, replacing only an earlier finding (sim/outputs.py).
    Returns the scenario path."""
    header = (f"Found by `kvsim fuzz --profile {f.profile} --seed {f.seed}` "
              f"(shrunk after {f.examples} examples).\n"
              f"{f.hit.invariant}: {f.hit.message}\n"
              f"Reproduce: {repro_command(out, f.profile)}")
    write_folder(out, Kind.FUZZ, {
        "scenario.toml": dumps(scenario_with_profile(f), header),
        "finding.json": json.dumps(finding_record(f), indent=2) + "\n"})
    return out / "scenario.toml"
