"""kvsim's side of the vLLM adapter: scenario -> payload, run the driver, read its steps.

The driver (sim/engines/vllm_driver.py) runs in vLLM's own virtualenv, `.venv-vllm` at the
repository root (`make vllm-env`), so vLLM and its pins never enter kvsim's install. This
module speaks to it in JSON: one payload in, one JSON object per step out.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from sim.config import Scenario
from sim.errors import KvsimError, ScenarioError
from sim.spec import Acceptance
from sim.workload import iter_workload

PINNED = "0.33.0"
MAKE_TARGET = "make vllm-env"
DRIVER = Path(__file__).with_name("vllm_driver.py")
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 32000  # output token ids are drawn below it, as the reference engine draws them


class VllmEnvError(KvsimError):
    """vLLM's environment is missing or is not the pinned version."""


def vllm_python() -> Path:
    """The interpreter of vLLM's virtualenv: $KVSIM_VLLM_PYTHON, else .venv-vllm's."""
    env = os.environ.get("KVSIM_VLLM_PYTHON")
    return Path(env) if env else ROOT / ".venv-vllm" / "bin" / "python"


def refuse_unsupported(sc: Scenario, where: str, profile: str | None = None) -> None:
    """A scenario feature vLLM's engine does not have is bad input: name the field."""
    name = profile or sc.profile
    if name != "vllm-v1":
        field = "--profile" if profile else "profile"
        raise ScenarioError(f"{where}: {field}: the vLLM engine runs only profile 'vllm-v1' "
                            f"(got {name!r})")
    if sc.switches:
        first = sorted(sc.switches)[0]
        raise ScenarioError(f"{where}: switches.{first}: kvsim's behaviour switches model other "
                            "engines; the real vLLM takes none (remove [switches])")
    if sc.cache.reuse not in ("off", "full"):
        raise ScenarioError(f"{where}: cache.reuse: vLLM reuses whole blocks only: 'off' or "
                            f"'full' (got {sc.cache.reuse!r})")
    if sc.spec.extra_kv_tokens:
        raise ScenarioError(f"{where}: spec.extra_kv_tokens: vLLM keeps draft KV in its own "
                            f"cache group: 0 (got {sc.spec.extra_kv_tokens})")
    if sc.spec.runtime_draft_lens:
        raise ScenarioError(f"{where}: spec.runtime_draft_lens: vLLM drafts "
                            "num_speculative_tokens every step: [] (got "
                            f"{sc.spec.runtime_draft_lens})")
    if "policy" in sc.scheduler.model_fields_set:
        raise ScenarioError(f"{where}: scheduler.policy: a TensorRT-LLM capacity policy; vLLM "
                            "has its own (preempt from the running tail): remove it (got "
                            f"{sc.scheduler.policy!r})")
    _refuse_budgets(sc, where)
    if sc.overlap.enabled:
        raise ScenarioError(f"{where}: overlap.enabled: the adapter drives vLLM's synchronous "
                            "engine step (async scheduling is not driven yet): false (got true)")


def _refuse_budgets(sc: Scenario, where: str) -> None:
    """What vLLM's SchedulerConfig refuses (vllm/config/scheduler.py `verify_max_model_len`)."""
    s = sc.scheduler
    if s.max_num_tokens < s.max_batch_size:
        raise ScenarioError(f"{where}: scheduler.max_num_tokens: vLLM needs at least "
                            f"scheduler.max_batch_size ({s.max_batch_size}) (got "
                            f"{s.max_num_tokens})")
    step = 1 + sc.spec.depth
    if 0 < s.chunk_size < step and sc.spec.depth:
        # docs/vllm.md: a request admitted with one token left is padded to a whole
        # speculative step, which this threshold then cuts: `Scheduler.schedule` asserts
        raise ScenarioError(f"{where}: scheduler.chunk_size: vLLM 0.33.0 fails an assertion "
                            f"when it is below one speculative step, 1 + spec.max_draft_len "
                            f"({step}): 0 or at least {step} (got {s.chunk_size})")
    if s.chunk_size > sc.limits.max_seq_len:
        raise ScenarioError(f"{where}: scheduler.chunk_size: vLLM's long_prefill_token_threshold "
                            f"is at most limits.max_seq_len ({sc.limits.max_seq_len}) (got "
                            f"{s.chunk_size})")


