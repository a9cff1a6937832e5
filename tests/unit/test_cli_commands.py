"""Every `kvsim` command is there, or the CLI says why not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_command_is_registered_in_help_order() -> None:
    from sim.cli import _COMMANDS, app

    assert [c.name for c in app.registered_commands] == list(_COMMANDS)


def test_a_command_that_fails_to_import_is_not_left_out_silently() -> None:
    """It used to vanish from --help with no word: a broken install must say so."""
    code = "import sys; sys.modules['sim.cli.calibrate_cmd'] = None; import sim.cli"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr
    assert "sim.cli.calibrate_cmd" in r.stderr


def test_out_of_memory_is_one_line_and_exit_2() -> None:
    import typer
    from typer.testing import CliRunner

    from sim.cli.common import user_errors

    app = typer.Typer()

    @app.command()
    def grow() -> None:
        with user_errors():
            bytearray(1 << 62)  # a real allocation the machine refuses

    r = CliRunner().invoke(app, [])
    assert r.exit_code == 2
    assert r.stderr.splitlines() == ["error: out of memory: the input asks for more than this "
                                     "machine has; make it smaller (docs/hardening.md lists the "
                                     "limits)"]
