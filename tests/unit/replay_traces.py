"""Small hand-built traces for the replay (docs/trace.md, written with pyarrow), one behaviour each.

A tiny in-test engine keeps each request's truth (committed, blocks) and emits clean rows; a
scenario then bends one row the way a buggy engine would. Run as a script to write them all:
`python tests/unit/replay_traces.py OUT_DIR [--big]`.

Expected verdicts per scenario are in EXPECTED ({(step, request): verdict}; unlisted rows: ok).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import astuple, dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from sim.trace.reader import table_digest
from sim.trace.records import BlockEvent, RequestRecord, RowRecord, StepRecord
from sim.trace.schema import SCHEMAS, TABLES


def tok(req: int, pos: int, step: int) -> int:
    """Token id `req` writes at `pos` in `step` (a rejected draft differs from its successor)."""
    return (5000 + 101 * req + 7 * pos + 3 * step) % 30011


@dataclass
class Req:
    id: int
    prompt: list[int]
    alloc: list[int] = field(default_factory=list)
    committed: int = 0
    shared: int = 0
    outputs: list[int] = field(default_factory=list)


class Builder:
    def __init__(self, B: int = 16, num_blocks: int = 64, backend: str = "fa2", hq: int = 8,
                 hkv: int = 2, d: int = 128) -> None:
        self.B, self.num_blocks, self.backend, self.shape = B, num_blocks, backend, (hq, hkv, d)
        self.steps: list[StepRecord] = []
        self.rows: list[RowRecord] = []
        self.events: list[BlockEvent] = []
        self.reqs: dict[int, Req] = {}
        self.next_block = 0

    def request(self, rid: int, prompt: list[int], reuse_from: int = -1, reused: int = 0) -> Req:
        r = self.reqs[rid] = Req(rid, prompt)
        if reuse_from >= 0:  # share the owner's first blocks (no copy: the partial one too)
            n = -(-reused // self.B)
            r.alloc, r.committed, r.shared = list(self.reqs[reuse_from].alloc[:n]), reused, n
        return r

    def _reserve(self, r: Req, slots: int) -> None:
        while len(r.alloc) * self.B < slots:
            r.alloc.append(self.next_block)
            self.events.append(BlockEvent(len(self.steps), "sched", len(self.events), "alloc",
                                          self.next_block, r.id, 1))
            self.next_block += 1

    def ctx(self, rid: int) -> RowRecord:
        r = self.reqs[rid]
        q = len(r.prompt) - r.committed
        return self._row(r, "ctx", q, r.prompt[r.committed:], q, -1)

    def gen(self, rid: int, draft_len: int, accepted: int) -> RowRecord:
        r = self.reqs[rid]
        W, step = 1 + draft_len, len(self.steps)
        toks = [tok(rid, r.committed + j, step) for j in range(W)]
        return self._row(r, "gen", W, toks, 1 + accepted, accepted)

    def _row(self, r: Req, phase: str, q: int, toks: list[int], new: int, acc: int) -> RowRecord:
        self._reserve(r, r.committed + q)
        kv = r.committed + q
        nb = -(-kv // self.B)
        pos = tuple(range(r.committed, kv))
        return RowRecord(
            step=len(self.steps), row=0, request=r.id, phase=phase, q_len=q,
            draft_len=q - 1 if phase == "gen" else 0, first_gen=False, prev_in_flight=False,
            pages=tuple(r.alloc[:nb]), kv_indptr=0, last_page_len=kv - (nb - 1) * self.B,
            kv_len=kv, append_pos=pos, rope_pos=pos, cached_host=r.committed, kv_len_host=kv,
            committed=r.committed, alloc=tuple(r.alloc), reserved=len(r.alloc) * self.B,
            shared_blocks=r.shared, tokens=tuple(toks), accepted=acc, new_tokens=new,
            prev_new_tokens=-1, max_pos=1 << 20)

    def step(self, rows: list[RowRecord], plan_q_len: int = -1, plan_batch: int = -1) -> None:
        """Launch rows (already bent by the scenario): fix row/indptr, then commit the truth."""
        k, off, fixed = len(self.steps), 0, []
        for i, r in enumerate(rows):
            fixed.append(replace(r, row=i, kv_indptr=off))
            off += len(r.pages)
        ntok = sum(r.q_len for r in rows)
        nctx = sum(r.phase == "ctx" for r in rows)
        self.steps.append(StepRecord(k, k * 1000, k * 1000 + 10, k * 1000 + 20, k * 1000 + 900,
                                     len(rows), nctx, len(rows) - nctx, ntok, self.backend,
                                     plan_q_len, plan_batch if plan_batch >= 0 else len(rows), 1,
                                     self.next_block, self.num_blocks - self.next_block, 0, 0,
                                     k - 1))
        self.rows += fixed
        for r in fixed:
            q = self.reqs[r.request]
            q.outputs += list(r.tokens[: r.new_tokens]) if r.phase == "gen" else []
            q.committed += r.new_tokens

    def write(self, out: Path, name: str) -> Path:
        hq, hkv, d = self.shape
        reqs = [RequestRecord(q.id, 0, len(q.prompt), 64, tuple(q.prompt), tuple(q.outputs),
                              q.shared * self.B, 0, 0, "unfinished", 0, 0, 0, 0)
                for q in self.reqs.values()]
        tables = {"steps": self.steps, "rows": self.rows, "requests": reqs,
                  "blocks": self.events, "violations": []}
        out.mkdir(parents=True, exist_ok=True)
        arrow = {}
        for t in TABLES:
            cols = list(zip(*(astuple(x) for x in tables[t]), strict=True)) or \
                [[] for _ in SCHEMAS[t]]
            arrays = [pa.array(list(c), type=f.type) for c, f in zip(cols, SCHEMAS[t], strict=True)]
            arrow[t] = pa.Table.from_arrays(arrays, schema=SCHEMAS[t])
            pq.write_table(arrow[t], out / f"{t}.parquet")
        manifest = {"format_version": 1, "kvsim_version": "test", "scenario": {"name": name},
                    "profile": {"name": "test", "switches": {}}, "seed": 0,
                    "model": {"num_q_heads": hq, "num_kv_heads": hkv, "head_dim": d,
                              "tokens_per_block": self.B, "num_blocks": self.num_blocks,
                              "dtype": "bfloat16", "max_position_embeddings": 1 << 20,
                              "null_block": False},
                    "counts": {t: len(tables[t]) for t in TABLES},
                    "digest": table_digest([arrow[t] for t in TABLES], 1), "violations": 0,
                    "complete": True}
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return out


def prompt(rid: int, n: int) -> list[int]:
    return [tok(rid, p, 0) for p in range(n)]


def _two(P0: int, P1: int, **kw: object) -> Builder:
    b = Builder(**kw)  # type: ignore[arg-type]
    b.request(0, prompt(0, P0))
    b.request(1, prompt(1, P1))
    b.step([b.ctx(0), b.ctx(1)])
    return b


def clean_decode(out: Path) -> Path:
    b = _two(21, 37)
    for _ in range(5):
        b.step([b.gen(0, 0, 0), b.gen(1, 0, 0)])
    return b.write(out, "clean_decode")


def clean_mtp(out: Path, backend: str = "fa2") -> Path:
    """MTP D=3, accepted 0..3: the rejected drafts' slots are poisoned, then rewritten."""
    b = _two(29, 45, backend=backend)
    for a0, a1 in ((3, 0), (0, 2), (1, 3), (2, 1), (0, 0), (3, 3)):
        b.step([b.gen(0, 3, a0), b.gen(1, 3, a1)])
    return b.write(out, f"clean_mtp_{backend}")


