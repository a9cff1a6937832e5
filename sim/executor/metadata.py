"""Attention metadata exactly as the profile's engine builds it, next to the device truth.

Generation row r of width W with its previous step in flight (docs/design.md §3.4):

    host:   cached_host = N-1+W   kv_len_host = N-1+2W     (assumes every draft was accepted)
    device: committed   = N-1+new_tokens_prev              offset = new_tokens_prev - W
    first generation step: the context committed exactly P, so the fix uses cached = P.
"""

from __future__ import annotations

from itertools import accumulate

from sim.kv import KVManager
from sim.profiles import Switches
from sim.request import Request


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MetadataBuilder:
    def __init__(self, sw: Switches, kv: KVManager, B: int, extra: int, max_pos: int,
                 buffer_len: int) -> None:
        self.sw, self.kv, self.B, self.extra, self.max_pos = sw, kv, B, extra, max_pos
        # FlashInfer's flat kv_indices buffer: torch.empty in the engine, never cleared, so a
        # row that claims more pages than it copied reads what earlier steps left there.
        self.flat: list[int] = [-1] * buffer_len
        self.plans: dict[object, int] = {}
        # CUDA-graph capture of a pure-generation batch: request ids -> (nbs, page rows, indptr)
        self.graph: tuple[tuple[int, ...], list[int], list[tuple[int, ...]],
                          list[int]] | None = None

    def graph_nbs(self, reqs: list[Request], nbs: list[int], gen_only: bool) -> list[int]:
        """Page counts the kernel sees: captured ones when a stale graph is replayed."""
        if self.sw.refresh_graph_pages or not gen_only:
            return nbs
        key = tuple(r.rid for r in reqs)
        if self.graph is not None and self.graph[0] == key:
            return self.graph[1]
        self.graph = (key, nbs, [], [])
        return nbs

    def host_view(self, r: Request, W: int) -> tuple[int, int]:
        """(cached_host, device offset) for a generation row."""
        if not r.inflight:
            return r.n_host - 1, 0
        if r.inflight[-1] == r.last_ctx_step and self.sw.first_gen_prompt_boundary:
            return r.prefill_len, 0
        return r.n_host - 1 + W, r.prev_new_tokens - W

    def gen_lengths(self, r: Request, W: int) -> dict:
        cached_host, offset = self.host_view(r, W)
        dev = cached_host + offset
        assert dev == r.committed, (
            f"req {r.rid}: host {cached_host} + offset {offset} != committed {r.committed}; "
            "this is a bug in the overlap model")
        base = dev if self.sw.overlap_correction else cached_host
        L = base + W
        kv_len_host = cached_host + W
        logical = _cdiv(kv_len_host, self.B)
        A = len(self.kv.blocks[r.rid])
        nb = {"reserved": max(logical, A), "logical-host": logical,
              "logical-device": _cdiv(L, self.B)}[self.sw.gen_table_width]
        return {"cached_host": cached_host, "kv_len_host": kv_len_host, "L": L, "nb": nb,
                "append": base, "nwrite": W + (self.extra if W > 1 else 0)}

    def ctx_lengths(self, start: int, chunk: int) -> dict:
        L = start + chunk
        return {"cached_host": start, "kv_len_host": L, "L": L, "nb": _cdiv(L, self.B),
                "append": start, "nwrite": chunk}

    def page_rows(self, reqs: list[Request],
                  nbs: list[int]) -> tuple[list[tuple[int, ...]], list[int]]:
        """Per-row page lists as the kernel sees them, and kv_indptr."""
        g = self.graph
        if g is not None and not self.sw.refresh_graph_pages and g[0] == tuple(
                r.rid for r in reqs):
            if g[2]:  # replaying the captured graph: its kv_indices were never refreshed
                return g[2], g[3]
            rows, indptr = self._page_rows(reqs, nbs)
            self.graph = (g[0], g[1], rows, indptr)
            return rows, indptr
        return self._page_rows(reqs, nbs)

    def _page_rows(self, reqs: list[Request],
                   nbs: list[int]) -> tuple[list[tuple[int, ...]], list[int]]:
        if self.sw.backend == "xqa":  # block table: one row each, unallocated = -1
            rows = []
            for r, nb in zip(reqs, nbs, strict=True):
                own = self.kv.blocks[r.rid][:nb]
                rows.append(tuple(own) + (-1,) * (nb - len(own)))
            return rows, [0] * len(reqs)
        indptr = list(accumulate(nbs, initial=0))
        if indptr[-1] > len(self.flat):
            self.flat.extend([-1] * indptr[-1])
        pos = 0
        for r, nb in zip(reqs, nbs, strict=True):  # get_batch_cache_indices_flat truncates
            own = self.kv.blocks[r.rid][:nb]
            self.flat[pos:pos + len(own)] = own
            pos += len(own)
        flat = self.flat
        rows = [tuple(flat[indptr[i]:indptr[i + 1]]) for i in range(len(reqs))]
        return rows, indptr[:-1]

    def kernel_len(self, L: int, nb: int) -> tuple[int, int]:
        """(last_page_len, kv_len the kernel uses)."""
        lpl = L - (_cdiv(L, self.B) - 1) * self.B
        if self.sw.backend == "fa2":  # FA2 recomputes the length from the page count
            return lpl, (nb - 1) * self.B + lpl
        return lpl, L

    def plan(self, gen_width: int, batch: int) -> tuple[int, int, int]:
        """(plan_q_len, plan_batch, plan_cache_size) of the decode plan this step uses."""
        key = {"fresh": None, "no-width": "decode", "per-batch": ("decode", batch, gen_width)}[
            self.sw.plan_key]
        if key is None or gen_width == 0:  # fresh plans, or no decode rows: no decode plan
            return -1, batch, max(1, len(self.plans))
        if key in self.plans:
            return self.plans[key], batch, len(self.plans)
        self.plans[key] = gen_width
        return -1, batch, len(self.plans)
