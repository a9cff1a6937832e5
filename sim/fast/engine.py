"""The fast engine: sim/fast/kernel.py's compiled loop, fed arrivals and drained into columns.

It is a drop-in for sim.engine.Engine where `supports()` says so, and yields the same trace to
the byte (tests/unit/test_fast.py compares digests): the reference engine stays the oracle.
Output leaves as `Chunk`s of Arrow-ready numpy columns, so nothing per row is a Python object
unless the online checker asks for records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from sim.config import Scenario
from sim.fast import fields as fl
from sim.fast.columns import Chunk, chunk_of, violations_of
from sim.fast.kernel import loop
from sim.fast.recycle import Recycler
from sim.profiles import Switches
from sim.spec import Acceptance
from sim.trace import delta as trace_delta
from sim.trace.records import Violation
from sim.workload import RequestSpec

_ARRIVALS = 1024  # specs pulled from the workload per refill
_STEPS = 4096  # steps per chunk (output buffers are sized from this)
_TOKENS = 1 << 16  # initial token buffer (grows by compaction)


def supports(sc: Scenario, sw: Switches) -> str | None:
    """Why the fast engine cannot run `sc` under `sw` (None: it can, with the same result)."""
    why = {
        "spec.mode is mtp": sc.spec.mode != "none",
        "overlap is enabled": sc.overlap.enabled,
        "cache.reuse is on": sc.cache.reuse != "off",
        "cost.kind is not simple": sc.cost.kind != "simple",
        "cost.host_ns_per_token is set": sc.cost.host_ns_per_token != 0,
        "refresh_graph_pages is off (stale CUDA-graph pages)": not sw.refresh_graph_pages,
    }
    return next((k for k, v in why.items() if v), None)


class FastEngine:
    def __init__(self, sc: Scenario, sw: Switches, specs: Iterator[RequestSpec],
                 on_chunk: Callable[[Chunk], None], detail: bool, delta: bool = False) -> None:
        seeds = np.random.SeedSequence(sc.seed).spawn(3)  # as Engine: same streams, same draws
        self.acc = Acceptance(sc.spec.acceptance, np.random.default_rng(seeds[0]))
        self.tok_rng = np.random.default_rng(seeds[1])
        self.sc, self.sw, self.specs, self.on_chunk = sc, sw, specs, on_chunk
        self.detail = detail
        self.recycle = [Recycler() for _ in range(5)]  # PG, AL, TK, W, E (_drain)
        # rows' page lists as rows.parquet stores them (only the trace writer takes them so)
        self.delta = detail and delta
        self.B = B = sc.cache.tokens_per_block
        self.max_pos = min(sc.model.max_position_embeddings, sc.blocks_per_seq * B)
        self.num_usable = sc.cache.num_blocks - (1 if sw.null_block else 0)
        self.slack = 2
        self.violations: list[Violation] = []
        self.totals = dict.fromkeys(("requests", "finished", "rejected", "output_tokens",
                                     "prompt_tokens", "reused_tokens", "gen_steps",
                                     "accepted", "proposed", "preemptions"), 0)
        self.cfg = self._config()
        self._alloc_state()
        self._alloc_buffers()

    # -- set-up -----------------------------------------------------------------------------
    def _config(self) -> np.ndarray:
        sc, sw = self.sc, self.sw
        cfg = np.zeros(fl.NC, np.int64)
        cfg[fl.C_B], cfg[fl.C_MAXB] = self.B, sc.scheduler.max_batch_size
        cfg[fl.C_MAXTOK], cfg[fl.C_CHUNK] = sc.scheduler.max_num_tokens, sc.scheduler.chunk_size
        cfg[fl.C_POLICY] = fl.GNE if sc.scheduler.policy == "guaranteed-no-evict" else fl.MAXUTIL
        cfg[fl.C_BACKEND] = {"fa2": fl.FA2, "fa3": fl.FA3, "xqa": fl.XQA}[sw.backend]
        cfg[fl.C_WIDTH] = {"reserved": fl.W_RESERVED, "logical-host": fl.W_LHOST,
                           "logical-device": fl.W_LDEV}[sw.gen_table_width]
        cfg[fl.C_CLAMP], cfg[fl.C_MAXPOS] = sw.draft_clamp, self.max_pos
        cfg[fl.C_MAXSEQ] = sc.limits.max_seq_len
        cfg[fl.C_PLANKEY] = {"fresh": fl.P_FRESH, "no-width": fl.P_NOWIDTH,
                             "per-batch": fl.P_PERBATCH}[sw.plan_key]
        cfg[fl.C_USABLE], cfg[fl.C_DETAIL] = self.num_usable, self.detail
        c = sc.cost
        cfg[fl.C_STEP_BASE], cfg[fl.C_NS_TOK], cfg[fl.C_NS_KV] = (
            c.step_base_ns, c.ns_per_token, c.ns_per_kv_token)
        cfg[fl.C_HOST_BASE], cfg[fl.C_HOST_ROW] = c.host_base_ns, c.host_ns_per_row
        cfg[fl.C_DELTA], cfg[fl.C_WINDOW] = self.delta, trace_delta.WINDOW
        return cfg

    def _alloc_state(self) -> None:
        sc = self.sc
        self.G = np.zeros(fl.NG, np.int64)
        self.G[fl.G_STALL] = -1
        self.G[fl.G_MORE] = 1
        self.G[fl.G_PROCESSED] = -1
        first = 1 if self.sw.null_block else 0
        self.pool = np.arange(first, sc.cache.num_blocks, dtype=np.int64)
        self.G[fl.G_PLEN] = len(self.pool)
        self.width = max(sc.blocks_per_seq, -(-sc.limits.max_seq_len // self.B)) + 2
        self.cap = 0
        self.R = np.zeros((0, fl.NF), np.int64)
        self.T = np.zeros((0, self.width), np.int64)
        # each slot's last row's pages and alloc; int32 like flat and the trace: bytes are time
        self.LP = np.zeros((0, self.width), np.int32)
        self.LA = np.zeros((0, self.width), np.int32)
        self.run_q = np.zeros(0, np.int64)
        self.wait = np.zeros(0, np.int64)
        self.slots = np.zeros(0, np.int64)
        self._grow(max(256, 2 * sc.scheduler.max_batch_size))
        # FlashInfer's flat kv_indices buffer: never cleared, read past what a row copied
        self.flat = np.full(2 * sc.scheduler.max_batch_size * self.width, -1, np.int32)
        self.seen = np.zeros(sc.scheduler.max_batch_size + 2, np.int64)
        self.AR = np.zeros((0, 6), np.int64)
        self.toks = np.zeros(_TOKENS, np.int32)
        self.tok_end = 0

    def _grow(self, cap: int) -> None:
        """More request slots (live requests: waiting + running); the rings are re-based."""
        old = self.cap
        R = np.zeros((cap, fl.NF), np.int64)
        R[:old] = self.R
        T = np.zeros((cap, self.width), np.int64)
        LP, LA = (np.zeros((cap, self.width), np.int32) for _ in range(2))
        T[:old], LP[:old], LA[:old] = self.T, self.LP, self.LA
        run_q = np.zeros(cap, np.int64)
        run_q[:old] = self.run_q
        wait = np.zeros(cap, np.int64)
        G = self.G
        n = int(G[fl.G_WLEN])
        if n:
            wait[:n] = self.wait[(G[fl.G_WHEAD] + np.arange(n)) % old]
        G[fl.G_WHEAD] = 0
        free = self.slots[:G[fl.G_NSLOT]]
        slots = np.concatenate([np.arange(cap - 1, old - 1, -1), free]).astype(np.int64)
        G[fl.G_NSLOT] = len(slots)
        self.R, self.T, self.run_q, self.wait, self.slots, self.cap = R, T, run_q, wait, slots, cap
        self.LP, self.LA = LP, LA

    def _alloc_buffers(self) -> None:
        """Output buffers: a nominal size plus the room one more iteration may need, so the
        loop always fits at least one step between drains (the compiled loop has no bounds
        checks: `room` is what keeps it inside)."""
        sc = self.sc
        maxb, maxtok = sc.scheduler.max_batch_size, sc.scheduler.max_num_tokens
        rows, pages = maxb + 1, (maxb + 1) * self.width
        d = 1 if self.detail else 0
        self.room = np.array([1, rows, d * pages, d * pages, d * (maxtok + maxb),
                              d * (4 * sc.cache.num_blocks + 2), rows, maxb + 2], np.int64)
        nr = _STEPS * 16
        self.S = np.zeros((_STEPS + 1, fl.NS), np.int64)
        # W and E are indexed [record, field] but stored field by field (Fortran order): each
        # trace column is then one contiguous slice (sim/fast/columns.chunk_of), not a strided
        # gather over the whole buffer (~0.2 s of the main thread per 10k requests, traced)
        self.W = np.zeros((nr + rows, fl.NW), np.int64, order="F")
        self.PG = np.zeros(d * nr * 48 + pages + 1, np.int32)
        self.AL = np.zeros_like(self.PG)
        self.TK = np.zeros(d * nr * 4 + maxtok + maxb + 1, np.int32)
        self.E = np.zeros((d * nr * 2 + self.room[fl.K_E] + 1, 8), np.int64, order="F")
        self.D = np.zeros((4 * _ARRIVALS + 2 * self.cap + rows, fl.ND), np.int64)
        self.V = np.zeros((256 + maxb + 2, 5), np.int64)
        self.K = np.zeros(fl.NK, np.int64)

    # -- arrivals ---------------------------------------------------------------------------
    def _refill(self) -> None:
        """Pull specs until one arrives after `now` (so the loop knows the next arrival)."""
        G = self.G
        keep = self.AR[G[fl.G_AI]:G[fl.G_AN]]
        new: list[tuple[RequestSpec, np.ndarray]] = []
        last = int(keep[-1, 1]) if len(keep) else -1
        # a batch of specs, and at least up to the first one after now
        while len(new) < _ARRIVALS or last <= G[fl.G_NOW]:
            spec = next(self.specs, None)
            if spec is None:
                G[fl.G_MORE] = 0
                break
            # the reference engine's draws, in its order (Processor.arrive)
            outs = self.tok_rng.integers(0, 32000, size=spec.output_len + self.slack,
                                         dtype=np.int32)
            self.acc.request_scale()  # consumed as the reference does (no effect without MTP)
            new.append((spec, outs))
            last = spec.arrival_ns
        need = sum(len(sp.prompt) + len(o) for sp, o in new)
        if self.tok_end + need > len(self.toks):
            self._compact(need)  # before any new offset is handed out
        rows = [self._arrival(sp, o) for sp, o in new]
        self.AR = np.concatenate([self.AR[G[fl.G_AI]:G[fl.G_AN]],
                                  np.array(rows, np.int64).reshape(-1, 6)])
        G[fl.G_AI], G[fl.G_AN] = 0, len(self.AR)
        if len(self.AR) + self.room[fl.K_D] > len(self.D):  # see the loop's room check
            self.D = np.zeros((2 * len(self.AR) + self.room[fl.K_D], fl.ND), np.int64)
        live = self.cap - int(G[fl.G_NSLOT]) + len(self.AR)
        if live > self.cap:
            self._grow(2 * live)

    def _arrival(self, spec: RequestSpec, outs: np.ndarray) -> tuple[int, ...]:
        """AR row: rid, arrival, P, O, token offset, rejected (Processor._unservable)."""
        sc = self.sc
        P, n_out = len(spec.prompt), spec.output_len
        off = self.tok_end
        self.toks[off:off + P] = np.asarray(spec.prompt, np.int32)
        self.toks[off + P:off + P + len(outs)] = outs
        self.tok_end = off + P + len(outs)
        need = -(-min(P + n_out, sc.limits.max_seq_len) // self.B)
        rejected = (P >= sc.limits.max_seq_len or need > self.num_usable
                    or (not sc.scheduler.chunk_size and P > sc.scheduler.max_num_tokens))
        return spec.rid, spec.arrival_ns, P, n_out, off, int(rejected)

    def _compact(self, need: int) -> None:
        """Drop the tokens of emitted requests; live and pending ones move to a fresh buffer."""
        G = self.G
        free = np.zeros(self.cap, bool)
        free[self.slots[:G[fl.G_NSLOT]]] = True
        owners = [(self.R, int(s), fl.F_TOK, fl.F_P, fl.F_O) for s in np.flatnonzero(~free)]
        owners += [(self.AR, i, 4, 2, 3) for i in range(int(G[fl.G_AI]), int(G[fl.G_AN]))]
        total = sum(int(a[i, p] + a[i, o]) + self.slack for a, i, _, p, o in owners) + need
        out = np.zeros(max(_TOKENS, 2 * total), np.int32)
        end = 0
        for a, i, col, p, o in owners:
            n = int(a[i, p] + a[i, o]) + self.slack
            start = int(a[i, col])
            out[end:end + n] = self.toks[start:start + n]
            a[i, col] = end
            end += n
        self.toks, self.tok_end = out, end

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            G = self.G
            if G[fl.G_MORE] and (G[fl.G_AI] == G[fl.G_AN]
                                 or self.AR[G[fl.G_AN] - 1, 1] <= G[fl.G_NOW]):
                self._refill()
            code = loop(self.G, self.K, self.cfg, self.room, self.R, self.T, self.LP, self.LA,
                        self.run_q, self.wait, self.pool, self.slots, self.flat, self.toks,
                        self.seen, self.AR, self.S, self.W, self.PG, self.AL, self.TK, self.E,
                        self.D, self.V)
            self._drain(full=code != fl.NEED_ARRIVALS)
            if code == fl.DONE:
                break
        self._finish_all()

    @property
    def step(self) -> int:
        return int(self.G[fl.G_STEP])

    @property
    def now(self) -> int:
        return int(self.G[fl.G_NOW])

    def _drain(self, full: bool) -> None:
        """Requests and violations at every return (token compaction may follow); steps, rows
        and events only once the buffers are full or the run is over (big batches)."""
        K = self.K
        self.violations.extend(violations_of(self, self.V[:K[fl.K_V]]))
        self.on_chunk(chunk_of(self, self.D[:K[fl.K_D]], only_requests=not full))
        K[fl.K_D] = K[fl.K_V] = 0
        if full:
            K[:] = 0
            # the chunk's list columns are views of these, and (delta: the trace writer alone
            # takes them) its rows' and events' columns too: hand them over instead of having
            # the writer copy ~1.5 GB per 10k requests, and take back ones it let go of
            self.PG, self.AL, self.TK = (r.swap(a) for r, a in zip(
                self.recycle[:3], (self.PG, self.AL, self.TK), strict=True))
            if self.delta:
                self.W, self.E = self.recycle[3].swap(self.W), self.recycle[4].swap(self.E)

    def _finish_all(self) -> None:
        """Processor.finish_all: requests still live are emitted unfinished, by request id."""
        G = self.G
        free = np.zeros(self.cap, bool)
        free[self.slots[:G[fl.G_NSLOT]]] = True
        live = np.flatnonzero(~free)  # arrived, never freed (specs not yet arrived never will)
        if not len(live):
            return
        R = self.R[live]
        D = np.zeros((len(live), fl.ND), np.int64)
        for d, f in ((fl.D_RID, fl.F_RID), (fl.D_ARR, fl.F_ARR), (fl.D_P, fl.F_P),
                     (fl.D_O, fl.F_O), (fl.D_TOK, fl.F_TOK), (fl.D_NHOST, fl.F_NHOST)):
            D[:, d] = R[:, f]
        D[:, fl.D_FIRST], D[:, fl.D_FIN] = R[:, fl.F_FIRST], -1
        D[:, fl.D_REASON], D[:, fl.D_NPRE] = 0, R[:, fl.F_NPRE]
        D[:, fl.D_GSTEPS] = R[:, fl.F_GSTEPS]
        D = D[np.argsort(D[:, fl.D_RID], kind="stable")]
        self.on_chunk(chunk_of(self, D, only_requests=True))
