"""`kvsim profiles [--faults]`: the engine profiles, their switches, and the fault catalog."""

from __future__ import annotations

from dataclasses import asdict

import typer
from rich.table import Table

from sim.cli.common import console


def register(app: typer.Typer) -> None:
    app.command("profiles")(profiles_cmd)


def profiles_cmd(faults: bool = typer.Option(False, "--faults", help="Show the fault catalog."),
                 ) -> None:
    """List engine profiles and behaviour switches (or the fault catalog)."""
    from sim.profiles import FAULTS, PROFILES, Switches
    from sim.profiles.switches import choices

    if faults:
        t = Table(title="fault catalog (profile: BASE+FAULT)", title_justify="left")
        for c in ("fault", "switches", "first invariant", "scenario", "source", "mechanism"):
            t.add_column(c, overflow="fold")
        for f in FAULTS.values():
            sw = ", ".join(f"{k}={v}" for k, v in f.switches.items())
            t.add_row(f.name, sw, f.invariant, f"scenarios/faults/{f.name}.toml", f.source,
                      f.mechanism)
        console.print(t)
        return
    default = asdict(Switches())
    t = Table(title="profiles", title_justify="left")
    t.add_column("switch")
    for name in PROFILES:
        t.add_column(name)
    t.add_column("values")
    for k in default:
        vals = [str(asdict(p)[k]) for p in PROFILES.values()]
        t.add_row(k, *vals, " | ".join(choices(k)))
    console.print(t)
    console.print("Override with --switch NAME=VALUE or turn on one fault with "
                  "--profile trtllm-post-17264+FAULT (see --faults).")
