"""A steady step's device work as one CUDA graph: events, page checks, content, append,
attention, reference, token errors.

Why: at batch 64 x kv 2k the step's kernels take ~0.15 ms of device time, and the host took
0.6-1.4 ms to queue them eagerly (~13 launches, FlashInfer's Python
plan() and run(), and the Python between them): the replay was host-bound at 4-8x the kernels'
time. Here such a step costs the host a copy in, one graph launch and a copy out of its results.

Which steps: the steady state of a speculative-decoding trace, one FA2 launch over every row
with one query width W (verify rows), content and truth at the same positions, the reference one
batched group (`refgroups.RefGroup.identity`), no prefix fills, no RoPE overrun, no stale plan, no
slot copies among the block events. `prepare` stages such a step's inputs one after the other
(`block`), so the step's copy into the static buffers is two copies (the chunk's int64 and int32
twins). The variable-length ones (the pages the events touch, the pages the appends target, the
poisoned rows) are padded to capacities that only grow within a replay (`HostState.graph_caps`),
so a replay captures a few graphs, not one per step.

With the incremental page watch (`watch.IncrementalWatch`) the graph also holds the block events'
poison and the watch's checks (`poolk.graph_events`, `graph_pre`, `graph_post`, the same
`_page_sum` and per-page steps as the eager kernels, counts read from the step's block). One
check moves: the previous step's look at the pages this step's events touch runs at the start
of this step's graph (before the events, as before); an eager step after a graph step does it
itself (`IncrementalWatch.before_events`). With the full watch the events and the checksum stay
eager around the graph.

What is the same as the eager step: every kernel (the content and reference Triton kernels,
FlashInfer's append and FA2 paged prefill), its inputs and its order; the FA2 kernel is planned
per step in FlashInfer's CUDA-graph mode (scheduler.cuh `PrefillPlan`: a fixed grid, always
split over the kv, `uniform_q_len` tiles), the way SGLang and vLLM replay it. The plan is made
by the preparation (`gpu_backend.fa2plan`, FlashInfer's planner ported) and staged in the block;
the wrapper's int workspace is that field of the int32 twin, so the graph's conversion of the
block writes the plan where the kernels read it: the loop calls no planner a step.
A key's first step plans through FlashInfer's own plan() and checks the port against it (plan
info and bytes); a key whose plan differs runs eagerly (`stats()['plan_mismatches']`).
The reference gets the truth store's span as its key bound instead of the step's longest row:
it stops at each row's own last limit either way (`refattn._attend_kernel`), so the bits match.
What differs: FA2's split-kv merge order (rounding within the tolerance), and FlashInfer's
Python checks in plan()/run(), which run once per shape at capture instead of every step.

A step that FlashInfer's checks refuse at capture, or whose page counts the planner would
refuse, runs eagerly (`stats()['eager_fallbacks']`, or no key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_backend import fa2plan, rawcopy
from gpu_backend.boxed import Arena, Boxed
from gpu_backend.layout import StepBatch, launch_runs, stale_plan
from gpu_backend.staging import ALIGN, StepArrays

# the block's fields in order: (field, the step's array staged for it, how the kernels read it:
# "f" float64, "i" int64, "w" int32); "g0_" is the reference's one group (`refgroups.RefGroup`).
# `blockpack._pack` writes the same layout in its compiled pass (tests/unit/test_blockpack.py
# holds the two to the same words)
_FIELDS = (("app_tok_m", "app_tok_m", "f"), ("app_pos_m", "app_pos_m", "f"),
           ("tslot", "tslot", "i"), ("true_pos", "true_pos", "i"), ("app_row", "app_row", "w"),
           ("append_pos", "append_pos", "w"), ("qo", "run0_qo", "w"),
           ("kv_indptr", "kv_indptr", "w"), ("last_page_len", "last_page_len", "w"),
           ("slots", "g0_slots", "i"), ("limit", "g0_limit", "i"),
           ("params", "gr_params", "i"), ("touched", "gr_touched", "i"),
           ("wpages", "gr_wpages", "i"), ("prows", "gr_prows", "i"),
           ("plan", "gr_plan", "w"), ("kv_indices", "kv_indices", "w"))
# a graph step's results are copied into the loop's arena (`Boxed`: one copy a step, no tensor
# made for them; a read-back copies the arena's span home at once)
ARENA_STEPS = 24  # steps' results an arena holds (a read-back takes `driver.EARLY`)

# gr_params: the counts and step numbers the graph's page checks read on the device
# (poolk's PARAMS: touched pages, target pages, targets to check, step, previous step, rows)
_PARAMS = 8

# gr_plan: FA2's plan, the int workspace's bytes as int32 words (`fa2plan.image`), each staged as
# an int64 word
# (rows, query width W, capacities: kv_indices, touched pages, target pages, poisoned rows,
# the plan's words)
Key = tuple[int, int, int, int, int, int, int]


def offsets(key: Key) -> dict[str, tuple[int, int]]:
    """Field -> (offset, length) in words of a block of graph `key`: the fields one after the
    other, each aligned as `staging.Chunk.add` aligns an array."""
    R, W, cap_p, cap_t, cap_w, cap_r, plan = key
    sizes = {"qo": R + 1, "kv_indptr": R + 1, "last_page_len": R, "slots": R, "limit": R * W,
             "params": _PARAMS, "touched": cap_t, "wpages": cap_w, "prows": cap_r,
             "plan": plan, "kv_indices": cap_p}
    out, at = {}, 0
    for name, _, _ in _FIELDS:
        n = sizes.get(name, R * W)
        out[name] = (at, n)
        at += n + (-n % ALIGN)
    return out


def _cap(n: int, floor: int) -> int:
    """The power of two at or above max(n, floor)."""
    return 1 << (max(n, floor, 1) - 1).bit_length()


def block(caps: dict[tuple[int, int], Key], b: StepBatch, arrays: dict[str, np.ndarray],
          ops: list[Any], wpages: np.ndarray, wcheck: int, prev: int, ok: bool,
          groups: list[Any], planner: fa2plan.Planner) -> Key | None:
    """If step b can replay as a graph, add its padded arrays, order its arrays so that the
    graph's fields are staged first, one after the other (the block `span` names), and return
    its graph key; else None. `caps`: the replay's capacities so far by (rows, W), grown here.
    `ok`: no prefix fill, no RoPE overrun, truth positions == engine's, queries == appends;
    `groups`: the reference's (`refgroups.RefGroup`); `prev`: the step prepared before b;
    `planner`: the replay's device and attention shape, for FA2's plan (`fa2plan`)."""
    R = b.num_rows
    if (not candidate(b, ok, groups) or stale_plan(b, 0, R, "verify") is not None
            or any(kind != "nan" for kind, *_ in ops)):
        return None
    W = int(b.q_len[0])
    lay = fa2plan.layout(planner, R, W)
    plan = fa2plan.image(lay, b.kv_indptr) if (b.q_len == W).all() else None
    if plan is None:
        return None  # rows of other widths, or page counts FlashInfer's planner refuses
    touched = arrays.get("touched", np.zeros(0, dtype=np.int64))  # distinct, as the eager path's
    prows = np.concatenate([arrays[f"ev{a}"] for _, a, *_ in ops]) if ops else \
        np.zeros(0, dtype=np.int64)
    have = caps.get((R, W), (R, W, 0, 0, 0, 0, 0))
    # floors: a few growths at most over a replay (each one captures a graph)
    key = caps[(R, W)] = (R, W, max(have[2], _cap(len(b.kv_indices), 1)),
                          max(have[3], _cap(len(touched), 4 * R)),
                          max(have[4], _cap(len(wpages), 4 * R)),
                          max(have[5], _cap(len(prows), 16 * R)), lay.words)
    arrays["gr_plan"] = plan
    arrays["gr_params"] = np.array([len(touched), len(wpages), wcheck, b.step, prev, len(prows),
                                    0, 0], dtype=np.int64)
    for name, a, cap in (("gr_touched", touched, key[3]), ("gr_wpages", wpages, key[4]),
                         ("gr_prows", prows, key[5])):
        arrays[name] = np.zeros(cap, dtype=np.int64)
        arrays[name][: len(a)] = a
    first = {name: arrays.pop(name) for _, name, _ in _FIELDS}
    rest = dict(arrays)
    arrays.clear()
    arrays |= first | rest
    return key


def candidate(b: StepBatch, ok: bool, groups: list[Any]) -> bool:
    """Whether step b has the one shape a graph replays (`block` checks the rest): FA2, one
    verify launch over every row, the reference's one identity group; `ok` as `block`'s."""
    if b.backend != "fa2" or not ok or len(groups) != 1 or not groups[0].identity \
            or groups[0].pre != "g0_":
        return False
    runs = launch_runs(b)
    return len(runs) == 1 and runs[0][2] == "verify"


def span(dv: StepArrays) -> None:
    """Name the staged block `gblk` (int64 words): from the first field to the end of the
    last."""
    (_, _, first), (shape, _, last) = dv.slots["app_tok_m"], dv.slots["kv_indices"]
    dv.slots["gblk"] = ((last + shape[0] - first,), (1,), first)


@dataclass
class _Entry:
    """One graph: static input buffers (int64 and int32 twins), the FA2 wrapper planned over
    views of them, the captured graph and its output buffer (token errors, moved targets)."""
    g64: torch.Tensor
    g32: torch.Tensor
    views: dict[str, torch.Tensor]
    wrapper: Any
    plan: fa2plan.Layout
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None


class StepGraphs:
    """The graphs of one replay (its pool, truth store and watch are captured by address)."""

    def __init__(self, kernels: Any, pool: Any, truth: Any, hq: int, watch: Any):
        from gpu_backend.watch import IncrementalWatch

        self.k, self.pool, self.truth, self.hq, self.watch = kernels, pool, truth, hq, watch
        self.checks = isinstance(watch, IncrementalWatch)  # events and checks in the graph
        m = pool.data
        self.planner = fa2plan.Planner(fa2plan.Device.of(m.device), hq, int(m.shape[3]),
                                       int(m.shape[4]), pool.page_size, m.element_size())
        self.entries: dict[Key, _Entry] = {}
        self.mismatched: set[Key] = set()  # keys whose first plan differed from FlashInfer's
        self.pool_handle = torch.cuda.graph_pool_handle()
        # the replay's stream, once: Event.record() without one builds it every call (~10 µs
        # of a step's host on the H200)
        self.stream = torch.cuda.current_stream()
        self.replays = self.captures = self.fallbacks = 0
        self.arena = Arena(ARENA_STEPS)  # where graph steps' results go

    def stats(self) -> dict[str, int]:
        return {"graphs": len(self.entries), "graph_replays": self.replays,
                "graph_captures": self.captures, "eager_fallbacks": self.fallbacks,
                "plan_mismatches": len(self.mismatched)}

    def run(self, p: Any) -> Boxed | tuple[torch.Tensor, torch.Tensor | None] | None:
        """Run step p: its results, or None: run it eagerly, events and all (its plan does not
        fit its graph). The results: per-token errors [2, nnz_q] fp32 as
        `oracle.token_errors`, then its targets' moved flags [len(p.wpages)] bool with the
        incremental watch, in the loop's arena (with the incremental watch) or as (errors,
        None)."""
        key: Key = p.graph
        if key in self.mismatched:
            self.fallbacks += 1
            return None
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = self._entry(key)
        buf, off, words = p.dv.span("gblk")  # the step's block in its chunk's device copy
        if words > e.g64.numel():
            raise ValueError(f"step {p.b.step}: a block of {words} words for a graph of "
                             f"{e.g64.numel()}")
        # the int32 twin is made in the graph (`_body`); by address: `rawcopy`'s why
        rawcopy.d2d(e.g64.data_ptr(), buf.data_ptr() + 8 * off, 8 * words, self.stream)
        self.k._hold_plan_cache(p.b.plan_cache_size)
        if e.graph is None:
            if not self._first(e, p, key):
                del self.entries[key]  # FlashInfer's checks refused the step: eager reports it
                self.fallbacks += 1
                return None
            self.captures += 1
        else:
            e.graph.replay()  # its plan is in the block: `_body`'s conversion writes it
            self.replays += 1
        assert e.out is not None
        # the step's own copy: the next replay rewrites e.out. Measured no better on the H200:
        # a pinned host copy a step, which the read-back need not gather (52-58 µs a step with
        # the views against 28-40); the graph copying its results into a ring slot
        # itself (three more kernels a step: 0.01-0.02 ms slower a step). One copy
        # of both results, viewed apart: a copy and an allocation cost the loop 13-35 µs a
        # step on the H200's host
        n = p.b.num_tokens  # the layout of `_out`
        w = len(p.wpages) if self.checks else 0
        if self.checks:
            return self.arena.put(e.out, 8 * n + w, n, w, self.stream)
        both = rawcopy.into(torch.empty(8 * n + w, dtype=torch.uint8, device=e.out.device),
                            e.out, 0, self.stream)
        tok = both[: 8 * n].view(torch.float32).view(2, n)
        return tok, both[8 * n:].view(torch.bool) if self.checks else None

    def seal(self) -> None:
        """The steps after a read-back go to a new arena (`readback.send` copies one arena's
        span of steps home at once)."""
        self.arena.seal()

    def _entry(self, key: Key) -> _Entry:
        at = offsets(key)
        size = sum(at["kv_indices"])
        dev = self.pool.data.device
        g64 = torch.zeros(size, dtype=torch.int64, device=dev)
        g32 = torch.zeros(size, dtype=torch.int32, device=dev)
        v = {}
        for (name, _, kind), (o, m) in zip(_FIELDS, at.values(), strict=True):
            src = g64.view(torch.float64) if kind == "f" else g64 if kind == "i" else g32
            v[name] = src[o: o + m]
        v["limit"] = v["limit"].view(key[0], key[1])
        w = self.k.fi.BatchPrefillWithPagedKVCacheWrapper(
            self.k.ws[1], "NHD", use_cuda_graph=True, qo_indptr_buf=v["qo"],
            paged_kv_indptr_buf=v["kv_indptr"], paged_kv_indices_buf=v["kv_indices"],
            paged_kv_last_page_len_buf=v["last_page_len"], backend="fa2")
        # FA2's plan is read from the block (`fa2plan`): no copy of it in the graph, the
        # block's conversion writes it
        w.reset_workspace_buffer(self.k.ws[1], v["plan"].view(torch.uint8))
        return _Entry(g64, g32, v, w, fa2plan.layout(self.planner, key[0], key[1]))

    def ahead(self, p: Any) -> None:
        """Capture the graph of step p's key now, if it has none, without running anything: the
        driver calls this once the step before p is queued, so the host captures while the
        device still works (after the prompts' prefill, its whole step), and p replays the
        graph as any later step does. If FlashInfer's plan() or the capture refuses, nothing is
        kept: p takes the `_first` way (plan, eager, capture) or runs eagerly."""
        key = p.graph
        if key is None or key in self.entries:
            return
        e = self._entry(key)
        if not self._plan_first(e, p, key):
            return
        try:
            e.graph = self._capture(e, key)
        except RuntimeError:
            return
        self.entries[key] = e
        self.captures += 1

    def _first(self, e: _Entry, p: Any, key: Key) -> bool:
        """A key's first step when `ahead` did not capture it: planned, run eagerly over the
        static buffers (this step's result, and the warm-up of every kernel the capture then
        records), then captured for the steps after it. False if plan() refused the step
        (nothing ran: the eager step reports it)."""
        if not self._plan_first(e, p, key):
            return False
        self._body(e, key)
        e.graph = self._capture(e, key)
        return True

    def _plan_first(self, e: _Entry, p: Any, key: Key) -> bool:
        """Plan step p through FlashInfer's Python plan() (its checks, once per key) and check
        `fa2plan`'s port against it: the plan info, and the bytes FlashInfer's planner left in
        its pinned buffer for the device. False if plan() refused the step or the port differs
        (the key is then kept out: its steps run eagerly)."""
        b, dv, m = p.b, p.dv, self.pool.data
        hkv, d = int(m.shape[3]), int(m.shape[4])
        w = e.wrapper
        try:
            w.plan(dv["run0_qo@host"], dv["kv_indptr@host"], e.views["kv_indices"],
                   dv["last_page_len@host"], self.hq, hkv, d, b.page_size, causal=True,
                   q_data_type=m.dtype, kv_data_type=m.dtype, seq_lens=dv["seq_lens@host"],
                   uniform_q_len=key[1])
        except (ValueError, RuntimeError):
            return False
        # the planner wrote its pinned buffer before returning (the device's copy of it is async)
        theirs = w._pin_memory_int_workspace_buffer.numpy()[: e.plan.nbytes]
        if not fa2plan.agrees(e.plan, list(w._plan_info), theirs, b.kv_indptr):
            self.mismatched.add(key)
            return False
        e.out = self._out(key, b.num_tokens)
        return True

    def _out(self, key: Key, n: int) -> torch.Tensor:
        """The graph's results as bytes: token errors [2, n] fp32, then moved flags [cap_w]."""
        return torch.empty(8 * n + key[4], dtype=torch.uint8, device=self.pool.data.device)

    def _capture(self, e: _Entry, key: Key) -> torch.cuda.CUDAGraph:
        """The body captured on a side stream (nothing runs: the step's work was done eagerly).
        Not `torch.cuda.graph`, whose device sync, gc.collect() and empty_cache() took a key's
        first step from 1.9 to 12.5 ms on the H200: nothing here needs them (the side stream
        waits for the current one; the graph's memory comes from the replay's own pool)."""
        g = torch.cuda.CUDAGraph()
        side, cur = torch.cuda.Stream(), torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            g.capture_begin(pool=self.pool_handle, capture_error_mode="thread_local")
            try:
                self._body(e, key)
            finally:
                g.capture_end()
        cur.wait_stream(side)
        return g

    def _body(self, e: _Entry, key: Key) -> None:
        """The step's device work over the static buffers, results into e.out: what the driver
        does for an eager step (`driver._apply_events`, the watch, `driver._one_step`)."""
        from gpu_backend import poolk, refattn
        from gpu_backend.oracle import beside, join, unwritten
        from gpu_backend.pool import content_kv_q

        R, W = key[0], key[1]
        pool, m, tr, v, wt = self.pool, self.pool.data, self.truth.kv, e.views, self.watch
        hkv, d = int(m.shape[3]), int(m.shape[4])
        assert e.out is not None
        n = R * W
        # the int32 fields from the step's int64 words, on the device: one host copy a step
        # instead of two (~13 µs of host on the H200); the float64 fields' bits wrap, unread.
        # The plan's field is the wrapper's int workspace (`_entry`): this writes the plan too
        e.g32.copy_(e.g64)
        if self.checks:
            poolk.graph_events(pool.words, pool.rows, v["params"], v["touched"], v["prows"],
                               wt.sums, wt.stamp, wt.flag)
            poolk.graph_pre(pool.words, v["params"], v["touched"], v["wpages"], wt.sums, wt.pre,
                            wt.stamp, wt.flag)
        kv, q = content_kv_q(v["app_tok_m"], v["app_pos_m"], hkv, self.hq, d, m.dtype,
                             truth=(tr, v["tslot"], v["true_pos"]))
        assert q is not None
        side = self.truth.side  # the reference a branch of the graph beside the kernels
        with beside(side):
            ref = refattn.attend(q.view(R, W, self.hq, d), tr, v["slots"], v["limit"],
                                 int(tr.shape[3]))
        self.k.fi.append_paged_kv_cache(kv[0], kv[1], v["app_row"], v["append_pos"], m,
                                        v["kv_indices"], v["kv_indptr"], v["last_page_len"],
                                        kv_layout="NHD")
        out = unwritten(q)
        e.wrapper.run(q, m, out=out)
        if self.checks:
            poolk.graph_post(pool.words, v["params"], v["wpages"], wt.sums, wt.pre,
                             e.out[8 * n:].view(torch.int8))
        join(side)
        refattn.token_errors(out, ref.view(n, self.hq, d),
                             into=e.out[: 8 * n].view(torch.float32).view(2, n))

