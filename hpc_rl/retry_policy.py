"""How hard a request to another process tries before it gives up: the one retry policy.

Owns: the attempt budget and the exponential back-off between attempts (base * 2**(n-1), capped,
plus optional jitter). Used by generation (`rollout.generate`: per sample, transport failures only;
an engine's HTTP error is final) and by the remote reward (`rewards.remote`: per request, any
failure). It does not own what counts as a retryable failure: each caller decides.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """A request fails for good after `max_transport_retries` + 1 failed attempts in a row."""

    max_transport_retries: int = 5
    """Consecutive failed attempts tolerated (the attempt after the last of them is the last)."""
    base_delay_s: float = 0.5
    """First back-off; doubles per consecutive failure."""
    max_delay_s: float = 10.0
    """Longest back-off before jitter."""
    jitter_s: float = 0.0
    """Up to this much uniformly random wait added to each back-off (spreads many clients apart)."""
    max_unrequested_aborts: int = 50
    """Generation only: aborts the session did not ask for, in a row without a new token, before the
    sample fails."""
    no_workers_timeout_s: float = 120.0
    """Generation only: how long the router may answer `no_available_workers` while engines serve
    before the run ends."""

    def __post_init__(self) -> None:
        if self.max_transport_retries < 0:
            raise ValueError(f"max_transport_retries must be >= 0, got {self.max_transport_retries}")
        if min(self.base_delay_s, self.max_delay_s, self.jitter_s) < 0:
            raise ValueError("back-off times must be >= 0")

    @property
    def max_attempts(self) -> int:
        return self.max_transport_retries + 1

    def delay_s(self, failures: int) -> float:
        """Wait after the `failures`-th consecutive failure (1-based)."""
        backoff = min(self.max_delay_s, self.base_delay_s * 2 ** (failures - 1))
        return backoff + (random.uniform(0, self.jitter_s) if self.jitter_s else 0.0)
