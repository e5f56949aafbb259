"""On-policy distillation's teacher server, from the rollout side: its log-probs of each sample's response.

Owns `TeacherLogprobs`: one batched `/generate` per group to the teacher SGLang server, prefill only
(`max_new_tokens` 0, `return_logprob`, `logprob_start_len` 0, the rollout temperature: slime's OPD reward
payload), reading `meta_info.input_token_logprobs[1:]` (token t's log-prob given the tokens before it; the
first token has none) and keeping the last `response_length` of them in `sample.teacher_logprobs`, as slime's
`post_process_rewards` does. Transport failures are retried (`retry_policy`); an HTTP error or a wrong
count fails the group. The teacher is either a component of the job (the driver starts it, behind the job's
engine key) or slime's `--rm-url` server. Also `distillation_reward` and `distillation_post_process`, what
slime's OPD reward function and post-process become: the task reward slime's post-process returns, 0.0.

Not here: the penalty (`training.advantages.opd_penalized_advantages`), starting the teacher (`launch.driver`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import urlsplit

from hpc_rl.data.samples import Sample
from hpc_rl.protocol.http_client import EngineConnection, EngineHTTPTransportError
from hpc_rl.retry_policy import RetryPolicy

log = logging.getLogger(__name__)

TEACHER_RETRY = RetryPolicy(max_transport_retries=5, base_delay_s=0.5, max_delay_s=8.0)


async def distillation_reward(args: Any, sample: Sample, **kwargs: Any) -> float:
    """slime's OPD reward (slime.rollout.on_policy_distillation.reward_func + post_process_rewards) as hpc_rl
    runs it: the teacher's log-probs are fetched by `TeacherLogprobs`; the task reward is 0.0, as slime's."""
    return 0.0


def distillation_post_process(args: Any, samples: list[Sample], **kwargs: Any) -> tuple[list[float], list[float]]:
    """slime's OPD post-process (slime.rollout.on_policy_distillation.post_process_rewards) as hpc_rl runs it:
    raw and trained rewards 0.0 for every sample (the teacher's log-probs are on the samples already)."""
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)


class TeacherError(RuntimeError):
    """The teacher server did not give the log-probs of a group."""


def generate_url(url: str) -> tuple[str, str]:
    """(base URL, path) of a teacher's /generate (slime's --rm-url is the whole /generate URL)."""
    parts = urlsplit(url)
    path = parts.path if parts.path not in ("", "/") else "/generate"
    return f"{parts.scheme}://{parts.netloc}", path


def response_logprobs(result: dict[str, Any], sample: Sample, url: str = "the teacher") -> list[float]:
    """The teacher's log-probs of `sample`'s response tokens, from one /generate result of its whole token list
    (`input_token_logprobs` entries are [logprob, token id, ...]; the first token's logprob is None)."""
    entries = (result.get("meta_info") or {}).get("input_token_logprobs") or []
    if len(entries) != sample.total_length:
        raise TeacherError(f"{url}: {len(entries)} input log-probs for sample {sample.index} of "
                           f"{sample.total_length} tokens")
    return [float(entry[0]) for entry in entries[len(entries) - sample.response_length:]]


class TeacherLogprobs:
    """`await score(samples)`: sets each sample's `teacher_logprobs` (one batched request per call)."""

    def __init__(self, url: str, *, api_key: str | None, temperature: float, timeout_s: float,
                 retry: RetryPolicy = TEACHER_RETRY) -> None:
        base, self.path = generate_url(url)
        self.url = base + self.path
        self.connection = EngineConnection(base, api_key=api_key, connecting=asyncio.Semaphore(8))
        self.temperature, self.timeout_s, self.retry = temperature, timeout_s, retry

    def payload(self, samples: list[Sample]) -> bytes:
        return json.dumps({
            "input_ids": [s.prompt_token_ids + s.response_token_ids for s in samples],
            "sampling_params": {"temperature": self.temperature, "max_new_tokens": 0, "skip_special_tokens": False},
            "return_logprob": True, "logprob_start_len": 0}).encode()

    async def score(self, samples: list[Sample]) -> None:
        if not samples:
            return
        body = self.payload(samples)
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                status, answer = await self.connection.request("POST", self.path, body, self.timeout_s)
                break
            except EngineHTTPTransportError as error:
                if attempt == self.retry.max_attempts:
                    raise TeacherError(f"teacher {self.url} unreachable after {attempt} attempts: {error}") from error
                log.warning("teacher %s: %s; retrying", self.url, error)
                await asyncio.sleep(self.retry.delay_s(attempt))
        if status != 200:
            raise TeacherError(f"teacher {self.url} answered {status}: {answer[:300]!r}")
        results = json.loads(answer)
        results = results if isinstance(results, list) else [results]
        if len(results) != len(samples):
            raise TeacherError(f"teacher {self.url} answered {len(results)} results for {len(samples)} samples")
        for sample, result in zip(samples, results):
            sample.teacher_logprobs = response_logprobs(result, sample, self.url)

    def close(self) -> None:
        self.connection.close()
