"""Turn a scheduled batch into the step's RowRecords (engine metadata + device truth).

The device-side truth is advanced here, at launch: the device knows how many drafts a step
accepts before the host does (the host learns it when it processes the step).
"""

from __future__ import annotations

from sim.executor.metadata import MetadataBuilder
from sim.request import Request
from sim.sched.scheduler import Batch
from sim.spec import Acceptance
from sim.trace.records import RowRecord


def build_rows(step: int, batch: Batch, md: MetadataBuilder, acc: Acceptance,
               max_pos: int, detail: bool = True) -> list[RowRecord]:
    """The step's rows. `detail=False` (nobody reads pages or tokens: no trace, no checker)
    leaves the list columns empty; lengths and the device truth are the same either way."""
    reqs: list[Request] = []
    lens: list[dict] = []
    meta: list[tuple[str, int, int]] = []  # (phase, q_len, draft_len)
    for r, start, chunk in batch.ctx:
        reqs.append(r)
        lens.append(md.ctx_lengths(start, chunk))
        meta.append(("ctx", chunk, 0))
    for r, d in batch.gen:
        reqs.append(r)
        lens.append(md.gen_lengths(r, 1 + d))
        meta.append(("gen", 1 + d, d))
    nbs = md.graph_nbs(reqs, [x["nb"] for x in lens], not batch.ctx)
    for ln, nb in zip(lens, nbs, strict=True):
        ln["nb"] = nb
    if detail:
        pages, indptr = md.page_rows(reqs, nbs)
    else:
        pages, indptr = [()] * len(reqs), [0] * len(reqs)
    return [_row(step, i, r, lens[i], meta[i], pages[i], indptr[i], md, acc, max_pos, detail)
            for i, r in enumerate(reqs)]


def _row(step: int, i: int, r: Request, ln: dict, meta: tuple[str, int, int],
         pages: tuple[int, ...], indptr: int, md: MetadataBuilder, acc: Acceptance,
         max_pos: int, detail: bool) -> RowRecord:
    phase, q, d = meta
    lpl, kv_len = md.kernel_len(ln["L"], ln["nb"])
    c = r.committed
    n = ln["nwrite"] if phase == "gen" else q
    seq = r.tokens
    if phase == "gen":
        a = acc.accepted(d, r.gen_steps, r.accept_scale)
        # slot c holds the newest known token; drafts i <= a are right, the rest are not.
        toks = tuple(int(seq[c + j]) if j <= a else int(seq[c + j]) + 1
                     for j in range(n)) if detail else ()
        new = 1 + a
        first = bool(r.inflight) and r.inflight[-1] == r.last_ctx_step
    else:
        a, new, first = -1, q, False
        toks = tuple(seq[c:c + q].tolist()) if detail else ()
    rec = RowRecord(
        step=step, row=i, request=r.rid, phase=phase, q_len=q, draft_len=d,
        first_gen=first, prev_in_flight=bool(r.inflight),
        pages=pages, kv_indptr=indptr, last_page_len=lpl, kv_len=kv_len,
        append_pos=tuple(range(ln["append"], ln["append"] + n)) if detail else (),
        rope_pos=tuple(range(c, c + q)) if detail else (),
        cached_host=ln["cached_host"], kv_len_host=ln["kv_len_host"],
        committed=c, alloc=tuple(md.kv.blocks[r.rid]) if detail else (),
        reserved=md.kv.reserved[r.rid],
        shared_blocks=md.kv.shared[r.rid], tokens=toks, accepted=a, new_tokens=new,
        prev_new_tokens=r.prev_new_tokens if phase == "gen" else -1, max_pos=max_pos)
    r.committed = c + new
    r.prev_new_tokens = new if phase == "gen" else 1  # a context forward yields one token
    if phase == "gen":
        r.gen_steps += 1
        r.accepted_drafts += a
        r.proposed_drafts += d
    return rec
