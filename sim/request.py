"""A request's mutable state: host view (what the scheduler knows) next to device truth."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class State(IntEnum):
    WAITING = 0
    CONTEXT = 1  # prefill chunks still to launch
    GENERATION = 2
    FINISHED = 3


@dataclass(slots=True)
class Request:
    rid: int
    arrival_ns: int
    prompt_len: int
    output_len: int
    # prompt + every output token this request will ever produce (true sequence), + slack.
    tokens: np.ndarray
    accept_scale: float = 1.0
    state: State = State.WAITING
    prefill_len: int = 0  # tokens to prefill (prompt, or prompt + outputs after a recompute)
    ctx_pos: int = 0  # prefill cursor (launched), starts at the reused length
    committed: int = 0  # device truth: slots holding accepted tokens
    n_host: int = 0  # N: tokens the host knows (prompt + processed outputs)
    inflight: list[int] = field(default_factory=list)  # steps launched, not yet processed
    # steps launched before a preemption whose results belong to the old admission (only when
    # a faulty profile frees and requeues a request while a step of it is in flight)
    discard: set[int] = field(default_factory=set)
    last_ctx_step: int = -1  # step of the final context chunk
    prev_new_tokens: int = -1  # device truth of the last launched step's committed tokens
    gen_steps: int = 0
    finished: bool = False  # host decided it is done (blocks may wait for in-flight steps)
    freed: bool = False
    pausing: bool = False
    reused_tokens: int = 0
    first_token_ns: int = -1
    finish_ns: int = -1
    finish_reason: str = "unfinished"
    num_preemptions: int = 0
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    late_finish: bool = False
    tokens_blocks: tuple[int, ...] = ()  # blocks held when freed (for the double-free fault)

    @property
    def outputs_done(self) -> int:
        return max(0, self.n_host - self.prompt_len)

    def outputs_done_at_admit(self) -> int:
        """Outputs already folded into prefill_len by a recompute (0 on first admission)."""
        return self.prefill_len - self.prompt_len
