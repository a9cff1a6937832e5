"""Serving metrics of one run, from its requests / steps / rows / kv_series tables
(docs/capacity.md). Names follow `<metric>_<stat>_ms`, the names SLOs use (sim/slo.py).

Latencies are over finished requests (finish_reason `length` or `max_seq_len`), in ms, as
`vllm bench serve` defines them: TTFT = first_token − arrival; TPOT = (finish − first_token) /
(outputs − 1) for requests with more than one output; ITL = the gaps between a request's
consecutive deliveries of output tokens (its first token, then each step that committed tokens
to it: with MTP a step delivers several tokens at once, as one streamed chunk does in vLLM),
pooled over requests; E2E = finish − arrival; queueing = first scheduled − arrival (from the rows
table when there is one, else first token − arrival: `queue_source` says which). ITL needs the
rows table (a trace): without it, there are no `itl_*` fields. Statistics: mean, std
(population, as numpy and vLLM), p50/p90/p99 (numpy's linear percentiles). Throughput divides
by the span from the first arrival to the last finish. KV figures are time-weighted over the
step series: each sample holds until the next launch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sim.slo import Target
from sim.trace.records import RequestRecord

STATS = ("mean", "std", "p50", "p90", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue")
Metrics = dict[str, float | int | str]


def _col(t: pa.Table, name: str) -> np.ndarray:
    return t.column(name).to_numpy()


def stats(prefix: str, ms: np.ndarray) -> Metrics:
    """`{prefix}_{mean,std,p50,p90,p99}_ms` of `ms`; NaN when it is empty."""
    if not len(ms):
        return {f"{prefix}_{s}_ms": float("nan") for s in STATS}
    p50, p90, p99 = np.percentile(ms, (50, 90, 99))
    return {f"{prefix}_mean_ms": float(ms.mean()), f"{prefix}_std_ms": float(ms.std()),
            f"{prefix}_p50_ms": float(p50), f"{prefix}_p90_ms": float(p90),
            f"{prefix}_p99_ms": float(p99)}


def _time_weighted(t: np.ndarray, v: np.ndarray, end: int) -> float:
    if len(t) == 0:
        return 0.0
    dt = np.diff(np.append(t, max(end, int(t[-1]))))
    return float((v * dt).sum() / dt.sum()) if dt.sum() > 0 else float(v.mean())


def first_sched_ns(rows: pa.Table, steps: pa.Table) -> dict[int, int]:
    """Request → t_sched_ns of the first step that scheduled one of its rows."""
    first = rows.group_by("request").aggregate([("step", "min")])
    t_sched = dict(zip(_col(steps, "step").tolist(), _col(steps, "t_sched_ns").tolist(),
                       strict=True))
    return {int(r): int(t_sched[int(s)]) for r, s in
            zip(_col(first, "request"), _col(first, "step_min"), strict=True)}


def _finished(requests: pa.Table) -> pa.Table:
    return requests.filter(pc.is_in(requests.column("finish_reason"),
                                    pa.array(["length", "max_seq_len"])))


def request_latencies(requests: pa.Table, first_sched: dict[int, int] | None = None
                      ) -> dict[str, np.ndarray]:
    """Per finished request, in ms: ttft, tpot (requests with > 1 output only), e2e, queue."""
    done = _finished(requests)
    arr, first, fin = (_col(done, c).astype(np.int64)
                       for c in ("arrival_ns", "first_token_ns", "finish_ns"))
    n_out = pc.list_value_length(done.column("output_tokens")).to_numpy(zero_copy_only=False)
    multi = n_out > 1
    tpot = (fin[multi] - first[multi]) / (n_out[multi] - 1) / 1e6
    if first_sched is not None:
        sched = np.array([first_sched.get(int(r), f) for r, f in
                          zip(_col(done, "request"), first, strict=True)], dtype=np.int64)
    else:
        sched = first
    tpot_all = np.zeros(len(done))
    tpot_all[multi] = tpot
    return {"ttft": (first - arr) / 1e6, "tpot": tpot, "tpot_all": tpot_all,
            "e2e": (fin - arr) / 1e6, "queue": (sched - arr) / 1e6}


def inter_token_latencies(requests: pa.Table, rows: pa.Table, steps: pa.Table) -> np.ndarray:
    """ITL in ms, pooled over finished requests: the gaps between a request's consecutive
    deliveries, its first token and then every gen row that committed tokens (at the end of its
    step on the device, when the host receives them) up to its finish."""
    done = _finished(requests)
    rid = _col(done, "request").astype(np.int64)
    order = np.argsort(rid)
    rid = rid[order]
    first = _col(done, "first_token_ns").astype(np.int64)[order]
    fin = _col(done, "finish_ns").astype(np.int64)[order]
    gen = rows.filter(pc.and_(pc.equal(rows.column("phase"), "gen"),
                              pc.greater(rows.column("new_tokens"), 0)))
    req, t = _col(gen, "request").astype(np.int64), _at(steps, _col(gen, "step"))
    k = np.clip(np.searchsorted(rid, req), 0, max(len(rid) - 1, 0))
    known = (rid[k] == req) if len(rid) else np.zeros(len(req), bool)
    keep = known & (t >= 0) & (t > first[k]) & (t <= fin[k])
    req, t = np.concatenate([rid, req[keep]]), np.concatenate([first, t[keep]])
    pairs = np.unique(np.stack([req, t], axis=1), axis=0)  # sorted by request, then time
    same = pairs[1:, 0] == pairs[:-1, 0]
    return (np.diff(pairs[:, 1])[same] / 1e6).astype(np.float64)


def _at(steps: pa.Table, step: np.ndarray) -> np.ndarray:
    """t_dev_end_ns of each of `step`, −1 for a step the table does not have."""
    ids, t_end = _col(steps, "step").astype(np.int64), _col(steps, "t_dev_end_ns")
    if not len(ids):
        return np.full(len(step), -1, np.int64)
    order = np.argsort(ids)
    i = order[np.clip(np.searchsorted(ids, step, sorter=order), 0, len(ids) - 1)]
    return np.where(ids[i] == step, t_end[i], -1).astype(np.int64)


def compute_metrics(requests: pa.Table, steps: pa.Table, kv_series: pa.Table | None = None, *,
                    num_blocks: int = 0, rows: pa.Table | None = None,
                    slo: Sequence[Target] = ()) -> Metrics:
    """All metrics of one run as a flat dict (one sweep row). `kv_series` defaults to the steps'
    occupancy columns (no draft headroom then); `num_blocks` > 0 adds utilization fractions;
    `rows` adds ITL and the queueing delay to the first scheduled step; `slo` adds goodput,
    attainment and whether every target is met (without it, nothing is claimed about SLOs)."""
    first, lat = None, {}
    if rows is not None and rows.num_rows:
        first = first_sched_ns(rows, steps)
        lat["itl"] = inter_token_latencies(requests, rows, steps)
    lat = request_latencies(requests, first) | lat
    m: Metrics = {"requests": requests.num_rows, "finished": len(lat["e2e"]),
                  "rejected": int(pc.sum(pc.equal(requests.column("finish_reason"),
                                                  "rejected")).as_py() or 0)}
    for name in LATENCIES:
        if name in lat:  # ITL only where the rows table is (a trace)
            m |= stats(name, lat[name])
    m["queue_source"] = "first_scheduled" if first is not None else "first_token"
    m |= _throughput(requests)
    if slo:
        m |= _goodput(lat, slo, m)
    m |= _kv(steps, kv_series, num_blocks)
    m |= _tokens(requests)
    return m


def _throughput(requests: pa.Table) -> Metrics:
    fin = _col(requests, "finish_ns")
    span_ns = int(fin.max() - _col(requests, "arrival_ns").min()) if requests.num_rows else 0
    span = span_ns / 1e9 if span_ns > 0 else float("nan")
    admitted = requests.filter(pc.not_equal(requests.column("finish_reason"), "rejected"))
    out_tok = int(pc.sum(pc.list_value_length(requests.column("output_tokens"))).as_py() or 0)
    in_tok = int(pc.sum(admitted.column("prompt_len")).as_py() or 0)
    finished = len(_finished(requests))
    return {"duration_s": span, "input_tokens": in_tok, "output_tokens": out_tok,
            "throughput_rps": finished / span, "output_tps": out_tok / span,
            "total_tps": (in_tok + out_tok) / span}


def _goodput(lat: dict[str, np.ndarray], slo: Sequence[Target], m: Metrics) -> Metrics:
    """Goodput as `vllm bench serve --goodput` counts it: finished requests whose own TTFT, TPOT
    and E2E are each within the bound of an SLO on that metric (ITL, a property of a request's
    gaps, bounds the run's statistic only). `slo_met`: every target holds for the run."""
    ok = np.ones(len(lat["e2e"]), dtype=bool)
    for t in slo:
        if t.metric in ("ttft", "e2e"):
            ok &= lat[t.metric] <= t.ms
        elif t.metric == "tpot":
            ok &= lat["tpot_all"] <= t.ms
    n, span = int(m["requests"]), float(m["duration_s"])
    return {"goodput_rps": int(ok.sum()) / span,
            "slo_attainment": float(ok.sum() / n) if n else float("nan"),
            "slo_met": all(t.met(m) for t in slo)}


def _kv(steps: pa.Table, kv: pa.Table | None, num_blocks: int) -> Metrics:
    if kv is None:
        t, used = _col(steps, "t_launch_ns"), _col(steps, "blocks_used")
        draft = np.zeros(len(t))
    else:
        t, used, draft = (_col(kv, c) for c in ("t_ns", "blocks_used", "blocks_reserved_draft"))
    end = int(_col(steps, "t_dev_end_ns").max()) if steps.num_rows else 0
    mean_used, mean_draft = _time_weighted(t, used, end), _time_weighted(t, draft, end)
    m: Metrics = {"kv_blocks_mean": mean_used, "kv_blocks_peak": int(used.max(initial=0)),
                  "draft_blocks_mean": mean_draft,
                  "draft_blocks_peak": float(draft.max(initial=0.0)),
                  "draft_frac_of_used": mean_draft / mean_used if mean_used else 0.0}
    if num_blocks > 0:
        m |= {"kv_util_mean": mean_used / num_blocks,
              "kv_util_peak": float(used.max(initial=0)) / num_blocks}
    return m


def _tokens(requests: pa.Table) -> Metrics:
    def total(c: str) -> int:
        return int(pc.sum(requests.column(c)).as_py() or 0)

    admitted = requests.filter(pc.not_equal(requests.column("finish_reason"), "rejected"))
    prompt = int(pc.sum(admitted.column("prompt_len")).as_py() or 0)
    reused = int(pc.sum(admitted.column("reused_tokens")).as_py() or 0)
    steps, acc, prop = total("num_steps"), total("accepted_drafts"), total("proposed_drafts")
    return {"prefix_hit_rate": reused / prompt if prompt else 0.0,
            "acceptance_len": 1 + acc / steps if steps else 0.0,
            "acceptance_rate": acc / prop if prop else 0.0,
            "preemptions": total("num_preemptions")}


def load_trace_tables(trace_dir: str | Path) -> tuple[dict, dict[str, pa.Table]]:
    """(manifest, tables) of a trace directory: the logical tables of docs/trace.md (the reader
    decodes formats 2 and 3's page lists). Raises TraceError naming what is missing or broken."""
    from sim.trace.reader import read_trace

    tr = read_trace(trace_dir)
    return dict(tr.manifest), {n: tr.tables[n] for n in ("steps", "rows", "requests")}


def trace_metrics(trace_dir: str | Path, slo: Sequence[Target] = ()) -> Metrics:
    """Metrics of a trace directory (KV draft headroom recomputed from its rows table)."""
    manifest, t = load_trace_tables(trace_dir)
    model = manifest.get("model", {})
    kv = kv_series_from_rows(t["steps"], t["rows"], int(model.get("tokens_per_block", 1)))
    return compute_metrics(t["requests"], t["steps"], kv,
                           num_blocks=int(model.get("num_blocks", 0)), rows=t["rows"],
                           slo=slo)


def kv_series_from_rows(steps: pa.Table, rows: pa.Table, tokens_per_block: int) -> pa.Table:
    """The kv_series `sim.api.run` returns, rebuilt from a trace: reserved beyond what the step
    commits (reserved − committed − new_tokens, summed per step, in blocks)."""
    spare = pc.subtract(pc.subtract(rows.column("reserved"), rows.column("committed")),
                        rows.column("new_tokens"))
    per = pa.table({"step": rows.column("step"), "spare": spare}).group_by("step").aggregate(
        [("spare", "sum")])
    by_step = dict(zip(_col(per, "step").tolist(), _col(per, "spare_sum").tolist(), strict=True))
    draft = [by_step.get(s, 0) / tokens_per_block for s in _col(steps, "step").tolist()]
    return pa.table({"t_ns": steps.column("t_launch_ns"),
                     "blocks_used": steps.column("blocks_used"),
                     "blocks_reserved_draft": pa.array(draft, pa.float64()),
                     "blocks_cached": steps.column("blocks_cached")})


class LatencyTally:
    """TTFT and TPOT of finished requests, kept as requests finish, for a run's summary (its
    tables may not be collected): 16 bytes per request, nothing else per request."""

    def __init__(self) -> None:
        self.ttft: list[np.ndarray] = []
        self.tpot: list[np.ndarray] = []
        self.finished = 0
        self.first_arrival, self.last_finish = np.iinfo(np.int64).max, -1
        self.pending: list[tuple[int, int, int, int, bool]] = []

    def add(self, arrival: np.ndarray, first: np.ndarray, finish: np.ndarray,
            n_out: np.ndarray, finished: np.ndarray) -> None:
        """One batch of requests (numpy columns; `finished`: a mask, as `_finished`)."""
        if len(arrival):
            self.first_arrival = min(self.first_arrival, int(arrival.min()))
            self.last_finish = max(self.last_finish, int(finish.max()))
        a, f, e, n = arrival[finished], first[finished], finish[finished], n_out[finished]
        self.finished += len(a)
        self.ttft.append((f - a) / 1e6)
        multi = n > 1
        self.tpot.append((e[multi] - f[multi]) / (n[multi] - 1) / 1e6)

    def add_record(self, r: RequestRecord) -> None:
        """One request of the reference engine; batched into `add` when the summary is made."""
        self.pending.append((r.arrival_ns, r.first_token_ns, r.finish_ns, len(r.output_tokens),
                             r.finish_reason in ("length", "max_seq_len")))

    def _flush(self) -> None:
        if self.pending:
            cols = np.array(self.pending, np.int64).T
            self.add(cols[0], cols[1], cols[2], cols[3], cols[4].astype(bool))
            self.pending = []

    def summary(self, output_tokens: int) -> dict[str, float | None]:
        """TTFT/TPOT p50/p99 (ms) and throughput, defined as in `compute_metrics`; None where
        there is nothing to measure (no finished request, none with two outputs): the summary
        goes into the manifest, JSON, which has no NaN."""
        self._flush()
        out: dict[str, float] = {}
        for name, parts in (("ttft", self.ttft), ("tpot", self.tpot)):
            m = stats(name, np.concatenate(parts) if parts else np.array([]))
            out |= {f"{name}_p50_ms": float(m[f"{name}_p50_ms"]),
                    f"{name}_p99_ms": float(m[f"{name}_p99_ms"])}
        span_ns = self.last_finish - self.first_arrival
        span = span_ns / 1e9 if span_ns > 0 else float("nan")
        out |= {"throughput_rps": self.finished / span, "output_tps": output_tokens / span}
        return {k: None if math.isnan(v) else v for k, v in out.items()}
