"""Scenario schema: the one place user input is validated (pydantic, unknown keys are errors).

`load_scenario` turns a TOML file into a `Scenario`; every error names the file, the field path
and what is allowed, and is raised as `ScenarioError` so the CLI can print it and exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sim.cost import CostConfig
from sim.errors import ScenarioError
from sim.inputs import load_toml, shown
from sim.numbers import Float, Int
from sim.workload import WorkloadConfig

_STRICT = ConfigDict(extra="forbid", frozen=True)
# What one run may allocate up front, whatever the single fields allow: the checker keeps ~17
# bytes per KV slot (num_blocks * tokens_per_block) and the metadata builder one int per
# block-table entry (max_batch_size * blocks_per_seq). Both are far past any real GPU's pool.
MAX_KV_SLOTS = 2**26
MAX_TABLE_ENTRIES = 2**24
MAX_SCENARIO_BYTES = 2**24  # explicit requests with their token ids fit many times over


class ModelConfig(BaseModel):
    model_config = _STRICT
    num_q_heads: Int = Field(32, ge=1, le=1024)
    num_kv_heads: Int = Field(8, ge=1, le=1024)
    head_dim: Int = Field(128, ge=16, le=1024)
    max_position_embeddings: Int = Field(4096, ge=2, le=10_000_000)
    dtype: Literal["bfloat16", "float16"] = "bfloat16"

    @model_validator(mode="after")
    def _gqa(self) -> ModelConfig:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("model.num_q_heads must be a multiple of model.num_kv_heads")
        return self


class CacheConfig(BaseModel):
    model_config = _STRICT
    tokens_per_block: Int = Field(32, ge=1, le=1024)
    num_blocks: Int = Field(64, ge=1, le=10_000_000)
    reuse: Literal["off", "full", "partial-copy", "partial-nocopy"] = "partial-copy"
    max_blocks_per_seq: Int = Field(0, ge=0, le=10_000_000)  # 0 = ceil(max_seq_len / B) + 1
    # Times the engine calls vLLM's `reset_prefix_cache` (e.g. after an RLHF weight update);
    # it succeeds only when no block is held. Profile vllm-v1 only.
    reset_prefix_cache_ns: list[Annotated[Int, Field(ge=0, le=2**62)]] = []


class SchedulerConfig(BaseModel):
    model_config = _STRICT
    max_batch_size: Int = Field(8, ge=1, le=4096)
    max_num_tokens: Int = Field(2048, ge=1, le=1_000_000)
    policy: Literal["guaranteed-no-evict", "max-utilization"] = "guaranteed-no-evict"
    chunk_size: Int = Field(0, ge=0, le=1_000_000)


class ForcedAcceptance(BaseModel):
    model_config = _STRICT
    kind: Literal["forced"]
    accepted: Annotated[list[Annotated[Int, Field(ge=0, le=64)]], Field(min_length=1)]


class RateAcceptance(BaseModel):
    model_config = _STRICT
    kind: Literal["rates"]
    rates: Annotated[list[Annotated[Float, Field(ge=0.0, le=1.0)]], Field(min_length=1)]
    request_multiplier: tuple[Float, Float] = (1.0, 1.0)  # per-request factor drawn uniformly

    @model_validator(mode="after")
    def _scaled(self) -> RateAcceptance:
        lo, hi = self.request_multiplier
        if not 0 <= lo <= hi:
            raise ValueError(f"request_multiplier: 0 <= low <= high (got {lo}, {hi})")
        if max(self.rates) * hi > 1:
            raise ValueError(f"request_multiplier: high * max(rates) must be <= 1, so every "
                             f"scaled rate is a probability (got {hi} * {max(self.rates)})")
        return self


class SpecConfig(BaseModel):
    model_config = _STRICT
    mode: Literal["none", "mtp"] = "none"
    max_draft_len: Int = Field(0, ge=0, le=64)
    # vLLM (profile vllm-v1): EAGLE's legacy prefix rule, the last matched block dropped,
    # instead of block hashes that also cover the token after the block (its default)
    eagle_block_drop: bool = False
    acceptance: ForcedAcceptance | RateAcceptance = Field(
        default_factory=lambda: ForcedAcceptance(kind="forced", accepted=[0]),
        discriminator="kind")
    # Runtime draft lengths cycled per step (each clamped to max_draft_len); empty = always D.
    runtime_draft_lens: list[Annotated[Int, Field(ge=0, le=64)]] = []
    extra_kv_tokens: Int = Field(0, ge=0, le=64)  # draft-layer KV written past the W tokens

    @model_validator(mode="after")
    def _mode(self) -> SpecConfig:
        if self.mode == "mtp" and self.max_draft_len < 1:
            raise ValueError("spec.max_draft_len must be >= 1 when spec.mode = 'mtp'")
        return self

    @property
    def depth(self) -> int:
        return self.max_draft_len if self.mode == "mtp" else 0


class OverlapConfig(BaseModel):
    model_config = _STRICT
    enabled: bool = True


class LimitsConfig(BaseModel):
    model_config = _STRICT
    max_seq_len: Int = Field(4096, ge=2, le=10_000_000)


class Scenario(BaseModel):
    model_config = _STRICT
    seed: Int = Field(0, ge=0, le=2**63 - 1)
    profile: str = "trtllm-post-17264"
    switches: dict[str, bool | str | int] = {}
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    spec: SpecConfig = SpecConfig()
    overlap: OverlapConfig = OverlapConfig()
    limits: LimitsConfig = LimitsConfig()
    workload: WorkloadConfig
    cost: CostConfig = Field(default_factory=CostConfig)

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data: object) -> object:
        """Profile vllm-v1 starts from vLLM's defaults where the scenario says nothing: prefix
        caching on (`reuse = "full"`) and the synchronous engine (overlap off)."""
        if not isinstance(data, dict) or data.get("profile") != "vllm-v1":
            return data
        data = dict(data)
        for section, key, value in (("cache", "reuse", "full"), ("overlap", "enabled", False)):
            part = data.get(section, {})
            if isinstance(part, dict) and key not in part:
                data[section] = {**part, key: value}
        return data

    @model_validator(mode="after")
    def _cross(self) -> Scenario:
        lim, d = self.limits.max_seq_len, self.spec.depth
        if lim > self.model.max_position_embeddings:
            raise ValueError(
                f"limits.max_seq_len ({lim}) must be <= model.max_position_embeddings "
                f"({self.model.max_position_embeddings})")
        if d + 2 > lim:
            raise ValueError(
                f"spec.max_draft_len ({d}) must be <= limits.max_seq_len - 2 ({lim - 2})")
        if 1 + d > self.scheduler.max_num_tokens:  # a generation step could never be scheduled
            raise ValueError(f"scheduler.max_num_tokens ({self.scheduler.max_num_tokens}) must "
                             f"be >= 1 + spec.max_draft_len ({1 + d}), one step's tokens")
        if self.blocks_per_seq * self.cache.tokens_per_block < lim:
            raise ValueError("cache.max_blocks_per_seq * cache.tokens_per_block must cover "
                             f"limits.max_seq_len ({lim})")
        self._sizes()
        return self

    def _sizes(self) -> None:
        slots = self.cache.num_blocks * self.cache.tokens_per_block
        if slots > MAX_KV_SLOTS:
            raise ValueError(f"cache.num_blocks * cache.tokens_per_block ({slots}) must be <= "
                             f"{MAX_KV_SLOTS} KV slots")
        table = self.scheduler.max_batch_size * self.blocks_per_seq
        if table > MAX_TABLE_ENTRIES:
            raise ValueError(f"scheduler.max_batch_size * cache.max_blocks_per_seq ({table}) "
                             f"must be <= {MAX_TABLE_ENTRIES} block-table entries")

    @property
    def blocks_per_seq(self) -> int:
        b = self.cache.tokens_per_block
        return self.cache.max_blocks_per_seq or -(-self.limits.max_seq_len // b) + 1


def _format_error(path: str, err: ValidationError, data: object = None) -> str:
    """One line, for the deepest error: a value that fits no member of a union (`str | ModelSpec`)
    fails every member, and the member that looked inside it says what is wrong."""
    best: tuple[int, str] = (-1, "")
    for e in err.errors():
        loc = _loc(e["loc"], data)
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        tail = "" if isinstance(got, dict | list) or got is None else f" (got {shown(got)})"
        if len(loc) > best[0]:
            best = (len(loc), f"{path}: {'.'.join(loc) or 'scenario'}: {msg}{tail}")
    return best[1]


_SCALAR_MEMBERS = ("str", "int", "float", "bool")


def _loc(loc: tuple, data: object) -> list[str]:
    """The field path as the file spells it: without validator names, without the tag a
    discriminated union inserts (`spec.acceptance.rates.rates.0` -> `spec.acceptance.rates.0`)
    and without the member names of a plain union (`cost.model.ModelSpec.hidden`)."""
    out, node, tag = [], data, None
    for p in loc:
        if str(p).startswith("function-"):
            continue
        if isinstance(node, dict) and node.get("kind") == p and tag is not node:
            tag = node  # the union's tag (once per table), not a key of the file
            continue
        if _is_member(p) and not (isinstance(node, dict) and p in node):
            continue
        out.append(str(p))
        node = node[p] if isinstance(node, dict) and p in node else (
            node[p] if isinstance(node, list) and isinstance(p, int) and p < len(node) else None)
    return out


def _is_member(p: object) -> bool:
    """A union member's name in an error's location: a model class or a scalar type."""
    return isinstance(p, str) and (p[:1].isupper() or p in _SCALAR_MEMBERS or "[" in p)


def parse_scenario(data: dict, source: str = "<scenario>") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as e:
        raise ScenarioError(_format_error(source, e, data)) from None


def load_scenario(path: str | Path) -> tuple[Scenario, Path]:
    """Read and validate a scenario file. Returns it and its folder (for relative paths)."""
    p = Path(path)
    data = load_toml(p, "scenario", MAX_SCENARIO_BYTES)
    return parse_scenario(data, str(p)), p.resolve().parent
