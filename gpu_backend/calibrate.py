"""`kvsim calibrate`: FlashInfer attention and bf16 GEMM times on this GPU, for the cost model.

Method: CUDA events around a block of launches after warm-up,
median over blocks, per-launch microseconds. Attention inputs: Llama-3.1-8B heads (32 q, 8 kv,
d 128), bf16, NHD, each request's pages contiguous and full except the last. GEMM: torch.matmul
bf16 [m, k] @ [k, n] for the model's projection shapes.
"""

from __future__ import annotations

import datetime as dt
import itertools
import platform
import subprocess
import sys
from typing import Any

import torch

HEADS = (32, 8, 128)  # Llama-3.1-8B: num_q_heads, num_kv_heads, head_dim
GEMM_NK = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
FULL: dict[str, Any] = {
        "batch": (1, 8, 32, 64, 128, 256), "kv": (512, 2048, 8192, 32768), "page": (16, 32, 64),
        "verify_q": (2, 3, 4), "prefill": ((1, 512), (1, 2048), (4, 512), (16, 128)),
        "gemm_m": (1, 8, 32, 64, 128, 256, 512, 1024, 4096, 16384)}
QUICK: dict[str, Any] = {"batch": (1, 64), "kv": (2048,), "page": (16,), "verify_q": (4,),
         "prefill": ((1, 512),), "gemm_m": (64, 4096)}
MAX_KV_TOKENS = 1 << 21  # skip grid points whose cache would exceed 2M tokens (8 GiB at 8x128)


def _time_us(fn: Any, warmup: int = 3, blocks: int = 7, per_block: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(blocks):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per_block):
            fn()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) * 1000.0 / per_block)
    return sorted(times)[len(times) // 2]


def _attention_point(fi: Any, ws: torch.Tensor, kind: str, batch: int, kv: int, q_len: int,
                     page: int) -> float:
    hq, hkv, d = HEADS
    nb = -(-kv // page)
    cache = torch.randn(batch * nb, 2, page, hkv, d, dtype=torch.bfloat16, device="cuda")
    indptr = torch.arange(batch + 1, dtype=torch.int32) * nb
    indices = torch.arange(batch * nb, dtype=torch.int32, device="cuda")
    lpl = torch.full((batch,), kv - (nb - 1) * page, dtype=torch.int32)
    q = torch.randn(batch * q_len, hq, d, dtype=torch.bfloat16, device="cuda")
    if kind == "decode":
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indices, lpl, hq, hkv, d, page, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16)
    else:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        qo = torch.arange(batch + 1, dtype=torch.int32) * q_len
        w.plan(qo, indptr, indices, lpl, hq, hkv, d, page, causal=True,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return _time_us(lambda: w.run(q, cache))


def _grid(g: dict[str, Any]) -> list[tuple[str, int, int, int, int]]:
    pts = [("decode", b, kv, 1, p)
           for b, kv, p in itertools.product(g["batch"], g["kv"], g["page"])]
    pts += [("verify", b, kv, q, p) for b, kv, q, p in
            itertools.product(g["batch"], g["kv"], g["verify_q"], g["page"])]
    pts += [("prefill", b, kv, q, p) for (b, q), kv, p in
            itertools.product(g["prefill"], g["kv"], g["page"]) if q <= kv]
    return [pt for pt in pts if pt[1] * pt[2] <= MAX_KV_TOKENS]


def measure(quick: bool, log: Any = print, checkpoint: Any = None) -> dict[str, Any]:
    """Run the grid (GEMMs first, they are quick); `checkpoint(profile)` gets the partial
    profile every 16 attention points, so a run cut short still leaves a usable table."""
    import flashinfer

    g = QUICK if quick else FULL
    cmd = "kvsim " + " ".join(sys.argv[1:])
    prof: dict[str, Any] = {"meta": meta(cmd), "attention": [], "gemm": []}
    for m, nk in itertools.product(g["gemm_m"], GEMM_NK):
        n, k = nk
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
        us = _time_us(lambda: x @ w)  # noqa: B023
        prof["gemm"].append({"m": m, "n": n, "k": k, "us": round(us, 2)})
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    hq, hkv, d = HEADS
    for kind, b, kv, q, p in _grid(g):
        us = _attention_point(flashinfer, ws, kind, b, kv, q, p)
        prof["attention"].append({"kind": kind, "batch": b, "kv_len": kv, "q_len": q,
                                  "page_size": p, "num_q_heads": hq, "num_kv_heads": hkv,
                                  "head_dim": d, "us": round(us, 2)})
        log(f"{kind} b={b} kv={kv} q={q} page={p}: {us:.1f} us")
        if checkpoint and len(prof["attention"]) % 16 == 0:
            checkpoint(prof)
    return prof


def meta(command: str) -> dict[str, Any]:
    import flashinfer

    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        drv = "unknown"
    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "driver": drv, "torch": torch.__version__,
            "flashinfer": flashinfer.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "command": command}
