"""`kvsim sweep --address` against a real Ray head node, started as its own process.

The head runs `ray start --head --block` in a session of its own, so the finaliser ends it and
every process it started (GCS, raylet, workers) by that one process group: nothing is left
running, and no other Ray on the machine is touched (as `ray stop` would).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from sim.cli import app
from sim.sweep import load_sweep, run_sweep

pytest.importorskip("ray")  # `make test` installs it (the `ray` extra): skipped only without

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))

BASE = """
seed = 3
[cache]
tokens_per_block = 16
num_blocks = 200
[scheduler]
max_batch_size = 8
[limits]
max_seq_len = 1024
[workload.synthetic]
num_requests = 12
qps = 20.0
prompt_len = { kind = "uniform", min = 20, max = 80 }
output_len = { kind = "uniform", min = 4, max = 16 }
[cost]
step_base_ns = 1_000_000
"""
SWEEP = 'base = "base.toml"\n[grid]\n"scheduler.max_batch_size" = [2, 8]\n'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, head: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"ray start exited {head.returncode}:\n{log.read_text()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the Ray head did not listen on {port}:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def head() -> Iterator[str]:
    """The address of a 2-CPU Ray head node without dashboard, ended with all its processes."""
    tmp = Path(tempfile.mkdtemp(prefix="kvsim-ray-"))  # short: Ray's socket paths are bounded
    port, log = free_port(), tmp / "head.log"
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "2",
           "--node-ip-address", "127.0.0.1", "--port", str(port),
           "--ray-client-server-port", str(free_port()),
           "--dashboard-agent-listen-port", str(free_port()), "--include-dashboard=false",
           "--disable-usage-stats", "--object-store-memory", str(100 * 2**20),
           "--temp-dir", str(tmp / "ray")]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=ENV,
                                start_new_session=True)
    try:
        _wait_listening(port, proc, log)
        yield f"127.0.0.1:{port}"
    finally:
        _end_group(proc)
        shutil.rmtree(tmp, ignore_errors=True)


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM lets `ray start --block` stop what it started; what outlives it is killed."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def kvsim(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "kvsim"), *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=180)


def write(tmp_path: Path, base: str = BASE) -> None:
    (tmp_path / "base.toml").write_text(base)
    (tmp_path / "s.toml").write_text(SWEEP)


def test_sweep_on_ray_equals_the_local_pool(head: str, tmp_path: Path) -> None:
    write(tmp_path)
    spec, base = load_sweep(tmp_path / "s.toml")
    want = run_sweep(spec, base, tmp_path / "local", workers=1).results
    # A relative --out: the workers' cache must still land in it (they run elsewhere).
    ray = kvsim("sweep", "s.toml", "--out", "ray", "--address", head, cwd=tmp_path)
    assert ray.returncode == 0, ray.stderr
    assert "2 points, 2 simulations run, 0 cached" in ray.stdout
    got = pq.read_table(tmp_path / "ray" / "results.parquet")
    assert got.column("grid.scheduler.max_batch_size").to_pylist() == [2, 8]
    assert got.equals(want)
    assert len(list((tmp_path / "ray" / "cache").glob("*/*.json"))) == 2


def test_a_workers_user_error_is_one_line(head: str, tmp_path: Path) -> None:
    """A point that fails on bad input inside a Ray worker reads as it does locally."""
    missing = "[workload.trace]\npath = \"absent.csv\"\nformat = \"azure2023\"\n"
    write(tmp_path, BASE.split("[workload.synthetic]")[0] + missing + "[cost]\n")
    res = kvsim("sweep", "s.toml", "--out", "o", "--address", head, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "absent.csv" in lines[0] and "Traceback" not in res.stderr


def test_a_workers_user_error_beside_running_points_is_one_line(head: str,
                                                                tmp_path: Path) -> None:
    """One point fails at once while others still simulate: they are cancelled and settled
    before the driver leaves, so Ray logs nothing of its own on kvsim's stderr."""
    rows = "".join(f"2023-11-16 18:15:{i // 1000:02d}.{i % 1000:03d}0000,{300 + i % 500},"
                   f"{20 + i % 40}\n" for i in range(20_000))
    (tmp_path / "long.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    trace = "[workload.trace]\npath = \"long.csv\"\nformat = \"azure2023\"\n"
    (tmp_path / "base.toml").write_text(BASE.split("[workload.synthetic]")[0] + trace
                                        + "[cost]\n")
    (tmp_path / "s.toml").write_text('base = "base.toml"\n[grid]\n"workload.trace.path" = '
                                     '["long.csv", "absent.csv", "long.csv"]\n')
    res = kvsim("sweep", "s.toml", "--out", "o", "--address", head, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "absent.csv" in lines[0], res.stderr
    assert not (tmp_path / "o").exists()


def sweep_in_process(tmp_path: Path, address: str) -> tuple[int, str]:
    """The CLI in this process (no Ray start-up to pay): the address is refused before
    `ray.init`, so no Ray state is left behind in it."""
    write(tmp_path)
    r = CliRunner().invoke(app, ["sweep", str(tmp_path / "s.toml"), "--out",
                                 str(tmp_path / "o"), "--address", address])
    assert not (tmp_path / "o").exists()
    return r.exit_code, r.output.strip()  # the progress bar's line break


def test_nothing_listening_fails_fast(tmp_path: Path) -> None:
    t0 = time.monotonic()
    code, out = sweep_in_process(tmp_path, f"127.0.0.1:{free_port()}")
    assert code == 2 and time.monotonic() - t0 < 30
    assert out.startswith("error: --address: HOST:PORT of a running Ray head node")
    assert "connection refused" in out.lower() and len(out.splitlines()) == 1


def test_malformed_address_is_refused(tmp_path: Path) -> None:
    assert sweep_in_process(tmp_path, "localhost") == (
        2, "error: --address: HOST:PORT of a running Ray head node, ray://HOST:PORT or auto "
           "(got 'localhost')")
