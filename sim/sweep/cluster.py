"""Grid points on a Ray cluster (`kvsim sweep --address`): connect first, then fan out.

The workers read the paths the driver hands them (the scenario's folder, its calibration and
trace files, DIR/cache) as they are: a cluster of several machines needs them on a shared
filesystem at the same place.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from types import ModuleType

from sim.errors import KvsimError
from sim.sweep.worker import PointTask, run_point

CONNECT_TIMEOUT_S = 5.0  # a head node on the same network answers well within this
SETTLE_TIMEOUT_S = 10.0  # cancelled points stop at their next bytecode; a stuck one is left
_ALLOWED = "HOST:PORT of a running Ray head node, ray://HOST:PORT or auto"


def connect(address: str) -> ModuleType:
    """Join the Ray cluster at `address` (bounded wait) and return the `ray` module.

    Raises:
        KvsimError: Ray is not installed, `address` is malformed, nothing answers there, or
            Ray refuses to connect. Nothing has been started or written then.
    """
    try:
        import ray  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise KvsimError("--address: needs Ray: pip install 'kvsim[ray]'") from None
    if address != "auto":
        _probe(address)
    if ray.is_initialized():  # ray.init would keep the old connection and ignore `address`
        raise KvsimError(f"--address: this process is already connected to Ray; call "
                         f"ray.shutdown() first (got {address!r})")
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KvsimError(f"--address: {_ALLOWED} (got {address!r}: {first})") from None
    return ray


def _probe(address: str) -> None:
    """Fail fast where nothing listens: ray.init itself waits minutes for a head node that
    never answers."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise KvsimError(f"--address: {_ALLOWED} (got {address!r})")
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
    except OSError as e:
        why = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise KvsimError(f"--address: {_ALLOWED} (got {address!r}: {why} within "
                         f"{CONNECT_TIMEOUT_S:g} s)") from None


def run_points(ray: ModuleType, tasks: list[PointTask]) -> Iterator[tuple[PointTask, dict]]:
    """Each task's row as it finishes. A user error in a worker comes back as itself, once
    the points still in flight are cancelled and settled: a worker killed by the driver's
    `ray.shutdown()` would otherwise be retried and log Ray's own errors on our stderr."""
    remote = ray.remote(run_point)
    pending = {remote.remote(t): t for t in tasks}
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                yield pending.pop(ref), _get(ray, ref)
    except BaseException:
        _settle(ray, list(pending))
        raise


def _settle(ray: ModuleType, refs: list) -> None:
    for ref in refs:
        ray.cancel(ref)
    ray.wait(refs, num_returns=len(refs), timeout=SETTLE_TIMEOUT_S)


def _get(ray: ModuleType, ref: object) -> dict:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        # The worker's KvsimError (a missing trace file, a bad row) is bad input: unwrapped,
        # it is the one line the local pool would print, not a remote traceback.
        if isinstance(e.cause, KvsimError):
            raise e.cause from None
        raise
