"""The `remote_rm` reward: POST each sample to a reward server, retrying with exponential backoff.

Owns: the request body (`{"prompt", "response", "label"}`, as slime sends it), the default retry
budget (`REMOTE_RM_RETRY`, slime's; the policy itself is `hpc_rl.retry_policy`'s), decoding the
server's JSON answer, and the HTTP session (`reward_session`; the caller opens one per batch and passes
it in), so aiohttp is imported here only, when a session is opened (a run without remote rewards never
imports it: a quarter second of the driver's start-up). Not the conversion of the answer to a float.

Why aiohttp here and not hpc_rl.protocol.http_client (the one client for engines and the router): the
reward server is the user's, outside the job, often behind https, a proxy or redirects, which that
plain-HTTP client does not speak; it is called once per sample, so its client cost does not matter.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from hpc_rl.retry_policy import RetryPolicy

if TYPE_CHECKING:
    from aiohttp import ClientSession as RewardSession

logger = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """The reward server could not be reached, kept failing, or answered something unusable."""


REMOTE_RM_RETRY = RetryPolicy(max_transport_retries=9, base_delay_s=1.0, max_delay_s=30.0, jitter_s=1.0)
"""slime's: 10 attempts; 1 s, 2 s, 4 s ... capped at 30 s, plus up to 1 s of jitter."""


def reward_session(timeout_s: float, proxy: str | None = None) -> RewardSession:
    """The session for one batch of `post_for_reward` calls; `timeout_s` bounds each call (all its reads);
    every call goes through `proxy` when given (slime's --http-proxy)."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), proxy=proxy)


def reward_payload(prompt: Any, response: str, label: Any) -> dict[str, Any]:
    return {"prompt": prompt, "response": response, "label": label}


async def post_for_reward(
    session: RewardSession, url: str, payload: dict[str, Any], policy: RetryPolicy = REMOTE_RM_RETRY
) -> Any:
    """POST `payload` to `url` as JSON and return the decoded JSON answer, retrying on failure.

    Retried: connection errors, timeouts, HTTP error statuses, bodies that are not JSON.
    After the last attempt a RemoteRewardError carries the last cause.
    """
    import aiohttp  # imported already: `session` is one

    for attempt in range(policy.max_attempts):
        try:
            async with session.post(url, json=payload) as response:
                response.raise_for_status()
                return await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            cause = f"{type(error).__name__}: {error}"
            if attempt + 1 >= policy.max_attempts:
                raise RemoteRewardError(
                    f"POST {url} failed after {attempt + 1} attempt(s); last error {cause}"
                ) from error
            delay = policy.delay_s(attempt + 1)
            logger.info("remote_rm: %s, retry %d/%d in %.2fs", cause, attempt + 1, policy.max_transport_retries, delay)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises
