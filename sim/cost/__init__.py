"""Step-time model: how long the device takes for a batch, and how long the host takes to build it.

The engine only calls `CostModel.device_ns` and `CostModel.host_ns`; `build_cost_model` turns the
scenario's `[cost]` section into one. `kind = "simple"` is affine in tokens (the default, enough to
make overlap visible); `kind = "roofline"` derives step time from a model shape and a GPU spec,
with attention (and GEMMs) from a measured calibration table when one is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sim.cost.calibration import Calibration, load_calibration
from sim.cost.hardware import (
    GPUS,
    MODELS,
    GpuSpec,
    ModelSpec,
    num_blocks_for,
    resolve_gpu,
    resolve_model,
)
from sim.cost.roofline import RooflineCost
from sim.numbers import Float, Int

__all__ = ["GPUS", "MODELS", "Calibration", "CostConfig", "CostModel", "GpuSpec", "ModelSpec",
           "RooflineCost", "SimpleCost", "build_cost_model", "load_calibration", "num_blocks_for"]


class CostModel(Protocol):
    def device_ns(self, q_lens: np.ndarray, kv_lens: np.ndarray, is_ctx: np.ndarray) -> int:
        """Device time of one forward: rows' query lengths, kernel kv lengths, context flags."""
        ...

    def host_ns(self, num_rows: int, num_tokens: int) -> int:
        """Host time to schedule and build the metadata of one step (what overlap hides)."""
        ...


class CostConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["simple", "roofline"] = "simple"
    # simple: step_base + per token + per KV token read
    step_base_ns: Int = Field(4_000_000, ge=0, le=10**12)
    ns_per_token: Int = Field(20_000, ge=0, le=10**9)
    ns_per_kv_token: Int = Field(20, ge=0, le=10**9)
    # host (both kinds): scheduling + metadata building, hidden by overlap
    host_base_ns: Int = Field(1_500_000, ge=0, le=10**12)
    host_ns_per_row: Int = Field(20_000, ge=0, le=10**9)
    host_ns_per_token: Int = Field(0, ge=0, le=10**9)
    # roofline
    model: str | ModelSpec = "llama-3.1-8b"  # preset name or an inline [cost.model] table
    gpu: str | GpuSpec = "h200"  # preset name or an inline [cost.gpu] table
    tp: Int = Field(1, ge=1, le=64)
    launch_ns: Int = Field(30_000, ge=0, le=10**10)  # fixed per-forward overhead (graph launch)
    bw_efficiency: Float = Field(0.85, gt=0.0, le=1.0)  # achieved / datasheet HBM bandwidth
    flops_efficiency: Float = Field(0.7, gt=0.0, le=1.0)  # achieved / datasheet tensor FLOP/s
    draft_layers: Int = Field(1, ge=0, le=64)  # MTP drafter layers per draft token
    calibration: str = ""  # JSON of measured kernel times; relative to the scenario's folder
    page_size: Int = Field(0, ge=0, le=4096)  # calibration page size to use; 0 = most measured

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | ModelSpec) -> str | ModelSpec:
        resolve_model(v)
        return v

    @field_validator("gpu")
    @classmethod
    def _gpu(cls, v: str | GpuSpec) -> str | GpuSpec:
        resolve_gpu(v)
        return v


class SimpleCost:
    """Affine in tokens and KV read: enough to make overlap visible in the timeline."""

    def __init__(self, cfg: CostConfig) -> None:
        self.cfg = cfg

    def device_ns(self, q_lens: np.ndarray, kv_lens: np.ndarray, is_ctx: np.ndarray) -> int:
        c = self.cfg
        return int(c.step_base_ns + c.ns_per_token * int(q_lens.sum())
                   + c.ns_per_kv_token * int(kv_lens.sum()))

    def host_ns(self, num_rows: int, num_tokens: int) -> int:
        c = self.cfg
        return int(c.host_base_ns + c.host_ns_per_row * num_rows + c.host_ns_per_token * num_tokens)


def build_cost_model(cfg: CostConfig, base_dir: str | Path | None = None) -> CostModel:
    """The cost model of a `[cost]` section. A relative `calibration` path is taken from
    `base_dir` (the scenario's folder) when given, else from the working directory.

    Raises ScenarioError when the calibration file is unreadable or has no entry for the model.
    """
    if cfg.kind == "simple":
        return SimpleCost(cfg)
    model, gpu = resolve_model(cfg.model), resolve_gpu(cfg.gpu)
    calib = None
    if cfg.calibration:
        path = Path(cfg.calibration)
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
        qh, kvh, _ = model.shard(cfg.tp)
        calib = load_calibration(str(path), (qh, kvh, model.head_dim), cfg.page_size)
    return RooflineCost(cfg, model, gpu, calib)
