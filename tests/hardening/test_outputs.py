"""Outputs that never destroy (sim/outputs.py): every command with an output path refuses, before
any work, a path that holds a user's files or could (exit 2, one line, no traceback, nothing
written, deleted or left behind); kvsim's own output of the same kind is replaced only with
--force, and a replace that is interrupted leaves the old output whole."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sim.api import parse_scenario, run
from sim.outputs import Kind, OutputError, check_out, is_output, publish
from tests.hardening.corpus import BASE, Case, to_toml
from tests.hardening.harness import invoke, problems

ROOT = Path(__file__).resolve().parents[2]
KVSIM = [sys.executable, "-c", "from sim.cli import main; main()"]
# a campaign that is refused must not run: a budget no test could wait out unnoticed
FUZZ = ["--profile", "trtllm-post-17264", "--budget", "30"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Valid inputs for every command, and one real output of each kind kvsim makes here."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "base.toml").write_bytes(to_toml(BASE))
    (root / "sweep.toml").write_text('base = "base.toml"\n[grid]\n"seed" = [1, 2]\n')
    run(parse_scenario(BASE), out=root / "trace")
    outs = {"scenario": root / "base.toml", "sweep_file": root / "sweep.toml",
            "trace": root / "trace", "db": root / "db",
            "calibration": ROOT / "calibration" / "h200.json"}
    for name, argv in _real_outputs(outs, root).items():
        code, out = invoke(argv)
        assert code in (0, 1), (name, out)
        outs[name] = root / name
    return outs


def _real_outputs(p: dict[str, Path], root: Path) -> dict[str, list[str]]:
    return {"timeline": ["timeline", str(p["trace"]), "--out", str(root / "timeline")],
            "replay": ["replay", str(p["trace"]), "--backend", "reference",
                       "--json", str(root / "replay")],
            "sweep": ["sweep", str(p["sweep_file"]), "--out", str(root / "sweep"),
                      "--workers", "1"]}


# command -> (argv with OUT where the output path goes, the flag, the kind it writes)
COMMANDS: dict[str, tuple[Callable[[dict[str, Path]], list[str]], str, Kind]] = {
    "run": (lambda p: ["run", str(p["scenario"]), "--out", "OUT"], "--out", Kind.TRACE),
    "fuzz": (lambda p: ["fuzz", *FUZZ, "--db", str(p["db"]), "--out", "OUT"], "--out",
             Kind.FUZZ),
    "sweep": (lambda p: ["sweep", str(p["sweep_file"]), "--workers", "1", "--out", "OUT"],
              "--out", Kind.SWEEP),
    "timeline": (lambda p: ["timeline", str(p["trace"]), "--out", "OUT"], "--out",
                 Kind.TIMELINE),
    "calibrate": (lambda p: ["calibrate", "--out", "OUT"], "--out", Kind.CALIBRATION),
    "replay": (lambda p: ["replay", str(p["trace"]), "--backend", "reference", "--json", "OUT"],
               "--json", Kind.REPLAY),
    # refused before .venv-vllm is looked for: these cases need no vLLM
    "record": (lambda p: ["record", "--engine", "vllm", str(p["scenario"]), "--out", "OUT"],
               "--out", Kind.TRACE),
}


def _user_files(root: Path) -> dict[str, str]:
    """A folder of someone's notes beside a file, a FIFO and a link; returns name -> path."""
    notes = root / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "todo.txt").write_text("call the lab\n")
    (notes / "sub" / "data.csv").write_bytes(b"a,b\n1,2\n")
    (root / "essay.txt").write_text("draft\n")
    os.mkfifo(root / "pipe")
    (root / "link").symlink_to(notes)
    (root / "loop1").symlink_to(root / "loop2")
    (root / "loop2").symlink_to(root / "loop1")
    ro = root / "locked"
    ro.mkdir()
    ro.chmod(0o555)
    return {"a folder of notes": str(notes), "a file": str(root / "essay.txt"),
            "inside a file": str(root / "essay.txt" / "out"), "a FIFO": str(root / "pipe"),
            "a link to a folder": str(root / "link"), "the parent folder": "..",
            "the working directory": ".", "the working directory by name": str(root / "cwd"),
            "an empty string": "", "the root": "/", "the home folder": str(Path.home()),
            "a missing parent": str(root / "absent" / "out"),
            "a loop of links": str(root / "loop1" / "out"), "a name too long": "n" * 300,
            "a read-only mount": "/proc/kvsim-out",  # read-only even for root
            "a read-only folder": str(ro / "out")}


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry under `root` with its type and bytes: what must not change."""
    snap: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if p.is_symlink():
                snap[rel] = ("link", os.readlink(p))
            elif p.is_file():
                snap[rel] = p.read_bytes()
            else:
                snap[rel] = ("dir" if p.is_dir() else "special", p.stat().st_mode)
    return snap


def _argv(command: str, inputs: dict[str, Path], out: str) -> list[str]:
    return [out if a == "OUT" else a for a in COMMANDS[command][0](inputs)]


def _check(case: Case, root: Path) -> list[str]:
    before = _snapshot(root)
    t0 = time.monotonic()
    code, out = invoke(case.argv)
    bad = problems(case, code, out)
    if _snapshot(root) != before:
        bad.append("something under the test folder was written or deleted")
    if time.monotonic() - t0 > 10:
        bad.append("work was done before the refusal")
    return [f"{case.name}: {', '.join(bad)}\n    {out.strip()[:300]}"] if bad else []


def test_user_paths_are_refused_by_every_command(tmp_path: Path, inputs: dict[str, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "user"
    paths = _user_files(root)
    if os.access(root / "locked", os.W_OK):  # root ignores the mode: the /proc case stays real
        del paths["a read-only folder"]
    (root / "cwd" / "deeper").mkdir(parents=True)
    monkeypatch.chdir(root / "cwd")
    failures, n = [], 0
    for command, (_, flag, _) in COMMANDS.items():
        for what, out in paths.items():
            n += 1
            case = Case(f"{command} {flag} {what}", _argv(command, inputs, out),
                        [flag, repr(out) if out in ("", ".") else out])
            failures += _check(case, root)
    assert failures == []
    assert n >= 6 * 15


def test_other_kinds_of_kvsim_output_are_refused(tmp_path: Path, inputs: dict[str, Path]) -> None:
    """A trace is not a sweep folder, a timeline is not a calibration: each stays as it was."""
    root = tmp_path / "outs"
    root.mkdir()
    for name in ("trace", "timeline", "replay", "sweep", "calibration"):
        src = inputs[name]
        (shutil.copytree if src.is_dir() else shutil.copy)(src, root / name)
    failures, n = [], 0
    for command, (_, flag, kind) in COMMANDS.items():
        for name in ("trace", "timeline", "replay", "sweep", "calibration"):
            if name == kind.name.lower():
                continue
            n += 1
            out = str(root / name)
            failures += _check(Case(f"{command} {flag} a {name}",
                                    _argv(command, inputs, out), [flag, out]), root)
    assert n >= 25
    assert failures == []


@pytest.mark.parametrize("command", ["run", "record", "timeline", "replay", "calibrate"])
def test_same_kind_needs_force(command: str, tmp_path: Path, inputs: dict[str, Path]) -> None:
    kind = COMMANDS[command][2]
    name = "trace" if kind is Kind.TRACE else kind.name.lower()
    old = tmp_path / name
    (shutil.copytree if inputs[name].is_dir() else shutil.copy)(inputs[name], old)
    case = Case(f"{command} over its own output", _argv(command, inputs, str(old)),
                [str(old), "--force"])
    assert _check(case, tmp_path) == []


def _older(name: str, path: Path) -> None:
    """Turn a copy of a real output into an earlier one of the same kind, told apart by its
    bytes (what --force must replace)."""
    if name == "trace":
        m = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**m, "digest": "older"}))
    elif name == "timeline":
        path.write_text('{"displayTimeUnit": "ms", "traceEvents": [\n]}\n')
    else:
        path.write_text(json.dumps({"kvsim": "replay", "rows": []}, indent=1))


@pytest.mark.parametrize("command", ["run", "timeline", "replay"])
def test_force_replaces_same_kind(command: str, tmp_path: Path, inputs: dict[str, Path]) -> None:
    kind = COMMANDS[command][2]
    name = "trace" if kind is Kind.TRACE else kind.name.lower()
    old = tmp_path / name
    (shutil.copytree if inputs[name].is_dir() else shutil.copy)(inputs[name], old)
    _older(name, old)
    assert is_output(old, kind)
    code, out = invoke([*_argv(command, inputs, str(old)), "--force"])
    assert code in (0, 1), out
    if name == "trace":
        def digest(p: Path) -> str:
            return str(json.loads((p / "manifest.json").read_text())["digest"])
        assert digest(old) == digest(inputs[name])
    elif name == "timeline":
        assert old.read_bytes() == inputs[name].read_bytes()
    else:  # a replay names its input and times itself: its verdicts are what must match
        assert json.loads(old.read_text())["rows"] == json.loads(inputs[name].read_text())["rows"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temp or old copy left


def test_sweep_resumes_its_own_folder_and_force_starts_afresh(tmp_path: Path,
                                                              inputs: dict[str, Path]) -> None:
    out = tmp_path / "sweep"
    shutil.copytree(inputs["sweep"], out)
    argv = _argv("sweep", inputs, str(out))
    code, text = invoke(argv)
    assert code == 0 and "0 simulations run, 2 cached" in text, text
    code, text = invoke([*argv, "--force"])
    assert code == 0 and "2 simulations run, 0 cached" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]


def test_failed_sweeps_leave_nothing(tmp_path: Path, inputs: dict[str, Path]) -> None:
    """A grid key the scenario lacks fails validation; a bad workload trace row fails in the
    point's own run, after the sweep folder was made: neither leaves a folder behind."""
    sc = json.loads(json.dumps(BASE))
    sc["workload"] = {"trace": {"path": "bad.csv", "format": "azure2023"}}
    (tmp_path / "trace.toml").write_bytes(to_toml(sc))
    (tmp_path / "bad.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nxx,1,2\n")
    sweeps = {"grid key": (f'base = "{inputs["scenario"]}"\n[grid]\n"cache.no_such_knob" = [1]\n',
                           "cache.no_such_knob"),
              "trace row": ('base = "trace.toml"\n[grid]\n"seed" = [1]\n', "TIMESTAMP")}
    failures = []
    for name, (text, field) in sweeps.items():
        f = tmp_path / f"{name.replace(' ', '_')}.toml"
        f.write_text(text)
        out = tmp_path / "new"
        failures += _check(Case(f"sweep with a bad {name}", ["sweep", str(f), "--out", str(out),
                                                           "--workers", "1"], [field], out),
                           tmp_path)
    assert failures == []


