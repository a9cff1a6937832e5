"""The `vllm-v1` profile's engine: kvsim's model of vLLM's v1 scheduler (sim/sched/vllm.py,
sim/kv/vllm_manager.py) driven the way the vLLM adapter drives the real one.

The loop is `EngineCore.step` of vLLM's synchronous engine: schedule, the model's output
(fabricated from the payload's true tokens and planned acceptances, exactly as
sim/engines/vllm_driver.py `Run` fabricates it), `update_from_output`, then the drafts for the
next step. It takes the driver's payload (sim/engines/vllm.py `payload`) and answers with the
driver's objects, one per step, so one converter (sim/engines/vllm_trace.py) writes both
engines' traces and `kvsim diff --engine vllm` compares decisions only.
"""

from __future__ import annotations

from collections.abc import Iterator

from sim.kv.vllm_manager import VllmKV
from sim.sched.vllm import Scheduled, VConfig, VllmScheduler, VRequest


def _fresh() -> dict:
    """What the loop keeps of a request beside the scheduler's own state (the driver's)."""
    return {"admit_hit": -1, "prefill": True, "gen_steps": 0, "steps": 0, "accepted": 0,
            "proposed": 0, "first_ns": -1, "finish_ns": -1, "reason": "unfinished",
            "preemptions": 0, "reused": 0, "prev_new": -1}


def build(p: dict) -> VllmScheduler:
    """The scheduler the driver's payload describes (sim/engines/vllm_driver.py `build`)."""
    k = p["num_spec_tokens"]
    caching = p["prefix_caching"]
    drop = bool(k) and caching and p.get("eagle_block_drop", False)
    kv = VllmKV(p["num_blocks"], p["block_size"], caching, p["max_model_len"], drop)
    cfg = VConfig(p["max_num_seqs"], p["max_num_batched_tokens"],
                  p["long_prefill_token_threshold"], p["max_model_len"], k)
    return VllmScheduler(cfg, kv)


