"""Drive vLLM's real v1 scheduler step by step, without a model (runs inside .venv-vllm).

This file is a script, not a kvsim module: it imports only vLLM and the standard library, so it
runs in vLLM's own virtualenv (`make vllm-env`). kvsim (sim/engines/vllm.py) writes JSON
payloads on stdin, one per line (a workload and vLLM's config); the script runs each on a fresh
Scheduler and KVCacheManager, so one process start (vLLM's imports, most of a small run's
cost) serves any number of workloads. It answers on stdout, one JSON object per line:

    {"vllm": "0.33.0"}                          first, before anything else is built
    then per payload:
    {"step": k, "rows": [...], "events": [...], ...}   one per engine step
    {"requests": [...]}                         last: what became of every request
    {"refused": "..."}                          instead, when vLLM will not start with it
    {"error": "..."}                            instead, when vLLM raised (its traceback)

The loop is `EngineCore.step` + `EngineCore.post_step` of the synchronous engine
(vllm/v1/engine/core.py at v0.33.0): `Scheduler.schedule()`, a fabricated `ModelRunnerOutput`
in place of the model, `Scheduler.update_from_output()`, then `update_draft_token_ids()` with
the drafts a drafter would have proposed. The sampled tokens and how many drafts the target
accepts come from the payload (kvsim draws them from the scenario, seeded).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import tempfile
import traceback
from typing import Any

# Run as a script, this folder comes first on sys.path, and its vllm.py (kvsim's side of the
# adapter) would shadow the vllm package.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

PINNED = "0.33.0"
# exit status for an environment kvsim cannot use (a vLLM other than PINNED)
BAD_ENV = 3


class Refused(Exception):
    """A configuration vLLM's engine would not start with."""


def _emit(out, obj: dict) -> None:
    out.write(json.dumps(obj, separators=(",", ":")) + "\n")