def overlong_fa2(out: Path) -> Path:
    """Row 0's last_page_len = 2B: FA2 derives kv_len from pages and reads row 1's first page."""
    b = _two(29, 45)
    b.step([b.gen(0, 0, 0), b.gen(1, 0, 0)])
    b.step([b.gen(0, 0, 0), b.gen(1, 0, 0)])
    r0 = b.gen(0, 0, 0)  # kv_len 32: the last page is full
    b.step([replace(r0, last_page_len=r0.last_page_len + b.B), b.gen(1, 0, 0)])
    return b.write(out, "overlong_fa2")


def append_past_alloc(out: Path) -> Path:
    """Row 0 appends one slot past its exposed pages: the write lands in row 1's first page."""
    b = _two(29, 45)
    b.step([b.gen(0, 0, 0), b.gen(1, 0, 0)])
    b.step([b.gen(0, 0, 0), b.gen(1, 0, 0)])
    r0 = b.gen(0, 0, 0)
    b.step([replace(r0, append_pos=(r0.append_pos[0] + 1,)), b.gen(1, 0, 0)])
    return b.write(out, "append_past_alloc")


def shared_block_written(out: Path) -> Path:
    """Request 1 reuses request 0's partial block without a copy and appends into it."""
    b = Builder()
    b.request(0, prompt(0, 20))
    b.step([b.ctx(0)])
    b.request(1, prompt(0, 20) + prompt(1, 24)[20:], reuse_from=0, reused=20)
    b.step([b.ctx(1)])  # alone: two writes to one slot in one launch land in no fixed order
    b.step([b.gen(0, 0, 0), b.gen(1, 0, 0)])  # 0 (the owner) writes slot 4: 1 reads it
    return b.write(out, "shared_block_written")


