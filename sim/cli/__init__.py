"""The `kvsim` command line. Each sub-command lives in its own module with a `register(app)`."""

from __future__ import annotations

import importlib

import typer

from sim.cli.usage import OneLineUsageErrors

app = typer.Typer(
    name="kvsim",
    help="Deterministic simulator of an LLM-serving engine's scheduler and paged KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineUsageErrors,
)


def _version(show: bool) -> None:
    if show:
        from sim.api import kvsim_version
        from sim.trace.records import FORMAT_VERSION, READABLE_VERSIONS

        readable = ", ".join(map(str, READABLE_VERSIONS))
        typer.echo(f"kvsim {kvsim_version()} (trace format {FORMAT_VERSION}; reads {readable})")
        raise typer.Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                       help="Print kvsim's version and its trace format.")
          ) -> None:
    """Deterministic simulator of an LLM-serving engine's scheduler and paged KV cache."""

# Order is the order of `kvsim --help`. Every module is part of kvsim: one that fails to
# import is a broken install, not a command to leave out of --help unannounced.
_COMMANDS = ("run", "check", "profiles", "replay", "fuzz", "sweep", "timeline", "metrics",
             "calibrate", "record", "diff")

for _name in _COMMANDS:
    importlib.import_module(f"sim.cli.{_name}_cmd").register(app)


def main() -> None:
    app()
