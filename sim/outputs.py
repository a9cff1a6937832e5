"""Output paths that never destroy a user's data (docs/hardening.md "Atomic outputs").

Every command that writes calls `check_out` before any work: it refuses a path that could hold
someone's files (the working directory or a folder above it, the home folder, `/`, a FIFO, a
folder where a file is wanted, a path inside a file, a read-only or missing parent) and an
existing path unless it is kvsim's own output of the same kind and `--force` is given. The
writers then build the output in a temporary sibling `NAME.tmp-<pid>` and `publish` it: the old
output stays whole until the new one takes its name, and nothing but the old output of the same
kind is ever removed.
"""

from __future__ import annotations

import ctypes
import enum
import glob
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from sim.errors import KvsimError

MARKER = "kvsim.json"  # in the folders that have no manifest of their own: {"kind": "sweep"}


class OutputError(KvsimError):
    """An output path that kvsim refuses to write."""


class Kind(enum.Enum):
    """What a command writes; `folder` kinds are directories, the others single files."""

    TRACE = ("trace", True)
    SWEEP = ("sweep folder", True)
    FUZZ = ("fuzz finding", True)
    TIMELINE = ("timeline", False)
    CALIBRATION = ("calibration", False)
    REPLAY = ("replay result", False)

    def __init__(self, label: str, folder: bool) -> None:
        self.label, self.folder = label, folder


class Plan(enum.Enum):
    NEW = "new"  # absent (or an empty folder): write it
    REPLACE = "replace"  # kvsim's own output of this kind, and --force
    RESUME = "resume"  # a sweep folder without --force: add to it


def check_out(raw: str | os.PathLike[str], kind: Kind, force: bool = False,
              flag: str = "--out") -> Plan:
    """Decide what writing `raw` would do, before any work. Raises OutputError (exit 2)."""
    where = f"{flag} {str(raw)!r}" if str(raw) in ("", ".") else f"{flag} {raw}"
    try:
        return _plan(raw, kind, force, flag, where)
    except OSError as e:  # a name too long, say: what the system says, on one line
        raise OutputError(f"{where}: cannot be used ({e.strerror or e})") from None
    except RuntimeError:  # pathlib's word for a loop of symbolic links
        raise OutputError(f"{where}: is inside a loop of symbolic links") from None


def _plan(raw: str | os.PathLike[str], kind: Kind, force: bool, flag: str, where: str) -> Plan:
    path = _refuse_special(raw, where)
    _check_parent(path, where)
    if not path.exists():
        return Plan.NEW
    if kind.folder and path.is_dir() and not any(path.iterdir()):
        return Plan.NEW
    if not is_output(path, kind):
        what = "is a folder; name a file" if not kind.folder and path.is_dir() else (
            f"exists and is not a kvsim {kind.label}; choose another {flag}")
        raise OutputError(f"{where}: {what}")
    if force:
        return Plan.REPLACE
    if kind is Kind.SWEEP:
        return Plan.RESUME
    raise OutputError(f"{where}: exists (a kvsim {kind.label}); pass --force to replace it")


def _refuse_special(raw: str | os.PathLike[str], where: str) -> Path:
    if str(raw) in ("", "."):
        raise OutputError(f"{where}: name a new path (got {str(raw)!r})")
    path = Path(raw)
    real = path.resolve()
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    if real == cwd or real in cwd.parents:
        raise OutputError(f"{where}: is the working directory or a folder above it; "
                          "choose a new path")
    if real == home or real in home.parents:
        raise OutputError(f"{where}: is the home folder or a folder above it; choose a new path")
    if path.is_symlink():
        raise OutputError(f"{where}: is a symbolic link; name the real path")
    if path.exists() and not (path.is_dir() or path.is_file()):
        mode = path.stat().st_mode
        what = "a FIFO" if stat.S_ISFIFO(mode) else "a device or socket"
        raise OutputError(f"{where}: is {what}, not a kvsim output")
    return path


def _check_parent(path: Path, where: str) -> None:
    parent = path.absolute().parent
    for up in (parent, *parent.parents):  # the nearest existing folder above says what is wrong
        if up.exists():
            if not up.is_dir():
                raise OutputError(f"{where}: {up} is a file, not a folder")
            break
    if not parent.is_dir():
        raise OutputError(f"{where}: folder {parent} does not exist; create it first")
    try:  # as root, permission bits say nothing: only a real write tells a read-only parent
        os.rmdir(tempfile.mkdtemp(prefix=".kvsim-probe-", dir=parent))
    except OSError as e:
        raise OutputError(f"{where}: folder {parent} is not writable "
                          f"({e.strerror or e})") from None