def overlap_uncorrected(out: Path) -> Path:
    """Host estimate used on the device: after a step that accepted 1 of 3 drafts, positions and
    kv_len run D - a = 2 slots ahead of the truth (docs/design.md §3.4, pre-fix FlashInfer path)."""
    b = _two(29, 45)
    b.step([b.gen(0, 3, 1), b.gen(1, 3, 3)])
    r0 = b.gen(0, 3, 2)
    b._reserve(b.reqs[0], r0.committed + 2 + 4)
    kv = r0.kv_len + 2
    nb = -(-kv // b.B)
    pos = tuple(p + 2 for p in r0.append_pos)
    b.step([replace(r0, append_pos=pos, rope_pos=pos, kv_len=kv, kv_len_host=kv,
                    pages=tuple(b.reqs[0].alloc[:nb]), last_page_len=kv - (nb - 1) * b.B),
            b.gen(1, 3, 0)])
    return b.write(out, "overlap_uncorrected")


def big_verify(out: Path, batch: int = 64, kv: int = 2048, steps: int = 12) -> Path:
    """Benchmark trace: Llama-3.1-8B attention shape, batch x kv_len prompts, MTP D=3. Each step
    adds up to 4 tokens a row: past 12 steps the pool grows a page per row every 4 steps (the
    builder hands out blocks past the pool otherwise)."""
    per_row = kv // 16 + 4 + -(-max(steps - 12, 0) // 4)
    b = Builder(num_blocks=batch * per_row, hq=32, hkv=8, d=128)
    for i in range(batch):
        b.request(i, prompt(i, kv - 1 + i % 7))
    b.step([b.ctx(i) for i in range(batch)])
    for s in range(steps):
        b.step([b.gen(i, 3, (i + s) % 4) for i in range(batch)])
    return b.write(out, "big_verify")


SCENARIOS = {"clean_decode": clean_decode, "clean_mtp": clean_mtp, "overlong_fa2": overlong_fa2,
             "append_past_alloc": append_past_alloc, "shared_block_written": shared_block_written,
             "overlap_uncorrected": overlap_uncorrected,
             "clean_mtp_xqa": lambda o: clean_mtp(o, "xqa")}

# (step, request) -> verdict of the rows that are not ok; pinned from the analysis in each
# scenario's docstring and checked on both backends.
EXPECTED: dict[str, dict[tuple[int, int], str]] = {
    "clean_decode": {}, "clean_mtp": {}, "clean_mtp_xqa": {},
    "overlong_fa2": {(3, 0): "mismatch"},
    "append_past_alloc": {(3, 0): "corrupt", (3, 1): "mismatch"},
    "shared_block_written": {(1, 1): "corrupt", (2, 1): "corrupt"},  # 1 holds only shared blocks
    "overlap_uncorrected": {(2, 0): "nan"},
}


ROOT = Path(__file__).resolve().parents[2]
# the fault catalog's scenarios (kvsim run of each, `fault_trace`)
FAULTS = sorted(p.stem for p in (ROOT / "scenarios" / "faults").glob("*.toml"))


def fault_trace(tmp: Path, fault: str) -> Path:
    """The trace of the catalog's scenario for `fault`, written under tmp."""
    from sim.api import load_scenario, run

    sc, base = load_scenario(ROOT / "scenarios" / "faults" / f"{fault}.toml")
    run(sc, out=tmp / fault, profile=f"trtllm-post-17264+{fault}", base_dir=base)
    return tmp / fault


def default_small(tmp: Path, requests: int = 40) -> Path:
    """`make run`'s scenario at `requests` requests, written under tmp: partial-copy reuse (slot
    copies) under pressure, requests starting and ending at many steps."""
    from sim.api import load_scenario, run

    sc, base = load_scenario(ROOT / "scenarios" / "default.toml")
    wl = sc.workload.synthetic.model_copy(update={"num_requests": requests})
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={"synthetic": wl})})
    out = tmp / f"default{requests}"
    run(sc, out=out, base_dir=base)
    return out


def any_trace(tmp: Path, name: str) -> Path:
    """A replay scenario's trace or a fault's, by name."""
    return SCENARIOS[name](tmp / name) if name in SCENARIOS else fault_trace(tmp, name)


def named_trace(tmp: Path, name: str, big_steps: int) -> Path:
    """`any_trace`, or "default40" (`default_small`), or "big" (`big_verify` at batch 8 x kv
    256 with `big_steps` generation steps): the traces the preparation's tests walk."""
    if name == "default40":
        return default_small(tmp)
    if name == "big":
        return big_verify(tmp / "big", batch=8, kv=256, steps=big_steps)
    return any_trace(tmp, name)


def write_all(out: Path) -> dict[str, Path]:
    return {name: fn(out / name) for name, fn in SCENARIOS.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the replay test traces and expected.json.")
    ap.add_argument("out", type=Path, help="directory to write them under")
    ap.add_argument("--big", action="store_true",
                    help="also big_verify, the GPU benchmark trace (batch 64, kv_len ~2k)")
    a = ap.parse_args(argv)
    paths = write_all(a.out)
    if a.big:
        paths["big_verify"] = big_verify(a.out / "big_verify")
    (a.out / "expected.json").write_text(json.dumps(
        {n: {f"{s},{r}": v for (s, r), v in e.items()} for n, e in EXPECTED.items()}, indent=1))
    print("\n".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
