"""Public request traces: Azure LLM inference 2023 (CSV) and Mooncake (JSONL).

Both are read whole (they are a few MB), validated row by row, and turned into requests whose
arrival is the time since the first row read, times `time_scale`. Every bad row is a
`WorkloadError` naming the file, the line (1-based, as an editor shows it) and the field.

Azure rows carry only lengths: token ids are generated like a synthetic workload's (one content
seed from the caller's generator). Mooncake rows carry one `hash_id` per 512-token block,
prefix-chained: token j of block h is a fixed function of (h, j) alone (splitmix64), so two
requests that share a hash id share those 512 tokens exactly and the simulator's prefix cache
finds the reuse at any block size. The last block is partial:

    hash_ids  [ h0 ........ | h1 ........ | h2 .... ]
    tokens     0        511  512     1023  1024   input_length-1
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sim.inputs import long_integers, read_input
from sim.workload.config import MAX_WORKLOAD_TOKENS, TraceConfig
from sim.workload.content import Plan, iter_plan
from sim.workload.readers import MOONCAKE_BLOCK, TraceRows, parse_azure, parse_mooncake
from sim.workload.spec import RequestSpec, WorkloadError, read_only

REPO_ROOT = Path(__file__).resolve().parents[2]
_SALT = 0x6B7673696D2D6D63  # "kvsim-mc": keeps these ids unlike other splitmix64 users'
MAX_TRACE_BYTES = 2**26  # the public traces are a few MB; rows are capped too (readers.py)
_PARSERS = {"azure2023": parse_azure, "mooncake": parse_mooncake}


def resolve_trace(path: str, base_dir: Path | None) -> Path | None:
    """The trace file: absolute, or relative to the scenario's folder (else the working
    directory), then to the repo root. None when no candidate exists."""
    p = Path(path)
    bases = [base_dir if base_dir is not None else Path.cwd(), REPO_ROOT]
    for cand in [p] if p.is_absolute() else [b / p for b in bases]:
        if cand.exists():  # a FIFO or a folder is found, then refused by read_trace
            return cand.resolve()
    return None


def tried_paths(path: str, base_dir: Path | None) -> str:
    p = Path(path)
    if p.is_absolute():
        return str(p)
    bases = [base_dir if base_dir is not None else Path.cwd(), REPO_ROOT]
    return ", ".join(str((b / p).resolve()) for b in bases)


def read_trace(cfg: TraceConfig, file: Path) -> TraceRows:
    """Parse the selected rows of `file` and apply `time_scale` and the length clamps."""
    what = f"{cfg.format} trace {file}"
    raw = read_input(file, "workload trace", MAX_TRACE_BYTES, WorkloadError)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise WorkloadError(f"{what} line {line}: not UTF-8 text (byte {e.start})") from None
    with long_integers():  # a row's huge integer is reported with its line and field
        rows = _PARSERS[cfg.format](text, what, cfg.start, cfg.limit)
    if not len(rows.arrival_ns):
        raise WorkloadError(f"{what}: no data rows after skipping start = {cfg.start}")
    arrival = rows.arrival_ns
    if cfg.time_scale != 1.0:
        scaled = np.rint(arrival * cfg.time_scale)
        if len(scaled) and scaled[-1] > 2**62:
            raise WorkloadError(f"{what}: time_scale = {cfg.time_scale} makes the rows span "
                                "more than 2**62 ns")
        arrival = scaled.astype(np.int64)
    prompt = _clamp(rows.prompt_len, cfg.max_prompt_len)
    output = _clamp(rows.output_len, cfg.max_output_len)
    tokens = int(prompt.sum()) + int(output.sum())
    if tokens > MAX_WORKLOAD_TOKENS:
        raise WorkloadError(f"{what}: tokens: the rows' prompt and output tokens must sum to "
                            f"<= {MAX_WORKLOAD_TOKENS}, set limit or max_prompt_len (got {tokens})")
    return TraceRows(arrival, prompt, output, rows.hash_ids)


def _clamp(lengths: np.ndarray, most: int | None) -> np.ndarray:
    return lengths if most is None else np.minimum(lengths, most)


def mooncake_tokens(hash_ids: np.ndarray, length: int, vocab_size: int) -> np.ndarray:
    """The first `length` tokens of the blocks `hash_ids`: int32 [length], in [0, vocab_size)."""
    pos = np.arange(length, dtype=np.uint64)
    block = hash_ids.astype(np.uint64)[pos // MOONCAKE_BLOCK]
    key = (block << np.uint64(9)) | (pos % MOONCAKE_BLOCK)  # unique for ids < 2**55
    return (_splitmix64(key ^ np.uint64(_SALT)) % np.uint64(vocab_size)).astype(np.int32)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vigna's splitmix64 finalizer, elementwise: a stable 64-bit mix (uint64 wraps)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _iter_mooncake(rows: TraceRows, vocab_size: int) -> Iterator[RequestSpec]:
    assert rows.hash_ids is not None, "mooncake rows without hash_ids; a bug in the reader"
    cols = (rows.arrival_ns.tolist(), rows.prompt_len.tolist(), rows.output_len.tolist())
    for rid, (t, p, o) in enumerate(zip(*cols, strict=True)):
        prompt = read_only(mooncake_tokens(rows.hash_ids[rid], p, vocab_size))
        yield RequestSpec(rid, t, prompt, o)


def iter_trace(cfg: TraceConfig, file: Path, rng: np.random.Generator) -> Iterator[RequestSpec]:
    """Requests of a trace file; rows are parsed (and errors raised) before the first yield."""
    return trace_requests(cfg, read_trace(cfg, file), rng)


def trace_requests(cfg: TraceConfig, rows: TraceRows,
                   rng: np.random.Generator) -> Iterator[RequestSpec]:
    """Requests of rows read from a trace file."""
    if cfg.format == "mooncake":
        return _iter_mooncake(rows, cfg.vocab_size)
    n = len(rows.arrival_ns)
    ids = np.arange(n, dtype=np.int64)
    plan = Plan(arrival_ns=rows.arrival_ns, prompt_len=rows.prompt_len,
                output_len=rows.output_len, unit=ids, session=np.full(n, -1, np.int64),
                unit_len=rows.prompt_len, unit_group=np.full(n, -1, np.int64),
                prefixes=np.zeros((0, 0), np.int32),
                content_seed=int(rng.integers(0, 2**63, dtype=np.int64)),
                vocab_size=cfg.vocab_size)
    return iter_plan(plan)