def payload(sc: Scenario, base_dir: Path | None = None, max_steps: int = 0,
            where: str = "scenario") -> dict:
    """What the driver needs: vLLM's config from the scenario, and every request with its
    true output tokens and its planned draft acceptance per generation step (seeded as the
    reference engine seeds them: sim/engine.py, sim/executor/process.py)."""
    seeds = np.random.SeedSequence(sc.seed).spawn(3)
    acc = Acceptance(sc.spec.acceptance, np.random.default_rng(seeds[0]))
    tok_rng = np.random.default_rng(seeds[1])
    k = sc.spec.depth
    rng = np.random.default_rng(np.random.SeedSequence(sc.seed).spawn(4)[3])
    reqs = []
    for spec in iter_workload(sc.workload, rng, tokens_per_block=sc.cache.tokens_per_block,
                              base_dir=base_dir):
        # room for the last step's bonus token and a full set of drafts past max_tokens
        outs = tok_rng.integers(0, VOCAB, size=spec.output_len + k + 2, dtype=np.int32)
        scale = acc.request_scale()
        plan = [acc.accepted(k, i, scale) for i in range(spec.output_len)] if k else []
        reqs.append({"id": spec.rid, "arrival_ns": spec.arrival_ns,
                     "prompt": spec.prompt.tolist(), "output": outs.tolist(),
                     "output_len": spec.output_len, "accept": plan})
    c = sc.cost
    return {
        "block_size": sc.cache.tokens_per_block, "num_blocks": sc.cache.num_blocks,
        "prefix_caching": sc.cache.reuse == "full",
        "max_num_seqs": sc.scheduler.max_batch_size,
        "max_num_batched_tokens": sc.scheduler.max_num_tokens,
        # vLLM's nearest knob to a chunk size: it caps one prefill's share of a step
        "long_prefill_token_threshold": sc.scheduler.chunk_size,
        "max_model_len": sc.limits.max_seq_len,
        "max_position_embeddings": sc.model.max_position_embeddings,
        "num_spec_tokens": k,
        "eagle_block_drop": sc.spec.eagle_block_drop,
        # when the engine calls Scheduler.reset_prefix_cache()
        "reset_prefix_cache_ns": sorted(sc.cache.reset_prefix_cache_ns),
        # the simple cost model's coefficients (sim/cost: SimpleCost) time the steps
        "dev_ns": [c.step_base_ns, c.ns_per_token, c.ns_per_kv_token],
        "host_ns": [c.host_base_ns, c.host_ns_per_row],
        "max_steps": max_steps or _step_bound(reqs),
        "where": where,  # the scenario's file, for messages
        "requests": reqs,
    }


def _step_bound(reqs: list[dict]) -> int:
    """Every step that runs computes at least one token, and a request is recomputed whole
    at most once per preemption: a generous bound that still ends a stuck run."""
    return 4 * sum(len(r["prompt"]) + r["output_len"] for r in reqs) + 16


class VllmSession:
    """One driver process that runs any number of payloads, each on a fresh scheduler: vLLM's
    imports are paid once, not per workload. Use as a context manager; `run` may be called
    again after an earlier run ended, was refused or failed.

    Raises VllmEnvError (at start) when .venv-vllm is missing or holds another vLLM version.
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.err: deque[str] = deque(maxlen=40)  # the driver's stderr tail, for messages
        self.runs = 0

    def __enter__(self) -> VllmSession:
        self._start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        py = vllm_python()
        if not py.exists():
            raise VllmEnvError(f"{py}: no vLLM environment; build it with `{MAKE_TARGET}`")
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CONFIGURE_LOGGING="0",
                   TOKENIZERS_PARALLELISM="false")
        self.proc = proc = subprocess.Popen(
            [str(py), str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=env, text=True)
        threading.Thread(target=lambda: self.err.extend(proc.stderr),  # type: ignore[arg-type]
                         daemon=True).start()
        assert proc.stdout is not None
        head = json.loads(proc.stdout.readline() or "{}")
        if head.get("vllm") != PINNED:
            self.close()
            if not head:
                raise self._failed()
            raise VllmEnvError(f"{vllm_python()}: vllm {head.get('vllm')} is installed; the "
                               f"adapter is pinned to {PINNED} (rebuild with `{MAKE_TARGET}`)")

    def run(self, p: dict) -> Iterator[dict]:
        """Run payload `p`; yield its step objects, then its requests object.

        Raises ScenarioError when vLLM will not start with the payload's pool, and KvsimError
        when vLLM raised or the driver died (its last lines in the message). A reader that
        stops early ends the process; the next run starts a new one.
        """
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        self.runs += 1
        done = False
        try:
            proc.stdin.write(json.dumps(p, separators=(",", ":")) + "\n")
            proc.stdin.flush()
            for line in proc.stdout:
                obj = json.loads(line)
                done = "requests" in obj or "refused" in obj or "error" in obj
                _raise_for(obj, p)
                yield obj
                if done:
                    return
        except BrokenPipeError:  # the driver died: its stderr says why
            pass
        finally:
            if not done:  # an error, ^C, or a reader that stopped mid-run
                self.close(kill=True)
        raise self._failed()

    def _failed(self) -> KvsimError:
        tail = "".join(list(self.err)[-5:]).strip()
        return KvsimError(f"{DRIVER.name}: the vLLM driver died: {tail}")

    def close(self, kill: bool = False) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()  # EOF: the driver's loop ends
            except BrokenPipeError:
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _raise_for(obj: dict, p: dict) -> None:
    if "refused" in obj:  # vLLM's own start-up check said no: the scenario's pool
        raise ScenarioError(f"{p.get('where', 'scenario')}: cache.num_blocks: vLLM does "
                            f"not start: {obj['refused']} (limits.max_seq_len "
                            f"{p['max_model_len']}, got {p['num_blocks']} blocks)")
    if "error" in obj:
        raise KvsimError(f"{DRIVER.name}: vLLM raised on {p.get('where', 'scenario')}: "
                         f"{_where_raised(obj['error'])}")


def _where_raised(tb: str) -> str:
    """'AssertionError at vllm/v1/core/sched/scheduler.py:1579 in schedule' from a traceback:
    the exception and the innermost frame, where the fault is."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb)
    what = tb.strip().splitlines()[-1]
    if not frames:
        return what
    path, line, fn = frames[-1]
    return f"{what} at {path.split('site-packages/')[-1]}:{line} in {fn}"


def run_driver(p: dict) -> Iterator[dict]:
    """Run payload `p` in a driver process of its own (see VllmSession.run)."""
    with VllmSession() as s:
        yield from s.run(p)