class VllmRun:
    """The step loop, with the clock, arrivals and the fabricated model output."""

    def __init__(self, p: dict) -> None:
        self.p = p
        self.s = build(p)
        self.pool = self.s.kv.pool
        self.k = p["num_spec_tokens"]
        self.B = p["block_size"]
        # lookahead block hashes: EAGLE with prefix caching, unless the legacy drop is chosen
        self.L = 1 if self.k and p["prefix_caching"] and not self.s.kv.drop_last_block else 0
        self.reqs = p["requests"]
        self.next = 0
        self.now = 0
        self.info: dict[int, dict] = {r["id"]: _fresh() for r in self.reqs}
        self.by_id = {r["id"]: r for r in self.reqs}
        self.objs: dict[int, VRequest] = {}
        self.carry: list[list] = []  # events of steps that scheduled nothing
        self.preempted: list[int] = []
        self.resets = list(p.get("reset_prefix_cache_ns", ()))

    def run(self) -> Iterator[dict]:
        """The driver's objects: one per launched step, then `{"requests": [...]}`."""
        k, idle = 0, 0
        while k < self.p["max_steps"]:
            self._arrive()
            while self.resets and self.resets[0] <= self.now:  # as the driver calls it
                self.resets.pop(0)
                self.s.reset_prefix_cache()
            if not self.s.has_requests() or idle > 1:
                if self.next >= len(self.reqs):
                    break
                self.now = max(self.now, self.reqs[self.next]["arrival_ns"])
                idle = 0
                continue
            o = self._step(k)
            if o is None:
                idle += 1
                continue
            yield o
            k, idle = k + 1, 0
        if self.carry:
            yield {"events": self.carry}
        yield {"requests": self._requests()}

    def _arrive(self) -> None:
        while self.next < len(self.reqs) and self.reqs[self.next]["arrival_ns"] <= self.now:
            r = self.reqs[self.next]
            self.next += 1
            if len(r["prompt"]) > self.p["max_model_len"]:  # the frontend refuses it
                self.info[r["id"]]["reason"] = "rejected"
                self.info[r["id"]]["finish_ns"] = r["arrival_ns"]
                continue
            req = VRequest(r["id"], list(r["prompt"]), len(r["prompt"]), r["output_len"],
                           self.B, self.L, self.p["prefix_caching"])
            self.objs[r["id"]] = req
            self.s.add_request(req)

    def _take(self) -> list[list]:
        out, self.pool.events = self.pool.events, []
        return out

    def _step(self, k: int) -> dict | None:
        """One EngineCore.step; None when it scheduled nothing (its events then go to the
        next step that does)."""
        t_sched = self.now
        so = self.s.schedule()
        self.preempted = [r.rid for r in so.preempted]
        sched_events = self.carry + self._take()
        self.carry = []
        if not so.total:
            self.carry = sched_events
            return None
        rows = self._rows(so)
        free, cached = self.pool.num_free, self.pool.num_cached_free
        n_tok = so.total
        kv_tok = sum(r["c"] + r["q"] for r in rows)
        host = self.p["host_ns"][0] + self.p["host_ns"][1] * len(rows)
        dev = self.p["dev_ns"][0] + self.p["dev_ns"][1] * n_tok + self.p["dev_ns"][2] * kv_tok
        t_launch = t_sched + host
        t_end = t_launch + dev
        sampled, drafts = self._model_output(so, rows)
        done = self.s.update_from_output(so, sampled)
        self.now = t_end
        finished = self._finished(done, t_end, rows)
        if self.k:
            self.s.update_draft_token_ids(drafts)
        return {"step": k, "t": [t_sched, t_launch, t_launch, t_end], "rows": rows,
                "sched_events": sched_events, "proc_events": self._take(), "free": free,
                "cached": cached, "preempted": list(self.preempted), "finished": finished}

    def _rows(self, so: Scheduled) -> list[dict]:
        rows = []
        for req, n in so.tokens.items():
            inf = self.info[req.rid]
            c = req.num_computed - n  # schedule() already advanced it by n
            if inf["admit_hit"] < 0:  # the first step of this admission: c is the prefix hit
                inf["admit_hit"] = c
                inf["reused"] = max(inf["reused"], c)
                inf["prefill"] = True
            drafts = list(so.drafts.get(req, ()))
            gen = not inf["prefill"]
            written = list(req.tokens[c:c + n]) if not gen else [req.tokens[c]] + drafts
            rows.append({"request": req.rid, "phase": "gen" if gen else "ctx", "c": c, "q": n,
                         "d": len(drafts), "hit": inf["admit_hit"], "tokens": written,
                         "blocks": list(self.s.kv.blocks[req.rid]), "num_tokens": req.num_tokens,
                         "obj": req})
        return rows

    def _model_output(self, so: Scheduled, rows: list[dict]
                      ) -> tuple[dict[VRequest, list[int]], dict[VRequest, list[int]]]:
        """The driver's `_model_output`: true next tokens (1 + accepted drafts) for a row that
        ends its prefill or decodes; the next drafts, wrong past the planned acceptance."""
        sampled: dict[VRequest, list[int]] = {}
        drafts: dict[VRequest, list[int]] = {}
        for row in rows:
            req = row.pop("obj")
            r, inf = self.by_id[req.rid], self.info[req.rid]
            seq = r["prompt"] + r["output"]
            c, n = row["c"], row["q"]
            if row["phase"] == "ctx":
                row["accepted"], row["new"] = -1, n
                got = [seq[c + n]] if c + n >= req.num_tokens else []
            else:
                a = min(self._plan(r, inf["gen_steps"]), row["d"])
                row["accepted"], row["new"] = a, 1 + a
                got = seq[c + 1:c + 2 + a]
                inf["gen_steps"] += 1
            row["prev_new"] = inf["prev_new"] if row["phase"] == "gen" else -1
            sampled[req] = got
            if got and self.k:
                nxt = c + n if row["phase"] == "ctx" else c + len(got)  # the newest token
                want = self._plan(r, inf["gen_steps"])
                true = seq[nxt + 1:nxt + 1 + self.k]
                true += [0] * (self.k - len(true))
                drafts[req] = [t if i < want else (t + 1) % 32000 for i, t in enumerate(true)]
        return sampled, drafts

    @staticmethod
    def _plan(r: dict, i: int) -> int:
        return r["accept"][i % len(r["accept"])] if r["accept"] else 0

    def _finished(self, done: list[VRequest], t_end: int, rows: list[dict]) -> list[int]:
        for row in rows:
            inf, req = self.info[row["request"]], self.objs[row["request"]]
            inf["steps"] += 1
            if row["phase"] == "gen":
                inf["accepted"] += row["accepted"]
                inf["proposed"] += row["d"]
                inf["prev_new"] = row["new"]
            elif row["c"] + row["q"] >= row["num_tokens"]:
                inf["prefill"] = False
                inf["prev_new"] = 1
            if req.num_output and inf["first_ns"] < 0:
                inf["first_ns"] = t_end
        for req in done:
            inf = self.info[req.rid]
            inf["finish_ns"] = t_end
            inf["reason"] = ("max_seq_len" if req.num_output < self.by_id[req.rid]["output_len"]
                             else "length")
        for rid in self.preempted:
            self.info[rid]["preemptions"] += 1
            self.info[rid]["admit_hit"] = -1
        return [r.rid for r in done]

    def _requests(self) -> list[dict]:
        out = []
        for r in self.reqs:
            inf = self.info[r["id"]]
            req = self.objs.get(r["id"])
            outs = req.tokens[req.num_prompt:] if req is not None else []
            out.append({"request": r["id"], "outputs": outs, "reused": inf["reused"],
                        "first_ns": inf["first_ns"], "finish_ns": inf["finish_ns"],
                        "reason": inf["reason"], "preemptions": inf["preemptions"],
                        "steps": inf["steps"], "accepted": inf["accepted"],
                        "proposed": inf["proposed"]})
        return out
