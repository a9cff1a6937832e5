"""The `kvsim` command line. Each sub-command lives in its own module with a `register(app)`."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="kvsim",
    help="Deterministic simulator of an LLM-serving engine's scheduler and paged KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Order is the order of `kvsim --help`. A module that is missing (an optional part not built
# yet) is skipped so the rest of the CLI still works.
_COMMANDS = ("run", "check", "profiles", "replay", "fuzz", "sweep", "timeline", "metrics",
             "calibrate", "record", "diff")

for _name in _COMMANDS:
    try:
        _mod = importlib.import_module(f"sim.cli.{_name}_cmd")
    except ModuleNotFoundError as _e:
        if _e.name != f"sim.cli.{_name}_cmd":
            raise
        continue
    _mod.register(app)


def main() -> None:
    app()
