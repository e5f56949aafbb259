"""Counters of one rollout (or eval) run, flattened to `rollout/<name>` scalars for TensorBoard.

Owns: the request accounting (every rid sent ends in exactly one of: answered, aborted, transport
failure, HTTP error), group outcomes by reason, tokens, and the buffer size. Pure data, no I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class GenerationMetrics:
    """Per-request counters, kept by a `GenerationSession`.

    Invariant (tested): requests_sent == requests_finished + requests_aborted + requests_transport_failed
    + requests_http_failed, once nothing is in flight.
    """

    requests_sent: int = 0
    requests_finished: int = 0
    """Answered with stop/length."""
    requests_aborted: int = 0
    """Answered with finish_reason abort (surplus abort, engine paused for a weight update)."""
    requests_transport_failed: int = 0
    """Connection refused/reset, timeout, 5xx: the sample was resubmitted (or failed after the retries)."""
    requests_http_failed: int = 0
    """4xx: the sample failed."""
    requests_retried: int = 0
    """Resubmissions after a transport failure."""
    requests_resumed: int = 0
    """Resubmissions after an abort the session did not ask for (engine paused/preempted)."""
    samples_failed: int = 0
    generated_tokens: int = 0

    def as_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        return {f"{prefix}{name}": float(value) for name, value in vars(self).items()}


@dataclass
class RolloutMetrics:
    """Group-level outcomes of one `RolloutScheduler.run`."""

    groups_submitted: int = 0
    groups_from_buffer: int = 0
    groups_kept: int = 0
    groups_dropped: Counter[str] = field(default_factory=Counter)
    """reason -> count (filter reasons, "filter", "failed", "surplus", "unfinished", "stale")."""
    groups_to_buffer: int = 0
    samples_stale_reset: int = 0
    prompts_too_long: int = 0
    """Prompts drawn and dropped because they leave no room for a response (rollout_max_prompt_len)."""
    wasted_tokens: int = 0
    """Generated tokens thrown away: dropped groups, unfinished groups without partial rollout, stale resets."""
    kept_response_tokens: int = 0
    buffer_size: int = 0
    """Groups in the partial buffer after the run."""
    wall_time_s: float = 0.0

    def as_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        out: dict[str, float] = {}
        for name, value in vars(self).items():
            if isinstance(value, Counter):
                out[f"{prefix}groups_dropped"] = float(sum(value.values()))
                for reason, count in sorted(value.items()):
                    out[f"{prefix}groups_dropped/{reason}"] = float(count)
            else:
                out[f"{prefix}{name}"] = float(value)
        return out