def _model_dir(root: str, name: str, max_pos: int) -> str:
    """A folder holding only a tiny Llama config.json: ModelConfig wants a model, the
    scheduler never runs it."""
    path = os.path.join(root, name)
    os.makedirs(path)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 32000, "rms_norm_eps": 1e-5,
           "max_position_embeddings": max_pos, "torch_dtype": "float16"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def build(p: dict, root: str):
    """The scheduler EngineCore would build for this payload, and its block hasher."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model = ModelConfig(model=_model_dir(root, "target", p["max_position_embeddings"]),
                        skip_tokenizer_init=True, max_model_len=p["max_model_len"],
                        dtype="float16", seed=0)
    cache = CacheConfig(block_size=p["block_size"], enable_prefix_caching=p["prefix_caching"])
    cache.num_gpu_blocks = p["num_blocks"]
    sched = SchedulerConfig(max_model_len=p["max_model_len"], is_encoder_decoder=False,
                            max_num_seqs=p["max_num_seqs"],
                            max_num_batched_tokens=p["max_num_batched_tokens"],
                            long_prefill_token_threshold=p["long_prefill_token_threshold"],
                            enable_chunked_prefill=True, async_scheduling=False)
    spec = None
    if p["num_spec_tokens"]:
        spec = SpeculativeConfig(method="eagle", num_speculative_tokens=p["num_spec_tokens"],
                                 model=_model_dir(root, "draft", p["max_position_embeddings"]),
                                 target_model_config=model,
                                 target_parallel_config=ParallelConfig(),
                                 # the legacy rule: drop the last matched block instead
                                 disable_lookahead_block_hashes=p.get("eagle_block_drop", False))
    vcfg = VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched,
                      speculative_config=spec, device_config=DeviceConfig(device="cpu"))
    # One full-attention group, as kv_cache_planning.py builds it for a plain decoder; the
    # group takes the legacy EAGLE last-block drop only when the config selects it
    # (get_kv_cache_groups: is_eagle_group).
    group = KVCacheGroupSpec(["layer"], FullAttentionSpec(
        block_size=p["block_size"], num_kv_heads=1, head_size=1, dtype=torch.float16),
        is_eagle_group=spec is not None and spec.use_eagle_block_drop())
    # EngineCore refuses to start when one request of max_model_len cannot fit the pool less
    # its null block (kv_cache_planning.py: check_enough_kv_cache_memory, in bytes; for full
    # attention FullAttentionSpec.max_memory_usage_bytes is these blocks times the page size)
    need = -(-model.max_model_len // p["block_size"])
    if need > p["num_blocks"] - 1 and p.get("startup_check", True):
        raise Refused(f"one request of max_model_len {model.max_model_len} needs {need} "
                      f"blocks and the pool has {p['num_blocks'] - 1} besides the null block")
    kv = KVCacheConfig(num_blocks=p["num_blocks"], kv_cache_tensors=[], kv_cache_groups=[group])
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, vcfg)
    s = Scheduler(vllm_config=vcfg, kv_cache_config=kv, block_size=block_size,
                  hash_block_size=hash_block_size,
                  structured_output_manager=StructuredOutputManager(vcfg), log_stats=False)
    hasher = None
    if cache.enable_prefix_caching:  # EngineCore.__init__ builds it this way
        fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        init_none_hash(fn)
        hasher = get_request_block_hasher(hash_block_size, fn, vcfg.num_hash_lookahead_tokens)
    return s, hasher


class Recorder:
    """Block events in the order the pool makes them, each tagged with the request it serves.

    It wraps, on the one BlockPool instance, the calls that change who holds a block or what
    it caches; the wrapped calls run unchanged. The request comes from the KVCacheManager call
    on the stack (allocate_slots / free), the only callers of those pool methods here.
    """

    def __init__(self, sched, block_size: int) -> None:
        self.events: list[list] = []
        self.B = block_size
        self.req = -1
        self.preempted: list[int] = []
        self.ids: dict[str, int] = {}
        mgr = sched.kv_cache_manager
        pool = mgr.block_pool
        self.pool = pool
        self._around(mgr, "allocate_slots", lambda a: a[0])
        self._around(mgr, "free", lambda a: a[0])
        self._wrap(pool, "get_new_blocks", after=lambda ret: self._add("alloc", ret))
        self._wrap(pool, "touch", before=lambda a, k: self._add("reuse", a[0]))
        free_blocks = pool.free_blocks

        def freeing(ordered_blocks) -> None:  # the pool takes an iterator: read it once
            blocks = list(ordered_blocks)
            self._freeing(blocks)
            free_blocks(blocks)
        pool.free_blocks = freeing
        self._wrap(pool, "_maybe_evict_cached_block", before=lambda a, k: self._evicting(a[0]))
        self._wrap(pool, "_insert_block_hash", before=lambda a, k: self._hashing(
            a[0], a[1], a[2] if len(a) > 2 else k.get("num_tokens")))
        self._wrap(sched, "_preempt_request",
                   before=lambda a, k: self.preempted.append(self.ids[a[0].request_id]))

    def _wrap(self, obj, name, before=None, after=None) -> None:
        inner = getattr(obj, name)

        def call(*a, **k):
            if before is not None:
                before(a, k)
            ret = inner(*a, **k)
            if after is not None:
                after(ret)
            return ret
        setattr(obj, name, call)

    def _around(self, obj, name, req_of) -> None:
        inner = getattr(obj, name)

        def call(*a, **k):
            self.req = self.ids[req_of(a).request_id]
            try:
                return inner(*a, **k)
            finally:
                self.req = -1
        setattr(obj, name, call)

    def _ev(self, kind: str, block, ref: int, num_tokens: int = 0, h: int = 0) -> None:
        self.events.append([kind, block.block_id, self.req, ref, num_tokens, h])

    def _add(self, kind: str, blocks) -> None:
        for b in blocks:
            if not b.is_null:  # touch: +1 each, as the pool is about to do
                self._ev(kind, b, b.ref_cnt + (kind == "reuse"))

    def _freeing(self, blocks) -> None:
        for b in blocks:
            if not b.is_null:
                self._ev("free", b, b.ref_cnt - 1)

    def _evicting(self, block) -> None:
        if block.block_hash is not None:
            self._ev("evict", block, block.ref_cnt)

    def _hashing(self, key, block, num_tokens) -> None:
        if block.block_hash == key:
            return
        from vllm.v1.core.kv_cache_utils import get_block_hash
        raw = bytes(get_block_hash(key))[-8:]  # the trace keeps the low 64 bits
        self._ev("hash", block, block.ref_cnt, _in_block(num_tokens, self.B),
                 int.from_bytes(raw, "little"))

    def take(self) -> list[list]:
        out, self.events = self.events, []
        return out


def _in_block(num_tokens, block_size: int) -> int:
    """Tokens of the block a cumulative count ends in (the pool passes the prefix length)."""
    if not num_tokens or not block_size:
        return block_size
    return (num_tokens - 1) % block_size + 1


def _fresh() -> dict:
    """What the driver keeps of a request beside vLLM's own state."""
    return {"admit_hit": -1, "prefill": True, "gen_steps": 0, "steps": 0, "accepted": 0,
            "proposed": 0, "first_ns": -1, "finish_ns": -1, "reason": "unfinished",
            "preemptions": 0, "reused": 0, "prev_new": -1}


