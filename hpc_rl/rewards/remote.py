"""The `remote_rm` reward: POST each sample to a reward server, retrying with exponential backoff.

Owns: the request body (`{"prompt", "response", "label"}`, as slime sends it), the retry policy
(up to `max_retries` attempts; wait `min(base * 2**attempt, cap)` plus up to `base` of jitter, so
1 s, 2 s, 4 s ... capped at 30 s by default, like slime) and decoding the server's JSON answer.
It does not own the HTTP session (the caller opens one `aiohttp.ClientSession` per batch and
passes it in) nor the conversion of the answer to a float.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached, kept failing, or answered something unusable."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    max_retries: int = 10
    """Attempts in total (slime: 10)."""
    backoff_base_s: float = 1.0
    """First wait; doubles per attempt; also the maximum jitter added."""
    backoff_cap_s: float = 30.0
    """Longest wait before jitter."""

    def __post_init__(self) -> None:
        if self.max_retries < 1:
            raise ValueError(f"max_retries must be >= 1, got {self.max_retries}")
        if self.backoff_base_s < 0 or self.backoff_cap_s < 0:
            raise ValueError("backoff times must be >= 0")

    def delay_s(self, attempt: int) -> float:
        """Wait after failed attempt number `attempt` (0-based)."""
        return min(self.backoff_base_s * 2**attempt, self.backoff_cap_s) + random.uniform(
            0, self.backoff_base_s
        )


def reward_payload(prompt: Any, response: str, label: Any) -> dict[str, Any]:
    return {"prompt": prompt, "response": response, "label": label}


async def post_for_reward(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], policy: RetryPolicy = RetryPolicy()
) -> Any:
    """POST `payload` to `url` as JSON and return the decoded JSON answer, retrying on failure.

    Retried: connection errors, timeouts, HTTP error statuses, bodies that are not JSON.
    After the last attempt a RemoteRewardError carries the last cause.
    """
    for attempt in range(policy.max_retries):
        try:
            async with session.post(url, json=payload) as response:
                response.raise_for_status()
                return await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            cause = f"{type(error).__name__}: {error}"
            if attempt + 1 >= policy.max_retries:
                raise RemoteRewardError(
                    f"POST {url} failed after {attempt + 1} attempt(s); last error {cause}"
                ) from error
            delay = policy.delay_s(attempt)
            logger.info("remote_rm: %s, retry %d/%d in %.2fs", cause, attempt + 1, policy.max_retries, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises
