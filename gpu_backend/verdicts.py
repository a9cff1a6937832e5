"""A replay's verdicts: per-row codes and errors kept as arrays, rows as objects on demand.

The loop judges a read-back's steps (`loop.EARLY` of them) in one numpy pass over all their
tokens (`judge`) and keeps the codes as arrays (`Judged`): building a `RowResult` per row inside
the loop was ~85 µs of its host a step at batch 64 on the H200, a sixth
of a step's wall. `ReplayResult.rows` builds the objects the first time it is read; `counts`,
`ok` and `max_ok_error` read the arrays.

The verdict data's trip back from the device, and the verdicts made of it (`loop._loop`).

A step's per-token errors and moved pages stay on the device (`Pending`) until the loop sends a
few steps' worth back together: concatenated and copied into pinned memory behind their work,
an event recorded after the copies (`send`). The host judges each read-back once its event has
fired (`drain`), waits for the oldest only when more than the loop's lead are on their way, and
for all of them at a settle (`settle`, one sync). Judging is one numpy pass over the steps'
tokens (`verdicts.judge`); a step where a page moved outside what its appends may write blames
its rows (`verdicts.blame`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_backend import verdicts_jit
from gpu_backend.device.graphs import ArenaResults
from gpu_backend.device.watch import IncrementalWatch, Unseen, Watch
from gpu_backend.host.batch import StepBatch
from gpu_backend.host.prepare import Prepared
from sim.trace.records import RowRecord

OK, MISMATCH, NAN, CORRUPT, FAULT = 0, 1, 2, 3, 4
VERDICTS = ("ok", "mismatch", "nan", "corrupt", "fault")

# bf16 output rounding alone is 2^-9 relative (|out| <= 1 here: a convex mix of V in [-1, 1]),
# and bf16 P·V accumulation adds ~1e-3 (measured noise: docs/gpu.md, Verdicts and tolerance).
# A wrong RoPE position or a foreign page moves the output by > 5e-2. 2e-2 leaves ~4x margin
# both ways.
DEFAULT_TOL = 2e-2


def judge(batches: list[StepBatch], tok: np.ndarray, tol: float
          ) -> tuple[np.ndarray, np.ndarray]:
    """Per-row codes (OK, MISMATCH or NAN) and max |out - ref| over NaN-free tokens of several
    steps' rows end to end, in one pass over their tokens (tok [2, sum of nnz_q], the steps'
    `token_errors` end to end): one compiled call (`verdicts_jit`; `judge_numpy` is its
    definition)."""
    qo = np.concatenate([b.qo_indptr for b in batches]).astype(np.int64, copy=False) \
        if batches else np.zeros(0, np.int64)
    rows = np.fromiter((len(b.qo_indptr) - 1 for b in batches), np.int64, len(batches))
    err = tok[0].astype(np.float32, copy=False)
    return verdicts_jit.judge(err, tok[1].astype(np.float32, copy=False), qo, rows, tol)


def judge_numpy(batches: list[StepBatch], tok: np.ndarray, tol: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """`judge` in numpy (its oracle): a pass per step cost ~10 numpy calls each."""
    # a row's tokens are one run in batch order (`layout`): reduce each run (ufunc.at over
    # the 131k tokens of a 64 x 2k prompts' step took ~0.5 ms on a development machine,
    # reduceat ~0.1)
    offs = np.cumsum([0] + [int(b.qo_indptr[-1]) for b in batches])
    start = np.concatenate([b.qo_indptr[:-1].astype(np.int64) + o
                            for b, o in zip(batches, offs[:-1], strict=True)])
    off = int(offs[-1])
    some = np.diff(start, append=off) > 0  # rows with tokens (the others keep 0, not NaN)
    err, ref_max = tok[0], tok[1]
    tok_nan = np.isnan(err) & ~np.isnan(ref_max)  # out has a NaN where the reference has none
    err = np.nan_to_num(err.astype(np.float32, copy=False), nan=0.0)
    row_err = np.zeros(len(start), dtype=np.float32)
    row_nan = np.zeros(len(start), dtype=bool)
    if off:
        row_err[some] = np.maximum.reduceat(err, start[some])
        row_nan[some] = np.logical_or.reduceat(tok_nan, start[some])
    code = np.where(row_err > tol, MISMATCH, OK)
    code[row_nan] = NAN
    return code, row_err


def blame(b: StepBatch, changed: np.ndarray) -> np.ndarray:
    """[rows] bool: the rows to blame for the pages whose checksum moved during the step
    (changed [pages] bool): a row whose own append targeted a page outside its own blocks that
    moved, or that wrote a page nobody may write this step; a stray change nobody's table
    explains blames them all."""
    allowed = np.zeros_like(changed)
    allowed[b.allowed_pages] = True
    bad = changed & ~allowed
    ew = b.engine_write
    seen = (ew >= 0) & (ew < len(changed))  # a write past the pool moves no checksum
    ewc = np.where(seen, ew, 0)
    hit = ((changed[ewc] & ~b.write_ok) | bad[ewc]) & seen
    row_bad = np.bincount(b.app_row, weights=hit, minlength=b.num_rows) > 0
    row_bad |= bad.any() & ~row_bad.any()
    return row_bad


def verdicts(b: StepBatch, tok: np.ndarray, changed: np.ndarray | None, tol: float
             ) -> tuple[np.ndarray, np.ndarray]:
    """Per-row verdict codes and max |out - ref| over NaN-free tokens of one step, on the host.

    Args: tok [2, nnz_q] from `token_errors`; changed [pages] bool, pages whose checksum moved
    during the step, or None: no page moved (the usual step: nothing of the blame is needed)."""
    code, row_err = judge([b], tok, tol)
    if changed is not None:
        code[blame(b, changed)] = CORRUPT
    return code, row_err


@dataclass
class RowResult:
    step: int
    row: int
    request: int
    phase: str
    q_len: int
    verdict: str
    err: float
    message: str = ""


@dataclass
class Judged:
    """The verdicts of some consecutive steps: their rows' codes (`reference` OK..FAULT) and max
    errors end to end, and the message of each step that faulted (by its index in `rows`)."""
    rows: list[list[RowRecord]]
    code: np.ndarray  # [rows] int
    err: np.ndarray  # [rows] float32 (NaN where the step faulted)
    faults: dict[int, str] = field(default_factory=dict)

    def results(self) -> list[RowResult]:
        out: list[RowResult] = []
        at = 0
        for i, rows in enumerate(self.rows):
            n = len(rows)
            msg = self.faults.get(i, "")
            for r, c, e in zip(rows, self.code[at: at + n].tolist(),
                               self.err[at: at + n].tolist(), strict=True):
                out.append(RowResult(r.step, r.row, r.request, r.phase, r.q_len, VERDICTS[c],
                                     float(e), msg if c == FAULT else ""))
            at += n
        return out


@dataclass
class ReplayResult:
    backend: str
    trace: str
    tol: float
    # what the kernels measured beside the rows (FlashInfer: the plan cache's memory)
    stats: dict[str, Any] = field(default_factory=dict)
    prepare_s: float = 0.0  # host seconds spent in `prepare` (not serialized: timing noise)
    prepare_step_s: dict[int, float] = field(default_factory=dict)  # step -> its share of it
    watch: str = ""  # how page changes were found (`flashinfer`'s watch)
    judged: list[Judged] = field(default_factory=list, repr=False)  # in step order
    _rows: list[RowResult] = field(default_factory=list, repr=False)
    _built: int = field(default=0, repr=False)  # judged entries already in _rows

    @property
    def rows(self) -> list[RowResult]:
        """Every row's verdict in step and row order (built from `judged` on first read)."""
        for j in self.judged[self._built:]:
            self._rows += j.results()
        self._built = len(self.judged)
        return self._rows

    @rows.setter
    def rows(self, rows: list[RowResult]) -> None:  # a result read back from JSON
        self._rows, self.judged, self._built = list(rows), [], 0

    def codes(self) -> np.ndarray:
        """Every row's verdict code (`verdicts.VERDICTS` index), in row order."""
        if not self.judged:
            return np.array([VERDICTS.index(r.verdict) for r in self._rows], dtype=np.int64)
        return np.concatenate([j.code for j in self.judged]).astype(np.int64, copy=False)

    def errors(self) -> np.ndarray:
        if not self.judged:
            return np.array([r.err for r in self._rows], dtype=np.float64)
        return np.concatenate([j.err for j in self.judged]).astype(np.float64)

    def counts(self) -> dict[str, int]:
        n = np.bincount(self.codes(), minlength=len(VERDICTS))
        return {v: int(n[i]) for i, v in enumerate(VERDICTS)}

    @property
    def ok(self) -> bool:
        return bool((self.codes() == OK).all())


def plan_cache_verdict(held: int, bound: int) -> str | None:
    """The engine's plan cache, a verdict of its own beside the rows': "growth" when it held
    more plans than a correctly keyed cache can (`bound`: one per query width and one for
    prefill, I14), else None. Its consequence is memory, not a kernel access, so no row shows
    it (TRT-LLM #18557: a per-batch key only adds wrappers)."""
    return f"growth: {held} plans held, bound {bound}" if held > bound else None


def max_ok_error(res: ReplayResult) -> float:
    ok = res.codes() == OK
    return float(res.errors()[ok].max()) if ok.any() else 0.0


@dataclass
class Pending:
    """A step whose verdicts are still on the device: per-token errors and moved pages (the
    watch's form; a graph step's both in the loop's arena, `ArenaResults`), or the fault message
    that replaces them."""
    p: Prepared
    tok: torch.Tensor | ArenaResults | None
    changed: torch.Tensor | ArenaResults | None
    fault: str = ""


@dataclass
class Sent:
    """Pending steps whose device data is on its way to the host: per-token errors and moved
    pages concatenated over the steps, copied into pinned memory behind the steps' work;
    `ready` fires when the copies are done (None: the data is already on the host). Steps whose
    results are all in one arena (`ArenaResults`) come home as its span in one copy: `home`, (the
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
    if isinstance(first, ArenaResults) and all(
            isinstance(x.tok, ArenaResults) and x.tok.arena is first.arena for x in pending):
        last = pending[-1].tok
        assert isinstance(last, ArenaResults)
        out = Sent(list(pending), None, None, None,
                   (_to_host(first.arena[first.off: last.end]), first.off))
    else:  # steps run eagerly among them, or arenas apart: each step's results as tensors
        steps = [_as_tensors(x) for x in pending]
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


def _as_tensors(x: Pending) -> Pending:
    if not isinstance(x.tok, ArenaResults):
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
    """Judge the steps of one read-back (`verdicts.judge`: one pass over all their tokens), then
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
            n = x.changed.w if isinstance(x.changed, ArenaResults) else int(x.changed.numel())
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
    flags, on the host: an arena's span cut into its steps' parts (`ArenaResults.host`)."""
    if s.home is None:
        return (s.toks.numpy() if s.toks is not None else None,
                s.moved.numpy() if s.moved is not None else np.zeros(0, dtype=bool))
    buf, at = s.home[0].numpy(), s.home[1]
    parts = [x.tok.host(buf, at) for x in s.steps if isinstance(x.tok, ArenaResults)]
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
