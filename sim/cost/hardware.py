"""Model shapes and GPU specs for the roofline, with the public presets, and KV pool sizing.

Shapes are the models' published `config.json` values; GPU numbers are the vendors' datasheet
values for the SXM parts (dense bf16, no sparsity). Memory is the usable device memory in bytes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from sim.numbers import Float, Int


class ModelSpec(BaseModel):
    """A decoder-only transformer with GQA attention and a SwiGLU MLP."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    num_layers: Int = Field(ge=1, le=1024)
    hidden: Int = Field(ge=1, le=1_000_000)
    num_q_heads: Int = Field(ge=1, le=1024)
    num_kv_heads: Int = Field(ge=1, le=1024)
    head_dim: Int = Field(ge=1, le=4096)
    intermediate: Int = Field(ge=1, le=10_000_000)
    vocab: Int = Field(ge=1, le=10_000_000)
    dtype_bytes: Int = Field(default=2, ge=1, le=8)

    def shard(self, tp: int) -> tuple[int, int, int]:
        """(q heads, kv heads, intermediate) held by one of `tp` GPUs; KV heads replicate."""
        return self.num_q_heads // tp, max(1, self.num_kv_heads // tp), self.intermediate // tp

    def linear_params(self, tp: int = 1) -> int:
        """Weights of one layer's linears on one GPU: qkv, o, gate+up, down."""
        qh, kvh, inter = self.shard(tp)
        attn = self.hidden * (qh + 2 * kvh) * self.head_dim + qh * self.head_dim * self.hidden
        return attn + 3 * self.hidden * inter

    def weight_bytes(self, tp: int = 1) -> int:
        """All weights on one GPU: layers, embedding and LM head (vocab-parallel), norms ignored."""
        embed = 2 * self.vocab * self.hidden // tp
        return (self.num_layers * self.linear_params(tp) + embed) * self.dtype_bytes

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """K and V of one token over all layers, on one GPU."""
        return 2 * self.num_layers * self.shard(tp)[1] * self.head_dim * self.dtype_bytes


class GpuSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    mem_bw: Float = Field(gt=0, le=1e16, description="HBM bandwidth, bytes/s")
    flops: Float = Field(gt=0, le=1e18, description="dense bf16 tensor-core FLOP/s")
    mem_bytes: Int = Field(gt=0, le=2**50)
    link_bw: Float = Field(default=450e9, gt=0, le=1e16,
                           description="NVLink per direction, bytes/s")


MODELS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(num_layers=32, hidden=4096, num_q_heads=32, num_kv_heads=8,
                              head_dim=128, intermediate=14336, vocab=128256),
    "llama-3.1-70b": ModelSpec(num_layers=80, hidden=8192, num_q_heads=64, num_kv_heads=8,
                               head_dim=128, intermediate=28672, vocab=128256),
    "qwen2.5-32b": ModelSpec(num_layers=64, hidden=5120, num_q_heads=40, num_kv_heads=8,
                             head_dim=128, intermediate=27648, vocab=152064),
}

GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(mem_bw=3.35e12, flops=989e12, mem_bytes=80 * 10**9, link_bw=450e9),
    "h200": GpuSpec(mem_bw=4.8e12, flops=989e12, mem_bytes=141 * 10**9, link_bw=450e9),
    "a100": GpuSpec(mem_bw=2.039e12, flops=312e12, mem_bytes=80 * 10**9, link_bw=300e9),
}


def resolve_model(model: str | ModelSpec) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if model not in MODELS:
        raise ValueError(f"unknown model preset {model!r}; presets: {', '.join(sorted(MODELS))}")
    return MODELS[model]


def resolve_gpu(gpu: str | GpuSpec) -> GpuSpec:
    if isinstance(gpu, GpuSpec):
        return gpu
    if gpu not in GPUS:
        raise ValueError(f"unknown gpu preset {gpu!r}; presets: {', '.join(sorted(GPUS))}")
    return GPUS[gpu]


def num_blocks_for(model: str | ModelSpec, gpu: str | GpuSpec, tokens_per_block: int,
                   mem_fraction: float = 0.9, tp: int = 1, reserve_bytes: int = 0) -> int:
    """KV blocks that fit on one GPU next to the weights (vLLM's gpu_memory_utilization rule).

    blocks = floor((mem_bytes · mem_fraction − weights − reserve_bytes) / block_bytes), with
    block_bytes = tokens_per_block · kv_bytes_per_token. `reserve_bytes` stands for activations
    and CUDA graphs. Raises ValueError when the weights alone do not fit.
    """
    m, g = resolve_model(model), resolve_gpu(gpu)
    free = int(g.mem_bytes * mem_fraction) - m.weight_bytes(tp) - reserve_bytes
    block = tokens_per_block * m.kv_bytes_per_token(tp)
    if free < block:
        raise ValueError(f"model weights ({m.weight_bytes(tp) / 1e9:.1f} GB per GPU) leave no room "
                         f"for KV in {mem_fraction:.0%} of {g.mem_bytes / 1e9:.0f} GB")
    return free // block
