"""`kvsim run` under profile `vllm-v1`: kvsim's model of vLLM (sim/vllm_engine.py), written
through the converter the real vLLM's trace goes through (sim/engines/vllm_trace.py).

The profile is not a set of switches on kvsim's TensorRT-LLM engine: it has its own scheduler
and KV manager, and the TensorRT-LLM engines (sim/engine.py, sim/fast) never run it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from sim.config import Scenario
from sim.engines.vllm import payload, refuse_unsupported
from sim.engines.vllm_trace import Converter, request_records
from sim.errors import ProfileError, ScenarioError
from sim.trace.records import TOTALS, count_request
from sim.vllm_engine import VllmRun

PROFILE = "vllm-v1"


def is_vllm_model(name: str, switches: dict | None, engine: str) -> bool:
    """Whether profile `name` runs the vLLM model; refuses what that model cannot take."""
    base, *faults = name.split("+")
    if base != PROFILE:
        return False
    if faults or switches:
        what = f"fault {faults[0]!r}" if faults else f"switch {sorted(switches or {})[0]!r}"
        raise ProfileError(f"profile {name!r}: {what} is a switch of kvsim's TensorRT-LLM "
                           f"engine; profile {PROFILE} runs kvsim's model of vLLM's own "
                           "scheduler, which takes none")
    if engine == "fast":
        raise ScenarioError(f"--engine fast: profile {PROFILE} runs kvsim's model of vLLM's "
                            "scheduler, which the fast engine does not have: use --engine "
                            "auto or reference")
    if engine not in ("auto", "reference"):
        raise ScenarioError(f"engine must be auto, fast or reference, not {engine!r}")
    return True


def run_vllm_model(sc: Scenario, base_dir: Path | None,
                   sink: Callable[..., None]) -> tuple[dict, int, int, int]:
    """Run `sc` through the vLLM model into `sink` (sim/api.py `_Sink`): every step, then every
    request. Returns (totals, steps, usable blocks, end time) as `run` summarises them."""
    refuse_unsupported(sc, "scenario", PROFILE)
    _refuse_small_pool(sc)
    p = payload(sc, base_dir)
    B = sc.cache.tokens_per_block
    conv = Converter(B, sc.cache.num_blocks,
                     min(sc.model.max_position_embeddings, sc.blocks_per_seq * B))
    final: dict = {}
    steps = now = gen_steps = 0
    for step, rows, events in conv.steps(_steps(VllmRun(p).run(), final)):
        sink(step, rows, events)
        steps, now = steps + 1, step.t_dev_end_ns
        gen_steps += sum(r.phase == "gen" for r in rows)
    totals = dict.fromkeys(TOTALS, 0) | {"gen_steps": gen_steps}
    for rec in request_records(p, final):
        sink.on_request(rec)  # type: ignore[attr-defined]
        count_request(totals, rec)
    return totals, steps, sc.cache.num_blocks - 1, now


def _refuse_small_pool(sc: Scenario) -> None:
    """vLLM's engine does not start when one request of max_model_len cannot fit the pool less
    its null block (kv_cache_planning.py `check_enough_kv_cache_memory`; the driver's check)."""
    need = -(-sc.limits.max_seq_len // sc.cache.tokens_per_block)
    have = sc.cache.num_blocks - 1
    if need > have:
        raise ScenarioError(f"scenario: cache.num_blocks: vLLM does not start: one request of "
                            f"max_model_len {sc.limits.max_seq_len} needs {need} blocks and the "
                            f"pool has {have} besides the null block (got "
                            f"{sc.cache.num_blocks} blocks)")


def _steps(objs: Iterator[dict], final: dict) -> Iterator[dict]:
    """The step objects; the last one (the requests report) goes to `final`."""
    for o in objs:
        if "requests" in o:
            final.update(o)
        else:
            yield o
