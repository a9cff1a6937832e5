"""Explicit requests, as written in `[[workload.requests]]` (fuzzing, shrunk regressions).

Draw order from the caller's generator: the prefix of each `prefix_group`, in increasing group
id, then the tokens of each request with `prompt_len`, in input order. A grouped request's first
min(prefix_len, prompt_len) tokens are its group's prefix; its prompt is still `prompt_len` long,
so the exact P of a scenario (block boundaries) is what the file says.
"""

from __future__ import annotations

import numpy as np

from sim.workload.config import ExplicitRequest, WorkloadConfig
from sim.workload.spec import RequestSpec, read_only


def _prompt(r: ExplicitRequest, prefixes: dict[int, np.ndarray], vocab_size: int,
            rng: np.random.Generator) -> np.ndarray:
    if r.prompt_tokens is not None:
        return read_only(np.array(r.prompt_tokens, dtype=np.int32))
    assert r.prompt_len is not None, "config validation requires one of the two; a bug"
    tokens = rng.integers(0, vocab_size, size=r.prompt_len, dtype=np.int32)
    if r.prefix_group is not None:
        prefix = prefixes[r.prefix_group][: r.prompt_len]
        tokens[: len(prefix)] = prefix
    return read_only(tokens)


def build_explicit(cfg: WorkloadConfig, rng: np.random.Generator) -> list[RequestSpec]:
    reqs = cfg.requests
    assert reqs is not None, "build_explicit called on a workload without requests; a bug"
    groups = sorted({r.prefix_group for r in reqs if r.prefix_group is not None})
    prefixes = {g: rng.integers(0, cfg.vocab_size, size=cfg.prefix_len or 0, dtype=np.int32)
                for g in groups}
    prompts = [_prompt(r, prefixes, cfg.vocab_size, rng) for r in reqs]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_ns)  # stable: ties keep input
    return [RequestSpec(rid, reqs[i].arrival_ns, prompts[i], reqs[i].output_len, reqs[i].session)
            for rid, i in enumerate(order)]
