"""Shared CLI plumbing: bad input → one message on stderr and exit 2, never a traceback."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from sim import interrupt
from sim.errors import KvsimError

console = Console()
err_console = Console(stderr=True)


def fail(msg: str, code: int = 2) -> NoReturn:
    # escape: a message quoting "[workload.trace]" must not be eaten as rich markup.
    err_console.print(f"[bold red]error:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn the project's own exceptions (and a user's ^C or a SIGTERM) into exit codes."""
    _terminate_as_interrupt()
    try:
        yield
        interrupt.check()  # a signal some extension swallowed still ends the run as one
    except KeyboardInterrupt:
        _interrupted()
    except Exception as e:
        # A KeyboardInterrupt raised inside an extension's import comes out as some other
        # error (pandas' Cython init turned one into SystemError or AttributeError): once a
        # signal was noted, whatever unwound the run is its consequence.
        if interrupt.pending() and not isinstance(e, typer.Exit):
            _interrupted()
        if isinstance(e, KvsimError):
            fail(str(e))
        if isinstance(e, MemoryError):  # past every input limit: still one line, not a trace
            fail("out of memory: the input asks for more than this machine has; make it "
                 "smaller (docs/hardening.md lists the limits)")
        raise


def _interrupted() -> NoReturn:
    err_console.print("interrupted")
    raise typer.Exit(130) from None


def _on_term(signum: int, frame: object) -> None:
    interrupt.note()  # in case the exception below is swallowed (sim/interrupt.py)
    raise KeyboardInterrupt


def _terminate_as_interrupt() -> None:
    """SIGTERM and SIGINT unwind like ^C, so writers' abort handlers remove their temporary
    output. SIGINT is set explicitly: a process started in the background of a non-interactive
    shell inherits it ignored, and Python then never raises KeyboardInterrupt (seen in CI)."""
    try:
        signal.signal(signal.SIGTERM, _on_term)
        signal.signal(signal.SIGINT, _on_term)
    except ValueError:  # not the main thread (e.g. a test runner's worker): leave it alone
        pass


def parse_switches(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for it in items:
        name, sep, value = it.partition("=")
        if not sep or not name:
            fail(f"--switch expects NAME=VALUE, got {it!r}")
        out[name.strip()] = value.strip()
    return out


def is_tty() -> bool:
    return sys.stderr.isatty()


Printer = Callable[[str], None]
