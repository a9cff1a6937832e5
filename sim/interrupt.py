"""A SIGTERM/SIGINT the CLI saw, remembered until the process ends.

The CLI's handler raises KeyboardInterrupt, but an exception raised while some C extensions run
Python code is printed and dropped instead: a signal that lands while pyarrow lazily imports
pandas is lost that way, and the run went on to replace the previous trace and exit 0
(tests/hardening/test_signals.py). So the handler also notes the signal here, and whatever
publishes output (the trace writer, the sweep) checks before it does, and the CLI on its way out.
"""

from __future__ import annotations

_pending = False


def note() -> None:
    global _pending
    _pending = True


def pending() -> bool:
    return _pending


def check() -> None:
    """Raise KeyboardInterrupt if a signal was noted (and perhaps swallowed) earlier."""
    if _pending:
        raise KeyboardInterrupt


def clear() -> None:
    global _pending
    _pending = False