class Run:
    """The step loop, with the clock, arrivals and the fabricated model output."""

    def __init__(self, p: dict, sched, hasher, rec: Recorder, out) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
        from vllm.v1.request import Request
        self.MRO, self.Drafts, self.Request, self.SP = (ModelRunnerOutput, DraftTokenIds,
                                                         Request, SamplingParams)
        self.p, self.s, self.hasher, self.rec, self.out = p, sched, hasher, rec, out
        self.reqs = p["requests"]  # arrival order
        self.next = 0
        self.now = 0
        self.info: dict[int, dict] = {r["id"]: _fresh() for r in self.reqs}
        self.by_id = {r["id"]: r for r in self.reqs}
        self.objs: dict[int, Any] = {}  # kvsim's request id -> vLLM's Request
        self.k = p["num_spec_tokens"]
        self.carry: list[list] = []  # events of steps that scheduled nothing
        self.B = p["block_size"]
        self.resets = list(p.get("reset_prefix_cache_ns", ()))

    def arrive(self) -> None:
        """Arrivals the clock has passed, then the prefix-cache resets it has passed (vLLM's
        `Scheduler.reset_prefix_cache()`: nothing happens while a block is held)."""
        self._arrive()
        while self.resets and self.resets[0] <= self.now:
            self.resets.pop(0)
            self.s.reset_prefix_cache()

    def _arrive(self) -> None:
        while self.next < len(self.reqs) and self.reqs[self.next]["arrival_ns"] <= self.now:
            r = self.reqs[self.next]
            self.next += 1
            if len(r["prompt"]) > self.p["max_model_len"]:  # the frontend refuses it
                self.info[r["id"]]["reason"] = "rejected"
                self.info[r["id"]]["finish_ns"] = r["arrival_ns"]
                continue
            sp = self.SP(max_tokens=r["output_len"], ignore_eos=True, temperature=0.0)
            req = self.Request(str(r["id"]), list(r["prompt"]), sp, None,
                               arrival_time=r["arrival_ns"] / 1e9, block_hasher=self.hasher)
            self.rec.ids[req.request_id] = r["id"]
            self.objs[r["id"]] = req
            self.s.add_request(req)

    def loop(self) -> None:
        k, idle = 0, 0
        while k < self.p["max_steps"]:
            self.arrive()
            if not self.s.has_requests() or idle > 1:
                # nothing to do, or nothing schedulable twice running: wait for an arrival
                if self.next >= len(self.reqs):
                    break
                self.now = max(self.now, self.reqs[self.next]["arrival_ns"])
                idle = 0
                continue
            if self.step(k):
                k, idle = k + 1, 0
            else:
                idle += 1
        if self.carry:
            _emit(self.out, {"events": self.carry})

    def step(self, k: int) -> bool:
        """One EngineCore.step + post_step; False (nothing emitted) when it scheduled nothing:
        its events then go to the next step that does (a forward that never launched)."""
        rec, s = self.rec, self.s
        rec.preempted = []
        t_sched = self.now
        so = s.schedule()
        sched_events = self.carry + rec.take()
        self.carry = []
        if not so.total_num_scheduled_tokens:
            s.update_from_output(so, self.MRO(req_ids=[], req_id_to_index={}))
            self.carry = sched_events + rec.take()
            return False
        rows = self._rows(so)
        free = s.kv_cache_manager.block_pool.get_num_free_blocks()
        cached = sum(1 for b in s.kv_cache_manager.block_pool.blocks
                     if b.ref_cnt == 0 and b.block_hash is not None and not b.is_null)
        n_tok = so.total_num_scheduled_tokens
        kv_tok = sum(r["c"] + r["q"] for r in rows)
        host = self.p["host_ns"][0] + self.p["host_ns"][1] * len(rows)
        dev = self.p["dev_ns"][0] + self.p["dev_ns"][1] * n_tok + self.p["dev_ns"][2] * kv_tok
        t_launch = t_sched + host
        t_end = t_launch + dev
        mro, drafts = self._model_output(so, rows)
        ecos = s.update_from_output(so, mro)
        self.now = t_end
        finished = self._finished(ecos, t_end, rows)
        if drafts is not None:
            s.update_draft_token_ids(drafts)
        proc_events = rec.take()
        _emit(self.out, {"step": k, "t": [t_sched, t_launch, t_launch, t_end], "rows": rows,
                         "sched_events": sched_events, "proc_events": proc_events,
                         "free": free, "cached": cached, "preempted": list(rec.preempted),
                         "finished": finished})
        return True

    def _rows(self, so) -> list[dict]:
        rows = []
        spec = so.scheduled_spec_decode_tokens
        for rid_s, n in so.num_scheduled_tokens.items():
            rid = self.rec.ids[rid_s]
            req, inf = self.objs[rid], self.info[rid]
            c = req.num_computed_tokens - n  # schedule() already advanced it by n
            if inf["admit_hit"] < 0:  # the first step of this admission: c is the prefix hit
                inf["admit_hit"] = c
                inf["reused"] = max(inf["reused"], c)
                inf["prefill"] = True
            drafts = list(spec.get(rid_s, ()))
            gen = not inf["prefill"]
            toks = req.all_token_ids
            written = list(toks[c:c + n]) if not gen else [toks[c]] + drafts
            rows.append({"request": rid, "phase": "gen" if gen else "ctx", "c": c, "q": n,
                         "d": len(drafts), "hit": inf["admit_hit"], "tokens": written,
                         "blocks": list(self.s.kv_cache_manager.get_block_ids(rid_s)[0]),
                         "num_tokens": req.num_tokens})
        return rows

    def _model_output(self, so, rows):
        """What the model would return: for a row that ends its prefill or decodes, the true
        next tokens (1 + accepted drafts); drafts for the next step from the true sequence,
        the ones past the planned acceptance made wrong."""
        ids, sampled, draft_ids, draft_toks = [], [], [], []
        for row in rows:
            rid = row["request"]
            r, inf, req = self.by_id[rid], self.info[rid], self.objs[rid]
            ids.append(str(rid))
            seq = r["prompt"] + r["output"]
            c, n = row["c"], row["q"]
            if row["phase"] == "ctx":
                done = c + n >= req.num_tokens
                row["accepted"] = -1
                row["new"] = n
                got = [seq[c + n]] if done else []
            else:
                plan = r["accept"][inf["gen_steps"] % len(r["accept"])] if r["accept"] else 0
                a = min(plan, row["d"])
                row["accepted"] = a
                row["new"] = 1 + a
                got = seq[c + 1:c + 2 + a]
                inf["gen_steps"] += 1
            row["prev_new"] = inf["prev_new"] if row["phase"] == "gen" else -1
            sampled.append(got)
            if got and self.k:
                nxt = c + n if row["phase"] == "ctx" else c + len(got)  # the newest token
                want = r["accept"][inf["gen_steps"] % len(r["accept"])] if r["accept"] else 0
                true = seq[nxt + 1:nxt + 1 + self.k]
                true += [0] * (self.k - len(true))
                draft_toks.append([t if i < want else (t + 1) % 32000
                                   for i, t in enumerate(true)])
                draft_ids.append(str(rid))
        mro = self.MRO(req_ids=ids, req_id_to_index={x: i for i, x in enumerate(ids)},
                       sampled_token_ids=sampled)
        drafts = self.Drafts(draft_ids, draft_toks) if self.k else None
        return mro, drafts

    def _finished(self, ecos, t_end: int, rows: list[dict]) -> list[int]:
        for row in rows:
            rid = row["request"]
            inf, req = self.info[rid], self.objs[rid]
            inf["steps"] += 1
            if row["phase"] == "gen":
                inf["accepted"] += row["accepted"]
                inf["proposed"] += row["d"]
                inf["prev_new"] = row["new"]
            elif row["c"] + row["q"] >= row["num_tokens"]:
                inf["prefill"] = False
                inf["prev_new"] = 1
            if req.num_output_tokens and inf["first_ns"] < 0:
                inf["first_ns"] = t_end
        done = []
        for eco in ecos.values():
            for o in eco.outputs:
                if o.finish_reason is None:
                    continue
                rid = self.rec.ids[o.request_id]
                req, inf = self.objs[rid], self.info[rid]
                inf["finish_ns"] = t_end
                capped = req.num_output_tokens < self.by_id[rid]["output_len"]
                inf["reason"] = "max_seq_len" if capped else "length"
                done.append(rid)
        for rid in self.rec.preempted:
            self.info[rid]["preemptions"] += 1
            self.info[rid]["admit_hit"] = -1
        return done

    def requests(self) -> list[dict]:
        out = []
        for r in self.reqs:
            inf = self.info[r["id"]]
            req = self.objs.get(r["id"])
            outs = list(req.output_token_ids) if req is not None else []
            out.append({"request": r["id"], "outputs": outs, "reused": inf["reused"],
                        "first_ns": inf["first_ns"], "finish_ns": inf["finish_ns"],
                        "reason": inf["reason"], "preemptions": inf["preemptions"],
                        "steps": inf["steps"], "accepted": inf["accepted"],
                        "proposed": inf["proposed"]})
        return out


