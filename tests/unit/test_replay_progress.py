"""`kvsim replay` shows its progress over the trace's steps on a terminal's stderr, and nothing
where stderr is not one (CI logs, pipes)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from replay_traces import SCENARIOS
from rich.console import Console

from sim.cli import replay_cmd


@pytest.mark.parametrize("terminal", [True, False])
def test_the_replay_shows_its_steps_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  terminal: bool) -> None:
    trace = SCENARIOS["clean_mtp"](tmp_path / "t")
    err = io.StringIO()
    console = Console(file=err, force_terminal=terminal, color_system=None, width=100)
    monkeypatch.setattr(replay_cmd, "err_console", console)
    res = replay_cmd._run(trace, "reference", False, None, "incremental")
    assert res.ok
    steps = len(res.rows) and max(r.step for r in res.rows) + 1
    if terminal:
        assert f"replaying {trace.name}" in err.getvalue()
        assert f"{steps}/{steps} steps" in err.getvalue()
    else:
        assert err.getvalue() == ""
