"""Synthetic workloads: arrivals, lengths, shared prefixes and chat sessions, drawn vectorized.

Draw order from the caller's generator (tests pin it: changing it changes every seeded
workload):

1. inter-arrival gaps, one per unit after the first (a unit is a request, or a session);
2. prompt lengths, one per request (with sessions: the new user tokens of each turn);
3. output lengths, one per request;
4. with `shared_prefix`: membership per unit (`random() < fraction`), then a group per unit,
   then the prefix tokens [groups, prefix_len];
5. one 63-bit content seed, from which `content.py` makes every other token id.

The first unit arrives at 0 ns. Gaps are rounded to integer ns before they are summed, so
arrival times are exact integers with no float drift over a million requests.
"""

from __future__ import annotations

import numpy as np

from sim.workload.config import (
    MAX_WORKLOAD_TOKENS,
    LengthDist,
    LognormalLength,
    SyntheticConfig,
    UniformLength,
)
from sim.workload.content import Plan
from sim.workload.spec import WorkloadError

_NS = 1e9


def draw_arrivals(cfg: SyntheticConfig, n: int, rate: float,
                  rng: np.random.Generator) -> np.ndarray:
    """Arrival times [n] int64 ns of a renewal process with `rate` per second, from 0."""
    mean_gap_s = 1.0 / rate
    if cfg.arrival == "poisson":
        gaps = rng.exponential(mean_gap_s, n - 1)
    else:
        assert cfg.cv is not None, "config validation lets gamma through without cv; a bug"
        shape = 1.0 / cfg.cv**2  # gamma(k, θ): mean kθ, cv 1/sqrt(k)
        gaps = rng.gamma(shape, mean_gap_s / shape, n - 1)
    if gaps.sum() * _NS > 2**62:  # heavy-tailed gamma gaps can pass the config's span check
        raise WorkloadError(f"workload.synthetic.qps: arrival times must stay below 2**62 ns; "
                            f"{n} arrivals at {rate:g}/s drew {gaps.sum():.3g} s, raise qps "
                            "or lower cv")
    gap_ns = np.rint(gaps * _NS).astype(np.int64)
    return np.concatenate([np.zeros(1, np.int64), np.cumsum(gap_ns)])


def draw_lengths(dist: LengthDist, n: int, rng: np.random.Generator) -> np.ndarray:
    """[n] int64 lengths; a constant draws nothing from `rng`."""
    if isinstance(dist, UniformLength):
        return rng.integers(dist.min, dist.max + 1, size=n, dtype=np.int64)
    if isinstance(dist, LognormalLength):
        mu = np.log(dist.mean) - dist.sigma**2 / 2  # so that E[X] == mean
        x = rng.lognormal(mu, dist.sigma, n)
        return np.clip(np.rint(x), dist.min, dist.max).astype(np.int64)
    return np.full(n, dist.value, dtype=np.int64)


def _draw_prefixes(cfg: SyntheticConfig, units: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    sp = cfg.shared_prefix
    if sp is None:
        return np.full(units, -1, np.int64), np.zeros((0, 0), np.int32)
    member = rng.random(units) < sp.fraction
    group = rng.integers(0, sp.groups, size=units, dtype=np.int64)
    prefixes = rng.integers(0, cfg.vocab_size, size=(sp.groups, sp.prefix_len), dtype=np.int32)
    return np.where(member, group, -1), prefixes


def _turn_prompt_lens(user: np.ndarray, out: np.ndarray, turns: int) -> np.ndarray:
    """Prompt of turn t = sum of user tokens of turns <= t + outputs of turns < t."""
    seg = user + out
    done = np.cumsum(seg)  # tokens through the end of each turn's output, across sessions
    first = np.arange(len(user)) // turns * turns  # index of the session's turn 0
    before_session = done[first] - seg[first]
    return done - out - before_session


def _check_tokens(cfg: SyntheticConfig, user: np.ndarray, out: np.ndarray, turns: int) -> None:
    """The drawn lengths' tokens, before any token is made: a session's turn t holds the t
    turns before it, so count (turns - t) copies of each turn's user and output tokens."""
    copies = turns - np.arange(len(user), dtype=np.int64) % turns
    tokens = int(((user + out).astype(np.float64) * copies).sum())
    if tokens > MAX_WORKLOAD_TOKENS:
        raise WorkloadError(f"workload.synthetic.num_requests: the drawn requests hold "
                            f"{tokens} tokens, more than {MAX_WORKLOAD_TOKENS}; lower "
                            "num_requests or the lengths")


def plan_synthetic(cfg: SyntheticConfig, rng: np.random.Generator) -> Plan:
    n = cfg.num_requests
    turns = cfg.sessions.num_turns if cfg.sessions else 1
    units = -(-n // turns)  # the last session may be cut short by num_requests
    starts = draw_arrivals(cfg, units, cfg.qps / turns, rng)
    user = draw_lengths(cfg.prompt_len, n, rng)
    out = draw_lengths(cfg.output_len, n, rng)
    _check_tokens(cfg, user, out, turns)
    group, prefixes = _draw_prefixes(cfg, units, rng)
    seed = int(rng.integers(0, 2**63, dtype=np.int64))
    unit = np.arange(n, dtype=np.int64) // turns
    if cfg.sessions is None:
        arrival, prompt, session = starts, user, np.full(n, -1, np.int64)
    else:
        turn = np.arange(n, dtype=np.int64) % turns
        arrival = starts[unit] + turn * cfg.sessions.think_ns
        prompt, session = _turn_prompt_lens(user, out, turns), unit
    # Prompts grow turn by turn, so a session's stream is as long as its last turn's prompt.
    last = np.minimum(np.arange(1, units + 1) * turns, n) - 1
    order = np.argsort(arrival, kind="stable")  # ties keep input order (session, turn)
    return Plan(arrival_ns=arrival[order], prompt_len=prompt[order], output_len=out[order],
                unit=unit[order], session=session[order], unit_len=prompt[last],
                unit_group=group, prefixes=prefixes, content_seed=seed,
                vocab_size=cfg.vocab_size)