def test_a_folder_that_appears_meanwhile_is_not_replaced(tmp_path: Path) -> None:
    """check_out ran minutes ago; publish looks again before it swaps anything."""
    out = tmp_path / "trace"
    assert check_out(out, Kind.TRACE).value == "new"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(OutputError, match="not a kvsim trace"):
        run(parse_scenario(BASE), out=out)
    assert _snapshot(tmp_path) == {"trace": ("dir", out.stat().st_mode),
                                   "trace/notes.txt": b"mine\n"}


def test_publish_without_an_atomic_swap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where renameat2 is missing, the old output goes aside, the new one in, the old away."""
    import sim.outputs

    monkeypatch.setattr(sim.outputs, "_exchange", lambda a, b: False)
    old, new = tmp_path / "f", tmp_path / "f.tmp-1"
    for d, text in ((old, "old"), (new, "new")):
        d.mkdir()
        (d / "kvsim.json").write_text(json.dumps({"kind": "fuzz"}))
        (d / "scenario.toml").write_text(text)
    publish(new, old, Kind.FUZZ)
    assert (old / "scenario.toml").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def _sweep_cache(out: Path) -> int:
    return len(list((out / "cache").glob("*/*.json")))


def test_killed_forced_sweep_leaves_the_old_one(tmp_path: Path, inputs: dict[str, Path]) -> None:
    """SIGKILL mid `sweep --force`: the old sweep is untouched; the next run removes the dead
    run's temporary folder."""
    big = json.loads(json.dumps(BASE))
    big["workload"] = {"synthetic": {
        "num_requests": 200, "qps": 50.0,
        "prompt_len": {"kind": "uniform", "min": 16, "max": 200},
        "output_len": {"kind": "uniform", "min": 8, "max": 64}}}
    (tmp_path / "big.toml").write_bytes(to_toml(big))
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('base = "big.toml"\n[grid]\n"seed" = [1, 2, 3, 4, 5, 6]\n')
    out = tmp_path / "sw"
    shutil.copytree(inputs["sweep"], out)
    before = _snapshot(out)
    argv = KVSIM + ["sweep", str(sweep), "--out", str(out), "--force", "--workers", "1"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tmp = out.with_name(f"sw.tmp-{p.pid}")
    deadline = time.monotonic() + 60
    while _sweep_cache(tmp) < 1 and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.02)
    p.kill()
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL and tmp.is_dir()
    assert _snapshot(out) == before
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "6 points, 6 simulations run, 0 cached" in r.stdout
    assert sorted(q.name for q in tmp_path.iterdir()) == ["big.toml", "sw", "sweep.toml"]