def run_one(p: dict, out) -> None:
    """One payload on a fresh scheduler; its objects end with a requests, refused or error
    object, flushed, so kvsim can send the next payload."""
    with tempfile.TemporaryDirectory(prefix="kvsim-vllm-") as root:
        try:
            sched, hasher = build(p, root)
            run = Run(p, sched, hasher, Recorder(sched, p["block_size"]), out)
            run.loop()
            _emit(out, {"requests": run.requests()})
        except Refused as e:  # what EngineCore would refuse to start with
            _emit(out, {"refused": str(e)})
        except Exception:  # noqa: BLE001 - vLLM raised on this workload: report, go on
            _emit(out, {"error": traceback.format_exc(limit=8)})
    out.flush()


def main() -> int:
    out = os.fdopen(os.dup(1), "w")  # vLLM logs to stdout: keep ours apart, send its to stderr
    os.dup2(2, 1)
    version = importlib.metadata.version("vllm")
    _emit(out, {"vllm": version})
    out.flush()
    if version != PINNED:
        print(f"vllm {version} is installed; the adapter is pinned to {PINNED}", file=sys.stderr)
        return BAD_ENV
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for line in sys.stdin:
        if line.strip():
            run_one(json.loads(line), out)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # an orderly exit waits seconds on threads vLLM's imports leave running
