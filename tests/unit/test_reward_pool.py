"""Rule-based rewards in worker processes (`rollout.reward_workers`): the same rewards and the same
errors as on the event loop, and a dead worker does not lose a group."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_rl.config import load_config
from hpc_rl.config.validation import validate
from hpc_rl.data.samples import Sample
from hpc_rl.rewards.group import RewardError, RewardSpec, reward_group
from hpc_rl.rewards.pool import RewardPool

CASES = [json.loads(line) for line in (Path(__file__).parent / "data" / "rewards_cases.jsonl").read_text().splitlines()]


def sample(index: int, response: str, label: object, metadata: dict | None = None) -> Sample:
    return Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[1], label=label,
                  metadata=dict(metadata or {}), response_text=response)


@pytest.fixture(scope="module")
def pool() -> Iterator[RewardPool]:
    pool = RewardPool(1)
    asyncio.run(pool.start())
    yield pool
    pool.close()


def test_the_pool_gives_every_case_file_reward(pool: RewardPool) -> None:
    async def both(rm_type: str, samples: list[Sample]) -> tuple[list[float], list[float]]:
        on_loop = await reward_group(RewardSpec(rm_type=rm_type), samples)
        in_pool = await reward_group(RewardSpec(rm_type=rm_type, pool=pool), samples)
        return on_loop, in_pool

    for rm_type in sorted({case["rm_type"] for case in CASES}):
        cases = [case for case in CASES if case["rm_type"] == rm_type]
        samples = [sample(i, case["response"], case["label"]) for i, case in enumerate(cases)]
        on_loop, in_pool = asyncio.run(both(rm_type, samples))
        assert in_pool == on_loop == pytest.approx([case["expected"] for case in cases], abs=1e-6), rm_type


def test_a_metadata_override_reaches_the_worker(pool: RewardPool) -> None:
    samples = [sample(0, "Answer: 34", "34", {"rm_type": "dapo", "tool_state": object()}),
               sample(1, "Answer: 34", "34")]
    assert asyncio.run(reward_group(RewardSpec(rm_type="math", pool=pool), samples)) == [1.0, 0.0]


def test_a_grader_error_names_its_samples_as_on_the_loop(pool: RewardPool) -> None:
    samples = [sample(7, "Answer: 3", "3"), sample(8, "Answer: 1/2", "\\frac{1}{2}"),
               sample(9, "Answer: 1/3", "\\frac{1}{3}")]
    with pytest.raises(RewardError) as raised:
        asyncio.run(reward_group(RewardSpec(rm_type="dapo", pool=pool), samples))
    assert raised.value.indices == [8, 9]
    assert "sample index 8 (rm_type 'dapo'): ValueError" in str(raised.value)
    assert "integer labels" in str(raised.value)


def test_a_killed_worker_is_replaced_and_the_group_scored(pool: RewardPool) -> None:
    asyncio.run(pool.start())
    for process in list(pool._workers.executor()._processes.values()):
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=10)
    samples = [sample(0, "</think> \\boxed{12}", "12"), sample(1, "</think> \\boxed{13}", "12")]
    assert asyncio.run(reward_group(RewardSpec(rm_type="deepscaler", pool=pool), samples)) == [1.0, 0.0]


def test_reward_workers_below_zero_is_refused_at_submit() -> None:
    config = load_config([])
    config.rollout.reward_workers = -1
    with pytest.raises(ValueError, match="rollout.reward_workers"):
        validate(config, check_files=False)