def is_output(path: Path, kind: Kind) -> bool:
    """Whether `path` is kvsim's own output of `kind` (and so may be replaced)."""
    try:
        if kind is Kind.TRACE:
            m = _json(path / "manifest.json")
            return isinstance(m, dict) and "format_version" in m and "digest" in m
        if kind.folder:
            m = _json(path / MARKER)
            return isinstance(m, dict) and m.get("kind") == kind.name.lower()
        if kind is Kind.CALIBRATION:
            m = _json(path)
            return isinstance(m, dict) and {"meta", "attention", "gemm"} <= m.keys()
        return path.is_file() and _head(path, len(PREFIX[kind])) == PREFIX[kind]
    except (OSError, ValueError):
        return False


# How kvsim's single-file outputs begin (sim/timeline.py, gpu_backend/replay/run.py
# write_json): read as a prefix, so a large output is recognised without parsing it.
PREFIX = {Kind.TIMELINE: b'{"displayTimeUnit": "ms", "traceEvents": [',
          Kind.REPLAY: b'{\n "kvsim": "replay"'}
_MAX_JSON = 64 << 20  # a marker or calibration file; anything larger is not one


def _json(path: Path) -> object:
    if not path.is_file() or path.stat().st_size > _MAX_JSON:
        return None
    return json.loads(path.read_bytes())


def _head(path: Path, n: int) -> bytes:
    with path.open("rb") as fh:
        return fh.read(n)


def write_marker(folder: Path, kind: Kind) -> None:
    (folder / MARKER).write_text(json.dumps({"kind": kind.name.lower()}) + "\n")


def temp_path(out: Path) -> Path:
    """The sibling a writer builds `out` in; readers refuse it, the next writer removes a dead
    pid's (sim/trace/writer.py remove_stale)."""
    return out.with_name(f"{out.name}.tmp-{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale(out: Path) -> list[Path]:
    """Remove `out.tmp-<pid>` left by killed writers (SIGKILL runs no cleanup); a live pid's
    directory is another run in progress and is kept."""
    gone = []
    for p in out.parent.glob(f"{glob.escape(out.name)}.tmp-*"):
        pid = p.name.rpartition(".tmp-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def publish(tmp: Path, out: Path, kind: Kind) -> None:
    """Move the finished `tmp` to `out`. An existing `out` must be empty or kvsim's own output of
    `kind` (checked again here: minutes may have passed since check_out); the old output is
    swapped out in one step where the system allows it, then removed."""
    if not out.exists() or (out.is_dir() and kind.folder and not any(out.iterdir())):
        os.replace(tmp, out)
        return
    if out.is_symlink() or not is_output(out, kind):
        raise OutputError(f"{out}: appeared meanwhile and is not a kvsim {kind.label}; "
                          "nothing was replaced")
    if not kind.folder:
        os.replace(tmp, out)
        return
    if not _exchange(tmp, out):  # old aside, new in: a kill in between leaves the old aside
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        tmp = old
    shutil.rmtree(tmp)  # now the old output


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_cwd = -100
    return fn(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def write_folder(out: Path, kind: Kind, files: dict[str, str]) -> None:
    """Write `files` (name -> text) as kvsim's output folder `out` of `kind`: built in a
    temporary sibling, marked, then swapped in, replacing only an earlier output of `kind`."""
    out = out.absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out)
    shutil.rmtree(tmp, ignore_errors=True)  # our own pid's: a leftover of a dead namesake
    try:
        tmp.mkdir()
        for name, text in files.items():
            (tmp / name).write_text(text)
        write_marker(tmp, kind)
        publish(tmp, out, kind)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def file_temp(out: Path) -> Path:
    """The hidden sibling a single-file output is written to before `publish`."""
    return out.with_name(f".{out.name}.tmp-{os.getpid()}")


def write_file(out: Path, text: str, kind: Kind) -> None:
    """Write a single-file output atomically: a temporary sibling, then `publish`."""
    tmp = file_temp(out)
    try:
        tmp.write_text(text)
        publish(tmp, out, kind)
    finally:
        tmp.unlink(missing_ok=True)
