"""Rule rewards computed in the answer workers: which exchanges ask for one, and how it travels.

With `rollout.answer_parse_workers` > 0 and a run whose reward is not a custom function, each single-turn sample
of the built-in generate function (`default_generate`) asks the worker that makes its /generate exchange to score
the answer's text too (hpc_rl.rewards.worker_scored: what is sent, the scoring, when the reward may be used):

    generate_turn                 reward_request(client, sample)     {"rm_type", "label"} or None
      -> EngineClient.generate(..., reward_request=...)              per item of a batched request
      -> AnswerPool.post(..., score={"rids": [...], "requests": [...]})   in the frame header to the worker
    worker: attach_rewards(answer, score)                           each answer dict gets REWARD_FIELD:
                                                                    {"rid", "reward", "give_ups"} or {"rid", "error"}
    generate_turn                 keep_reward(rewards, sample, request, answer, rid, text)   for group.py

Asked only where the answer's text is the whole response: the sample had no response text before the exchange
(not a resumed partial sample), and it is the built-in single-turn generate (a custom generate function's turn
is never scored there: multi-turn, tool output). A reward is used only if it still provably applies when the
group is scored (worker_scored.WorkerRewards.precomputed); otherwise the controller scores the sample as before.

The worker matches answers to requests as the controller does (request_batching.split_answer) and each record
names its rid, which the controller checks.

Does not own: the scoring and the proof (rewards/worker_scored.py), the frames (answer_workers.py).
"""

from __future__ import annotations

from typing import Any, Protocol

from hpc_rl.data.samples import Sample
from hpc_rl.rewards.worker_scored import WorkerRewards, score_answer
from hpc_rl.rollout.request_batching import BatchAnswerError, split_answer

REWARD_FIELD = "hpc_rl_worker_reward"
"""The key of an answer dict under which a worker returns its reward record (no SGLang answer has it)."""


class _Client(Protocol):
    answer_pool: Any
    worker_rewards: WorkerRewards | None


def reward_request(client: _Client, sample: Sample) -> dict[str, Any] | None:
    """What the answer worker needs to score `sample`'s next answer, or None (no workers, not a rule reward, or
    the sample already has response text: the answer would not be its whole response)."""
    if client.answer_pool is None or client.worker_rewards is None or sample.response_text:
        return None
    return client.worker_rewards.request(sample)


def score_header(rids: list[str], requests: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The `score` entry of a post's frame header (None when no item asks)."""
    if not any(request is not None for request in requests):
        return None
    return {"rids": rids, "requests": requests}


def attach_rewards(answer: Any, score: dict[str, Any]) -> None:
    """Run in a worker on a parsed 200 answer: score each asked-for item's text, in place (an answer that is not
    one dict per request, or an item without a string text, is left alone: the controller scores)."""
    rids, requests = score["rids"], score["requests"]
    if len(rids) == 1:
        items = [answer] if isinstance(answer, dict) else []
    else:
        try:
            items = split_answer(answer, rids)
        except BatchAnswerError:
            return
    for rid, request, item in zip(rids, requests, items):
        text = item.get("text")
        if request is not None and type(text) is str:
            item[REWARD_FIELD] = {"rid": rid, **score_answer(request, text)}


def keep_reward(rewards: WorkerRewards | None, sample: Sample, request: dict[str, Any] | None, answer: dict[str, Any],
                rid: str, text: str) -> None:
    """After `sample`'s exchange `rid` appended `text`: keep the worker's reward of it, or forget any older one."""
    if rewards is None:
        return
    record = answer.get(REWARD_FIELD) if request is not None else None
    if request is None or not isinstance(record, dict) or record.get("rid") != rid:
        rewards.forget(sample)
        return
    rewards.keep(sample, request, record, text)
