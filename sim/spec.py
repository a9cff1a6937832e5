"""MTP acceptance: how many of a step's drafts the target accepts (device truth, seeded)."""

from __future__ import annotations

import numpy as np

from sim.config import ForcedAcceptance, RateAcceptance


class Acceptance:
    def __init__(self, cfg: ForcedAcceptance | RateAcceptance, rng: np.random.Generator) -> None:
        self.cfg = cfg
        self.rng = rng

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
        rates = np.minimum(np.asarray(cfg.rates[:draft_len]) * scale, 1.0)
        if len(rates) < draft_len:
            rates = np.concatenate([rates, np.zeros(draft_len - len(rates))])
        ok = self.rng.random(draft_len) < rates
        return draft_len if ok.all() else int(np.argmin(ok))
