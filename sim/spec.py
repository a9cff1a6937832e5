"""MTP acceptance: how many of a step's drafts the target accepts (device truth, seeded)."""

from __future__ import annotations

import numpy as np

from sim.config import ForcedAcceptance, RateAcceptance


class Acceptance:
    def __init__(self, cfg: ForcedAcceptance | RateAcceptance, rng: np.random.Generator) -> None:
        self.cfg = cfg
        self.rng = rng
        self.rates = list(cfg.rates) if isinstance(cfg, RateAcceptance) else []
        self._u: list[float] = []  # uniforms drawn in blocks: one numpy call per 64k drafts

    def _uniform(self) -> float:
        if not self._u:
            self._u = self.rng.random(1 << 16).tolist()[::-1]
        return self._u.pop()

    def request_scale(self) -> float:
        if isinstance(self.cfg, RateAcceptance):
            lo, hi = self.cfg.request_multiplier
            return float(self.rng.uniform(lo, hi)) if hi > lo else lo
        return 1.0

    def accepted(self, draft_len: int, gen_index: int, scale: float) -> int:
        """Drafts accepted out of `draft_len` for a request's `gen_index`-th generation step."""
        if draft_len == 0:
            return 0
        cfg = self.cfg
        if isinstance(cfg, ForcedAcceptance):
            return min(cfg.accepted[gen_index % len(cfg.accepted)], draft_len)
        # Conditional per position: draft i is accepted with rates[i] given all before it were.
        rates = self.rates
        for i in range(draft_len):
            if i >= len(rates) or not self._uniform() < min(rates[i] * scale, 1.0):
                return i
        return draft_len
