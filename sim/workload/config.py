"""The `[workload]` section of a scenario: validated once here, trusted everywhere after.

Exactly one source per workload:

```toml
[[workload.requests]]          # 1. explicit requests (fuzzing, regressions)
arrival_ns = 0
prompt_len = 58                # or prompt_tokens = [1, 2, 3]
output_len = 8

[workload.synthetic]           # 2. a seeded synthetic workload (capacity planning)
num_requests = 1000
qps = 5.0
prompt_len = { kind = "lognormal", mean = 1000, sigma = 0.8, min = 16, max = 8192 }
output_len = { kind = "uniform", min = 16, max = 512 }

[workload.trace]               # 3. a public trace (see ../shared/traces/README.md)
path = "../shared/traces/azure2023/AzureLLMInferenceTrace_conv.csv"
format = "azure2023"
```
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sim.numbers import Float, Int

_STRICT = ConfigDict(extra="forbid", frozen=True)
MAX_LEN = 10_000_000  # tokens in one prompt or output: far past any real context window
MAX_PREFIX_TOKENS = 100_000_000  # groups * prefix_len, all held in memory at once
MAX_TOKEN_ID = 2**31 - 1  # token ids are int32
MAX_REQUESTS = 10_000_000
MAX_GROUPS = 1_000_000  # shared-prefix groups
MAX_TRACE_ROWS = 2**20  # rows read from one trace file: the public traces hold a few 10^4
# Token ids a workload may generate in all: four bytes each, and a simulation of more would not
# end anyway. A synthetic config is checked on its expected lengths (with sessions a turn's
# prompt holds every earlier turn: num_turns * (prompt + output) per request), then the drawn
# lengths are checked before any token is made (synthetic.plan_synthetic).
MAX_WORKLOAD_TOKENS = 2**30
# Arrival times are int64 ns; a workload's expected span stays 16x below 2**62 so that random
# gaps cannot overflow (the drawn span is checked again, see synthetic.draw_arrivals).
MAX_SPAN_NS = 2**58


class UniformLength(BaseModel):
    """Integers drawn uniformly from [min, max]."""

    model_config = _STRICT
    kind: Literal["uniform"]
    min: Int = Field(ge=1, le=MAX_LEN)
    max: Int = Field(ge=1, le=MAX_LEN)

    @model_validator(mode="after")
    def _order(self) -> UniformLength:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class ConstantLength(BaseModel):
    model_config = _STRICT
    kind: Literal["constant"]
    value: Int = Field(ge=1, le=MAX_LEN)


class LognormalLength(BaseModel):
    """Lognormal with arithmetic mean `mean` (before clamping) and log-space `sigma`, rounded to
    an integer and clamped to [min, max]; real prompt lengths have this long right tail."""

    model_config = _STRICT
    kind: Literal["lognormal"]
    mean: Float = Field(gt=0, le=MAX_LEN)
    sigma: Float = Field(ge=0, le=10)
    min: Int = Field(1, ge=1, le=MAX_LEN)
    max: Int = Field(ge=1, le=MAX_LEN)

    @model_validator(mode="after")
    def _order(self) -> LognormalLength:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


LengthDist = Annotated[UniformLength | ConstantLength | LognormalLength,
                       Field(discriminator="kind")]


class SharedPrefix(BaseModel):
    """A fraction of requests (of sessions, with `sessions`) start with one of `groups` prefixes,
    so block reuse happens. The prompt length stays the drawn one: the prefix fills its first
    min(prefix_len, prompt_len) tokens."""

    model_config = _STRICT
    groups: Int = Field(ge=1, le=MAX_GROUPS)
    prefix_len: Int = Field(ge=1, le=MAX_LEN)
    fraction: Float = Field(1.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _size(self) -> SharedPrefix:
        if self.groups * self.prefix_len > MAX_PREFIX_TOKENS:
            raise ValueError(f"groups * prefix_len must be <= {MAX_PREFIX_TOKENS}")
        return self


class Sessions(BaseModel):
    """Multi-turn chat: turn t's prompt = turn t-1's prompt + a stand-in for its output + new
    user tokens (drawn from `prompt_len`). Open loop: turn t arrives t * think_ns after turn 0."""

    model_config = _STRICT
    num_turns: Int = Field(ge=1, le=10_000)
    think_ns: Int = Field(ge=0, le=10**15)


class SyntheticConfig(BaseModel):
    """`qps` is the request rate; with sessions, sessions start at qps / num_turns."""

    model_config = _STRICT
    num_requests: Int = Field(ge=1, le=MAX_REQUESTS)
    arrival: Literal["poisson", "gamma"] = "poisson"
    qps: Float = Field(gt=0, le=1e9)
    cv: Float | None = Field(None, gt=0, le=1000)  # gamma: coefficient of variation of gaps
    prompt_len: LengthDist
    output_len: LengthDist
    vocab_size: Int = Field(32000, ge=2, le=MAX_TOKEN_ID)
    shared_prefix: SharedPrefix | None = None
    sessions: Sessions | None = None

    @model_validator(mode="after")
    def _cv(self) -> SyntheticConfig:
        if self.arrival == "gamma" and self.cv is None:
            raise ValueError("cv is required when arrival = 'gamma'")
        if self.arrival == "poisson" and self.cv is not None:
            raise ValueError("cv applies only to arrival = 'gamma' (poisson has cv 1)")
        self._sizes()
        return self

    def _sizes(self) -> None:
        turns = self.sessions.num_turns if self.sessions else 1
        think = self.sessions.think_ns if self.sessions else 0
        units = -(-self.num_requests // turns)
        span = (units - 1) * turns / self.qps * 1e9 + (turns - 1) * think
        if span > MAX_SPAN_NS:
            raise ValueError(f"qps: num_requests / qps (plus the sessions' think time) must "
                             f"span at most 2**58 ns (got {span:.3g} ns)")
        per = turns * (_expected(self.prompt_len) + _expected(self.output_len))
        if self.num_requests * per > MAX_WORKLOAD_TOKENS:
            raise ValueError(f"num_requests: num_requests * a request's expected tokens must "
                             f"be <= {MAX_WORKLOAD_TOKENS} (got {self.num_requests} * {per:.0f})")


def _expected(dist: UniformLength | ConstantLength | LognormalLength) -> float:
    if isinstance(dist, ConstantLength):
        return dist.value
    if isinstance(dist, UniformLength):
        return (dist.min + dist.max) / 2
    return min(max(dist.mean, dist.min), dist.max)


class TraceConfig(BaseModel):
    """A public trace file. Relative `path`s resolve against the scenario's folder, then the repo
    root. `time_scale` multiplies arrival times (0.5 = twice the rate). `fallback` is a synthetic
    stand-in for machines without the shared traces: it runs only when asked for
    (`kvsim run --synthetic-workload`); a missing file is an error otherwise."""

    model_config = _STRICT
    path: str = Field(min_length=1)
    format: Literal["azure2023", "mooncake"]
    limit: Int | None = Field(None, ge=1, le=MAX_TRACE_ROWS)  # rows to read; None = all
    start: Int = Field(0, ge=0, le=2**40)  # data rows to skip first
    time_scale: Float = Field(1.0, gt=0, le=1e6)
    max_prompt_len: Int | None = Field(None, ge=1, le=MAX_LEN)  # longer prompts are truncated
    max_output_len: Int | None = Field(None, ge=1, le=MAX_LEN)
    vocab_size: Int = Field(32000, ge=2, le=MAX_TOKEN_ID)
    fallback: SyntheticConfig | None = None


class ExplicitRequest(BaseModel):
    model_config = _STRICT
    arrival_ns: Int = Field(ge=0, le=2**62)
    output_len: Int = Field(ge=1, le=MAX_LEN)
    prompt_len: Int | None = Field(None, ge=1, le=MAX_LEN)
    prompt_tokens: list[Annotated[Int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = Field(
        None, min_length=1)
    # share workload.prefix_len generated tokens
    prefix_group: Int | None = Field(None, ge=0, le=MAX_GROUPS)
    session: Int = Field(-1, ge=-1, le=MAX_REQUESTS)

    @model_validator(mode="after")
    def _prompt(self) -> ExplicitRequest:
        if (self.prompt_len is None) == (self.prompt_tokens is None):
            raise ValueError("give exactly one of prompt_len, prompt_tokens")
        if self.prefix_group is not None and self.prompt_tokens is not None:
            raise ValueError("prefix_group needs prompt_len (generated tokens), not prompt_tokens")
        return self


_EXPLICIT_ONLY = ("vocab_size", "prefix_len")


class WorkloadConfig(BaseModel):
    model_config = _STRICT
    requests: list[ExplicitRequest] | None = Field(None, min_length=1)
    synthetic: SyntheticConfig | None = None
    trace: TraceConfig | None = None
    # Explicit requests only: synthetic and trace sources carry their own vocab_size.
    vocab_size: Int = Field(32000, ge=2, le=MAX_TOKEN_ID)
    prefix_len: Int | None = Field(None, ge=1, le=MAX_LEN)

    @model_validator(mode="after")
    def _one_source(self) -> WorkloadConfig:
        given = [self.requests, self.synthetic, self.trace]
        if sum(s is not None for s in given) != 1:
            raise ValueError("exactly one of workload.requests, workload.synthetic, "
                             "workload.trace must be given")
        if self.requests is None:
            # Compare with the defaults, not model_fields_set: a dumped config (trace manifest)
            # spells every default out and must validate again.
            for name in _EXPLICIT_ONLY:
                if getattr(self, name) != type(self).model_fields[name].default:
                    raise ValueError(f"workload.{name} applies only to workload.requests")
        elif self.prefix_len is None and any(r.prefix_group is not None for r in self.requests):
            raise ValueError("workload.prefix_len is required when a request has prefix_group")
        else:
            tokens = sum((r.prompt_len or 0) + r.output_len for r in self.requests)
            if tokens > MAX_WORKLOAD_TOKENS:
                raise ValueError(f"workload.requests: prompt and output tokens must sum to "
                                 f"<= {MAX_WORKLOAD_TOKENS} (got {tokens})")
        return self
