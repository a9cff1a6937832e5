"""The replay's preparation (`gpu_backend.prepare`) in worker processes, beside the step loop.

Why: at batch 64 x kv 2k the device runs a step in ~0.32 ms, and preparing one took the H200's
host 0.6-1.0 ms on the loop's own thread when the preparation was all numpy: the replay was
bound by the host's preparation end to end. Here N forked workers prepare it while the loop only
launches. The loop's own preparation is now ~4x cheaper, so they no longer pay, and a replay
takes them only when asked (`usable`).

The steps (those with rows) are cut into chunks: chunk 0, the loop's own while the workers start,
is the prompts' step (whose arrays cost more to ship than to build: ~0.3 s before the first
generation step at batch 128 x kv 8k), then chunks of 1, 2, ... up to `prepare.CHUNK_STEPS`
steps (`_chunk`), worker w's those c >= 1 with (c - 1) % N == w (`_owner`).
A chunk's preparation needs the host state of the steps before it (shared blocks, truth
slots, the last step's rewind), so every worker walks every step, the other workers' ones
cheaply (`prepare.advance`: events and slots, no arrays). A prepared chunk is its staged words
(`staging.Chunk.words`) and the steps' metadata (pickled `Prepared` fields with the batch as
`StepBatch.shipped`, ~10 kB a step at 64 x 2k), written into the worker's shared-memory slot
(`gpu_backend.slots`); the pipe carries only which slot. Through the pipe itself a chunk's
megabyte cost the loop ~1.2 ms on the H200's host; a part larger than a
slot (a long prompt step) still goes that way. The loop receives the chunks in order, at most
one ahead of the steps it hands out. On a GPU it uploads a chunk's words from the slot itself,
which CUDA has page-locked, and gives the slot back once the chunk's steps are all judged.

Each worker grows its own graph capacities (`HostState.graph_caps`), so N workers can ask for a
few more CUDA graphs than one process would; the arrays, events and verdicts are the same
(tests/unit/test_workers.py). The workers are forked, by one process the loop forks
(`gpu_backend.forks`): they inherit the loaded trace and never touch CUDA (staging in a worker
is numpy only).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_backend import forks, prepare, slots
from gpu_backend.events import InFlight, in_flight_poison
from gpu_backend.layout import build_step
from gpu_backend.prepare import HostState, Prepared
from gpu_backend.staging import Chunk, PackedSlots, StepArrays
from gpu_backend.tracedata import TraceData
from sim.errors import KvsimError
from sim.trace.records import StepRecord

# Prepared's fields after (step, rows, b, dv): shipped as they are
_REST = [f.name for f in fields(Prepared)][4:-1]  # not `deferred`: a worker defers nothing


def usable(device: torch.device | str) -> int:
    """Workers this host has the cores for (`bench/gpu_replay.py`'s workers pass runs this
    many; `kvsim replay --prepare-workers N` takes N as given): 4 on a CUDA host with 6 cores
    or more (two left to the loop and the driver's threads; 8 were slower than 4 on the H200's
    host), else none (the CPU reference backend's torch needs those cores).

    No replay takes them unless asked. They paid for traces of 256+ steps at 64 x 2k while the
    loop's own preparation took 0.85 ms a generation step on the H200's host; at its ~0.2 ms
    the workers' fixed start (66-119 ms) and their receiving no longer pay. The whole replay,
    both ways in one run each, on a slow host: 64 x 2k, 256 steps 251 and 306 ms with 4
    workers against 213 and 211 on the loop's thread; 512 steps 399 against 316 (~0.58 against
    ~0.41 ms a step past 256); 64 x 4k, 256 steps 369 against 247. On a fast host: 64 x 2k,
    256 steps 219 against 127 ms, 512 steps 341 against 240."""
    cores = os.cpu_count() or 1
    return min(4, cores - 2) if torch.device(device).type == "cuda" and cores >= 6 else 0


def worker_steps(trace: TraceData, state: HostState, device: torch.device | str, workers: int
                 ) -> Generator[Prepared, None, None]:
    """`prepare.prepared_steps`, prepared by `workers` forked processes. The host seconds the
    loop spends here (waiting for and uploading chunks) go to `state.seconds`; each step's
    preparation time in its worker to `state.step_seconds`; the workers' start to
    `state.start_seconds`."""
    t0 = time.perf_counter()
    steps = prepare.replayed(trace)
    flight = in_flight_poison(trace)
    from gpu_backend import fa2plan, flatten, prepk

    # numba's compiles or cache loads, once here, not in every worker
    if steps and not (flatten.flatten.signatures or flatten._flat.signatures):
        s = steps[0]
        build_step(s, trace.rows[s.step], trace.model.page_size, state.guard,
                   np.zeros(0, np.int64), trace.columns.get(s.step))
    prepk.warm()
    if state.graphs is not None:
        fa2plan.warm()
    ctx = mp.get_context("fork")
    links: list[_Link] = []
    proc = None
    t1 = time.perf_counter()
    _spend(state.timing, "start: warm", t1 - t0)
    try:
        sends = []
        for _ in range(workers):
            recv, send = ctx.Pipe(duplex=False)
            _widen(send.fileno())
            ring = slots.Ring(ctx)
            links.append(_Link(recv, ring))
            sends.append(_Link(send, ring))
        t2 = time.perf_counter()
        proc = forks.start(ctx, _work, [(state, flight, steps, w, workers, x)
                                        for w, x in enumerate(sends)], [x.conn for x in sends])
        t3 = time.perf_counter()
        for x in sends:
            x.conn.close()
        if torch.device(device).type == "cuda":
            for link in links:
                link.ring.pin = slots.Pinned(link.ring.mem)
                state.cleanup.append(link.ring.pin.undo)
        state.start_seconds = time.perf_counter() - t0
        _spend(state.timing, "start: rings", t2 - t1, "start: fork", t3 - t2)
        state.seconds += state.start_seconds
        yield from _in_order(trace, state, device, steps, links, flight)
        for link in links:  # each worker's time, sent after its last chunk
            try:
                msg = link.conn.recv() if link.conn.poll(1.0) else ("", {})
            except EOFError:  # it had no chunk and died: nothing of the replay is lost
                msg = ("", {})
            _spend(state.timing, *(x for kv in msg[1].items() for x in kv))
    finally:
        if proc is not None:
            forks.stop(proc)
        for link in links:  # a ring's mapping goes with the last step viewing its slots
            link.conn.close()


@dataclass
class _Link:
    conn: Connection
    ring: slots.Ring


def _owner(c: int, n: int) -> int:
    """Who prepares chunk c: -1 the loop (chunk 0), else worker (c - 1) % n."""
    return (c - 1) % n if c else -1


LEAD = 1  # chunk 0, the loop's own: the prompts' step. The loop then looks ahead to step 1 while
# it launches that one (`driver._loop` holds the next step before it runs the current one),
# from worker 0: its chunk is ready by then unless the prompts' step is light (the ramp below)


def _chunk(i: int, per: int) -> int:
    """The chunk of the i-th step with rows (`prepare.ramp`: 0 holds the first LEAD steps, then
    chunk c has min(c, per) steps). Why the ramp: a worker's first chunk after the fork comes
    slowly (its first writes copy the pages it shares with the loop: 8 steps took 11-17 ms on a
    development machine against ~4 ms warm) and the loop needs it at once; each later one is
    needed after the loop has run all the chunks before it.
    Forking after chunk 0 instead, while the device runs the prompts' step, is slower at
    64 x 2k: the first worker chunk then comes ~45 ms after the forks, which no longer overlap
    the loop's preparation of the prompts' step."""
    return prepare.ramp(i, per, LEAD)


def _in_order(trace: TraceData, state: HostState, device: torch.device | str,
              steps: list[StepRecord], links: list[_Link], flight: InFlight
              ) -> Iterator[Prepared]:
    """Chunk 0 prepared here, then the chunks from their workers in order: the next one is
    received once it has arrived (at most one chunk ahead of the step handed out), or when no
    step is left to hand out. The loop waits for a worker only then: blocking for chunk 1 at
    the first step cost ~10 ms before the first generation step at batch 64 x kv 2k."""
    per = prepare.CHUNK_STEPS
    count = _chunk(len(steps) - 1, per) + 1 if steps else 0
    t0 = time.perf_counter()
    ready = deque(_first_chunk(trace, state, device, steps[:LEAD], flight))
    state.seconds += time.perf_counter() - t0
    c = 1
    t = time.perf_counter()  # "loop: between": the loop's time here besides receiving chunks
    while c < count or ready:
        for x in links:
            x.ring.release()
        link = links[_owner(c, len(links))] if c < count else None
        if link is not None and (not ready or (len(ready) <= per and link.conn.poll(0))):
            t0 = time.perf_counter()
            ready.extend(_receive(trace, state, device, steps, link))
            t1 = time.perf_counter()
            state.seconds += t1 - t0
            _spend(state.timing, "loop: between", t0 - t, "loop: receive", t1 - t0)
            t = t1
            c += 1
            continue
        p = ready.popleft()
        _spend(state.timing, "loop: between", time.perf_counter() - t)
        yield p
        t = time.perf_counter()


def _first_chunk(trace: TraceData, state: HostState, device: torch.device | str,
                 steps: list[StepRecord], flight: InFlight) -> list[Prepared]:
    """Chunk 0's steps prepared and staged by the loop, an upload each: a step's upload is
    part of its preparation time (the prompts' step's, megabytes at batch 64, is then not
    counted against the first generation step's)."""
    out: list[Prepared] = []
    for s in steps:
        t0 = time.perf_counter()
        chunk = Chunk(device)
        out.append(prepare.prepare_step(state, s, trace.rows[s.step], flight, chunk))
        chunk.upload()
        state.step_seconds[s.step] = time.perf_counter() - t0
    return out


def _receive(trace: TraceData, state: HostState, device: torch.device | str,
             steps: list[StepRecord], link: _Link) -> list[Prepared]:
    """One chunk's steps (one or more uploads, as `prepared_steps` splits them)."""
    out: list[Prepared] = []
    while True:
        t0 = time.perf_counter()
        if not link.conn.poll(0):
            link.ring.make_room()
        try:
            msg = link.conn.recv()
        except EOFError:
            raise KvsimError("a preparation worker exited without a word (killed? out of "
                             "memory?); --prepare-workers 0 prepares on the loop's thread") \
                from None
        t1 = time.perf_counter()
        if msg[0] == "error":
            raise msg[1]
        chunk = Chunk(device)
        words = None
        if msg[0] == "slot":
            _, k, nb_words, nb_meta = msg
            metas, n, last, h64, words = _from_slot(link.ring, chunk, k, nb_words, nb_meta,
                                                    state.timing)
        else:
            _, metas, n, last = msg
            h64 = chunk.read(link.conn.fileno(), n)
        t2 = time.perf_counter()
        chunk.load(h64)
        if words is not None:
            done = torch.cuda.Event()
            done.record()
            link.ring.hold(chunk, words, done)
        _spend(state.timing, "loop: wait", t1 - t0, "loop: copy", t2 - t1,
               "loop: upload", time.perf_counter() - t2)
        for i, seconds, b, at, rest in metas:
            s = steps[i]
            state.step_seconds[s.step] = seconds
            out.append(Prepared(s, trace.rows[s.step], b, StepArrays(chunk, at), *rest))
        if last:
            return out


def _from_slot(ring: slots.Ring, chunk: Chunk, k: int, nb_words: int, nb_meta: int,
               timing: dict[str, float]
               ) -> tuple[Any, int, bool, torch.Tensor, np.ndarray | None]:
    """(metas, words, last part, host words, the slot's words if they are read in place) of
    the chunk in slot k. Read in place, the slot is the chunk's until it goes
    (`slots.Ring.hold`); else the words are copied into pinned memory and the slot is free at
    once. "loop: copy" times all of this, "loop: copy: unpickle" the metadata and "loop: copy:
    pin" the words (their pinned copy, or the view of them in place)."""
    base = k * slots.SLOT_BYTES
    t0 = time.perf_counter()
    with memoryview(ring.mem)[base + nb_words: base + nb_words + nb_meta] as meta:
        metas, n, last = pickle.loads(meta)  # read in place (a slice of the mmap copies it)
    t1 = time.perf_counter()
    words: np.ndarray | None = np.frombuffer(ring.mem, np.int64, n, base)
    if n and ring.in_place():
        h64 = torch.from_numpy(words)
    else:
        h64 = chunk.pinned(n)
        h64.numpy()[:] = words
        words = None
        ring.free.release()
    _spend(timing, "loop: copy: unpickle", t1 - t0, "loop: copy: pin", time.perf_counter() - t1)
    return metas, n, last, h64, words


def _to_slot(link: _Link, metas: list[Any], words: np.ndarray, end: bool,
             spent: dict[str, float]) -> None:
    """A worker's part of a chunk into its next slot (waits for a free one), or through the
    pipe when it does not fit."""
    meta = pickle.dumps((metas, len(words), end), protocol=pickle.HIGHEST_PROTOCOL)
    ring = link.ring
    if words.nbytes + len(meta) > slots.SLOT_BYTES:
        link.conn.send(("pipe", metas, len(words), end))
        _write(link.conn.fileno(), words.data.cast("B"))
        return
    t0 = time.perf_counter()
    ring.free.acquire()  # the loop makes room before it waits for this (`slots.Ring.make_room`)
    _spend(spent, "workers: slot wait", time.perf_counter() - t0)
    k, ring.next = ring.next, (ring.next + 1) % slots.SLOTS
    base = k * slots.SLOT_BYTES
    ring.mem[base: base + words.nbytes] = words.data.cast("B")
    ring.mem[base + words.nbytes: base + words.nbytes + len(meta)] = meta
    link.conn.send(("slot", k, words.nbytes, len(meta)))


def _work(st: HostState, flight: InFlight, steps: list[StepRecord], w: int, n: int,
          link: _Link) -> None:
    """Worker w of n: prepare its chunks (`_owner`), walk the other steps."""
    per = prepare.CHUNK_STEPS
    spent: dict[str, float] = {}
    try:
        chunk, metas = Chunk("cpu"), []
        for i, s in enumerate(steps):
            rows = st.trace.rows[s.step]
            t0 = time.perf_counter()
            if _owner(_chunk(i, per), n) != w:
                prepare.advance(st, s, rows, flight, _owner(_chunk(i + 1, per), n) == w)
                _spend(spent, "workers: walk", time.perf_counter() - t0)
                continue
            p = prepare.prepare_step(st, s, rows, flight, chunk)
            t1 = time.perf_counter()
            metas.append(_meta(i, t1 - t0, p))
            end = _chunk(i + 1, per) != _chunk(i, per) or i + 1 == len(steps)
            if end or chunk.n >= prepare.CHUNK_WORDS:
                _to_slot(link, metas, chunk.words(), end, spent)
                chunk, metas = Chunk("cpu"), []
            _spend(spent, "workers: prepare", t1 - t0, "workers: ship", time.perf_counter() - t1)
        link.conn.send(("spent", spent))
    except BaseException as e:  # the loop raises it (a TraceError stays one)
        try:
            link.conn.send(("error", e))
        except Exception:  # an exception that does not pickle
            link.conn.send(("error", RuntimeError(f"preparation worker {w}: {e!r}")))
    finally:
        link.conn.close()


def _meta(i: int, seconds: float, p: Prepared) -> tuple[Any, ...]:
    """What the loop needs of the i-th step besides its words (`_receive` makes the Prepared)."""
    return i, seconds, p.b.shipped(), PackedSlots(p.dv.slots), [getattr(p, k) for k in _REST]


def _write(fd: int, data: memoryview) -> None:
    """All of data into the pipe (os.write may take part of it)."""
    while len(data):
        data = data[os.write(fd, data):]


def _widen(fd: int) -> None:
    """The pipe's buffer as large as the system allows (Linux: 1 MiB by default, against 64 kiB):
    a chunk of words crosses in a few writes, not one per 64 kiB."""
    try:
        import fcntl

        size = int(Path("/proc/sys/fs/pipe-max-size").read_text())
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except (OSError, ValueError, ImportError):
        pass  # another OS, or a limit: the default buffer works, more slowly


def _spend(into: dict[str, float], *pairs: str | float) -> None:
    """Add seconds to named totals: `_spend(d, "a", 0.1, "b", 0.2)`."""
    for k, v in zip(pairs[::2], pairs[1::2], strict=True):
        into[str(k)] = into.get(str(k), 0.0) + float(v)
