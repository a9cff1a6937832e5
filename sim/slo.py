"""Service-level objectives: a latency metric, a statistic of it over a run, a bound in ms.

One SLO is named `<metric>_<stat>_ms`, the same name as the metric it bounds in `sim.metrics`
(`ttft_p99_ms = 500`: the run's p99 TTFT must be at most 500 ms). On the command line it reads
`ttft:p99=500ms`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

METRICS = {"ttft": "time to first token", "tpot": "time per output token (after the first)",
           "itl": "inter-token latency", "e2e": "end-to-end latency"}
STATS = ("mean", "p50", "p90", "p99")
ALLOWED = (f"<metric>_<stat>_ms with metric {', '.join(METRICS)} and stat {', '.join(STATS)}")


@dataclass(frozen=True)
class Target:
    metric: str  # one of METRICS
    stat: str  # one of STATS
    ms: float  # the bound: the statistic must be at most this

    @property
    def key(self) -> str:
        """The metric this bounds, and the SLO's own name in a sweep file."""
        return f"{self.metric}_{self.stat}_ms"

    def __str__(self) -> str:
        return f"{self.metric.upper()} {self.stat} ≤ {self.ms:g} ms"

    def met(self, metrics: dict) -> bool:
        """Whether a run's metrics meet this bound (NaN, e.g. no finished request, does not)."""
        v = float(metrics.get(self.key, math.nan))  # not measured (ITL without rows): not met
        return not math.isnan(v) and v <= self.ms


def split_key(key: str) -> tuple[str, str]:
    """`ttft_p99_ms` → ("ttft", "p99"). Raises ValueError saying what is allowed."""
    metric, _, rest = key.partition("_")
    stat, _, unit = rest.partition("_")
    if metric not in METRICS or stat not in STATS or unit != "ms":
        raise ValueError(f"{ALLOWED} (got {key!r})")
    return metric, stat


MAX_MS = 1e9  # an SLO of more than eleven days is a typo


def check_bound(ms: object) -> float:
    """A bound is a finite number of ms above 0 and at most MAX_MS (not a boolean)."""
    if isinstance(ms, bool) or not isinstance(ms, int | float) or not 0 < ms < math.inf:
        raise ValueError(f"a bound in ms, a finite number > 0 (got {ms!r})")
    if ms > MAX_MS:
        raise ValueError(f"a bound in ms, at most {MAX_MS:g} (got {ms!r})")
    return float(ms)


_FLAG = re.compile(r"\s*(\w+)\s*:\s*(\w+)\s*=\s*([^\s]+?)\s*(ms)?\s*")


def parse_flag(text: str) -> Target:
    """`ttft:p99=200ms` (the `ms` is optional) → Target. Raises ValueError naming what is
    allowed."""
    m = _FLAG.fullmatch(text)
    if m is None:
        raise ValueError(f"METRIC:STAT=MS, e.g. ttft:p99=200ms (got {text!r})")
    metric, stat, ms = m.group(1), m.group(2), m.group(3)
    split_key(f"{metric}_{stat}_ms")
    try:
        value = float(ms)
    except ValueError:
        raise ValueError(f"a bound in ms, a finite number > 0 (got {ms!r})") from None
    return Target(metric, stat, check_bound(value))


def targets(slo: dict[str, float]) -> list[Target]:
    """The targets of a `{key: ms}` mapping (keys already validated)."""
    return [Target(*split_key(k), float(v)) for k, v in slo.items()]
