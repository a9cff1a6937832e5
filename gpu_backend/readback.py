"""The verdict data's trip back from the device, and the verdicts made of it (`driver._loop`).

A step's per-token errors and moved pages stay on the device (`Pending`) until the loop sends a
few steps' worth back together: concatenated and copied into pinned memory behind their work,
an event recorded after the copies (`send`). The host judges each read-back once its event has
fired (`drain`), waits for the oldest only when more than the loop's lead are on their way, and
for all of them at a settle (`settle`, one sync). Judging is one numpy pass over the steps'
tokens (`oracle.judge`); a step where a page moved outside what its appends may write blames
its rows (`oracle.blame`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from gpu_backend.boxed import Boxed
from gpu_backend.oracle import CORRUPT, FAULT, blame, judge
from gpu_backend.prepare import Prepared
from gpu_backend.result import Judged, ReplayResult
from gpu_backend.watch import IncrementalWatch, Unseen, Watch


@dataclass
class Pending:
    """A step whose verdicts are still on the device: per-token errors and moved pages (the
    watch's form; a graph step's both in the loop's arena, `Boxed`), or the fault message that
    replaces them."""
    p: Prepared
    tok: torch.Tensor | Boxed | None
    changed: torch.Tensor | Boxed | None
    fault: str = ""


@dataclass
class Sent:
    """Pending steps whose device data is on its way to the host: per-token errors and moved
    pages concatenated over the steps, copied into pinned memory behind the steps' work;
    `ready` fires when the copies are done (None: the data is already on the host). Steps whose
    results are all in one arena (`Boxed`) come home as its span in one copy: `home`, (the
    bytes, the arena offset they start at)."""
    steps: list[Pending]
    toks: torch.Tensor | None
    moved: torch.Tensor | None
    ready: torch.cuda.Event | None
    home: tuple[torch.Tensor, int] | None = None
    # the watch's stale flag as of these steps, on its way too (a settle's last read-back:
    # reading it after the others cost the replay's tail one more sync)
    stale: torch.Tensor | None = None


def send(pending: list[Pending], stale: torch.Tensor | None = None) -> Sent:
    """Queue the read-back of the pending steps' verdict data (no wait) and clear `pending`;
    stale: the watch's flag (`Watch.stale`), read back with them."""
    first = pending[0].tok if pending else None
    if isinstance(first, Boxed) and all(isinstance(x.tok, Boxed) and x.tok.arena is first.arena
                                        for x in pending):
        last = pending[-1].tok
        assert isinstance(last, Boxed)
        out = Sent(list(pending), None, None, None,
                   (_to_host(first.arena[first.off: last.end]), first.off))
    else:  # steps run eagerly among them, or arenas apart: each step's results as tensors
        steps = [_unboxed(x) for x in pending]
        toks = [x.tok for x in steps if isinstance(x.tok, torch.Tensor)]
        moved = [x.changed for x in steps if isinstance(x.changed, torch.Tensor)]
        out = Sent(steps, _to_host(torch.cat(toks, 1)) if toks else None,
                   _to_host(torch.cat(moved)) if moved else None, None)
    if stale is not None:
        out.stale = _to_host(stale)
    if any(x is not None and x.is_pinned()
           for x in (out.toks, out.moved, out.home[0] if out.home else None, out.stale)):
        out.ready = torch.cuda.Event()
        out.ready.record()
    pending.clear()
    return out


def _unboxed(x: Pending) -> Pending:
    if not isinstance(x.tok, Boxed):
        return x
    tok, moved = x.tok.tensors()
    return Pending(x.p, tok, moved, x.fault)


def _to_host(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return x
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    return host.copy_(x, non_blocking=True)


def drain(res: ReplayResult, sent: deque[Sent], watch: Watch, lead: int) -> None:
    """The verdicts of the read-backs that have arrived, oldest first, and of the oldest beyond
    `lead` still on their way (waiting for them)."""
    while sent and (len(sent) > lead or sent[0].ready is None or sent[0].ready.query()):
        s = sent.popleft()
        if s.ready is not None:
            s.ready.synchronize()
        _verdicts(res, s, watch)


def settle(res: ReplayResult, sent: deque[Sent], watch: Watch) -> None:
    """Wait for every read-back and append their verdicts, each judged as soon as it has
    arrived (the oldest first, while the device runs the later ones' steps: a prompts' step's
    131k tokens are judged beside the generation steps after it), then raise Unseen if the
    incremental watch saw a page change outside the steps' targets (its flag as the last
    read-back brought it, or read after all of them: a sync; the replay is then made again in
    full, these verdicts dropped)."""
    flag = sent[-1].stale if sent else None
    while sent:
        s = sent.popleft()
        if s.ready is not None:
            s.ready.synchronize()
        _verdicts(res, s, watch)
    flag = watch.stale() if flag is None else flag
    if flag is not None and int(flag.item()):
        raise Unseen("a page changed outside the steps' target pages")


def _verdicts(res: ReplayResult, s: Sent, watch: Watch) -> None:
    """Judge the steps of one read-back (`oracle.judge`: one pass over all their tokens), then
    blame the rows of any step where a page moved."""
    live = [x for x in s.steps if x.tok is not None]
    toks, moved = _home(s)
    code, err = (judge([x.p.b for x in live], toks, res.tol) if live and toks is not None
                 else (np.zeros(0, np.int64), np.zeros(0, np.float32)))
    suspect = moved
    if moved.size and isinstance(watch, IncrementalWatch):  # flags over each step's wpages
        suspect = moved & ~np.concatenate([x.p.wok for x in live])  # the usual step: none
    if suspect.any():
        at = off = 0
        for x in live:
            assert x.changed is not None  # a step that ran has both (`Pending`)
            n = x.changed.w if isinstance(x.changed, Boxed) else int(x.changed.numel())
            rows = x.p.b.num_rows
            if suspect[at: at + n].any():
                bad = blame(x.p.b, watch.changed_pages(x.p, moved[at: at + n]))
                code[off: off + rows][bad] = CORRUPT
            at, off = at + n, off + rows
    faults = {i: x.fault for i, x in enumerate(s.steps) if x.tok is None}
    if faults:  # their rows, FAULT and NaN, in step order among the others
        code, err = _with_faults(s.steps, code, err)
    res.judged.append(Judged([x.p.rows for x in s.steps], code, err, faults))


def _home(s: Sent) -> tuple[np.ndarray | None, np.ndarray]:
    """The read-back's token errors [2, its steps' tokens] (None: no step ran) and moved
    flags, on the host: an arena's span cut into its steps' parts (`Boxed.host`)."""
    if s.home is None:
        return (s.toks.numpy() if s.toks is not None else None,
                s.moved.numpy() if s.moved is not None else np.zeros(0, dtype=bool))
    buf, at = s.home[0].numpy(), s.home[1]
    parts = [x.tok.host(buf, at) for x in s.steps if isinstance(x.tok, Boxed)]
    return (np.concatenate([t for t, _ in parts], axis=1),
            np.concatenate([m for _, m in parts]))


def _with_faults(steps: list[Pending], code: np.ndarray, err: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    codes, errs, at = [], [], 0
    for x in steps:
        n = x.p.b.num_rows
        if x.tok is None:
            codes.append(np.full(n, FAULT))
            errs.append(np.full(n, np.nan, dtype=np.float32))
        else:
            codes.append(code[at: at + n])
            errs.append(err[at: at + n])
            at += n
    return np.concatenate(codes), np.concatenate(errs)
