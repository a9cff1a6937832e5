"""Usage errors (an unknown option, a value not among an option's choices, a missing argument)
as ONE line, `error: kvsim CMD: <what is wrong>`, exit 2: the shape of every other bad input
(docs/hardening.md), instead of click's usage text and a boxed panel."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer
import typer.core
from typer.core import TyperGroup

# newer typers vendor click as typer._click: its exceptions are not the click package's
_click: Any = getattr(typer.core, "_click", None) or importlib.import_module("click")


class OneLineUsageErrors(TyperGroup):
    def main(self, args: Any = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any
             ) -> Any:
        prog_name = prog_name or "kvsim"  # not "-c" or "__main__.py" when run through python
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _click.exceptions.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "kvsim"
            msg = " ".join(e.format_message().replace("Value error, ", "").split())
            typer.echo(f"error: {where}: {msg} (see {where} --help)", err=True)
            sys.exit(e.exit_code)
        except _click.exceptions.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)
