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

# Order is the order of `kvsim --help`. Every module is part of kvsim: one that fails to
# import is a broken install, not a command to leave out of --help unannounced.
_COMMANDS = ("run", "check", "profiles", "replay", "fuzz", "sweep", "timeline", "metrics",
             "calibrate")

for _name in _COMMANDS:
    importlib.import_module(f"sim.cli.{_name}_cmd").register(app)


def main() -> None:
    app()
