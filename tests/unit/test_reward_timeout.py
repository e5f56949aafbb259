"""Rewards that hang or return NaN (issue 24): a custom reward that blocks (`time.sleep`) or awaits forever
ends, after `timeout_s`, as an error naming the sample and the plug-in, while the caller's event loop keeps
running the whole time (its signals, status and trainers are served); a NaN or infinite reward is an error
naming the sample, never a silently skipped optimizer step."""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path

import pytest

from hpc_rl.data.samples import Sample
from hpc_rl.rewards import RewardError, RewardSpec, reward_group
from hpc_rl.rewards.reward_thread import RewardThread

HANGING = textwrap.dedent(
    """
    import asyncio, time

    async def blocks(args, sample):
        time.sleep(30)          # blocking, inside an async def: it would stall any loop it ran on
        return 1.0

    async def waits_forever(args, sample):
        await asyncio.sleep(3600)
        return 1.0

    async def nan_for_the_second(args, sample):
        return float("nan") if sample.index == 1 else 1.0

    async def infinite_group(args, samples):
        return [1.0, float("inf")]
    """
)


def samples(n: int = 2) -> list[Sample]:
    return [Sample(index=i, group_index=0, prompt="p", prompt_token_ids=[1], label="1", response_text="1") for i in range(n)]


async def score_while_ticking(spec: RewardSpec) -> tuple[BaseException, int, float]:
    """Score a group while a task ticks every 10 ms on the caller's loop: how many ticks happened."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    started = time.monotonic()
    with pytest.raises(RewardError) as failed:
        await reward_group(spec, samples())
    elapsed = time.monotonic() - started
    ticker.cancel()
    return failed.value, ticks, elapsed


@pytest.mark.parametrize("function", ["blocks", "waits_forever"])
def test_a_hanging_custom_reward_times_out_naming_the_sample_and_never_blocks_the_loop(tmp_path: Path,
                                                                                        function: str) -> None:
    plugin = tmp_path / "hanging_rm.py"
    plugin.write_text(HANGING)
    thread = RewardThread()
    spec = RewardSpec(custom_rm_path=f"{plugin}:{function}", timeout_s=0.5, thread=thread)
    try:
        error, ticks, elapsed = asyncio.run(score_while_ticking(spec))
    finally:
        thread.close()
    assert 0.45 < elapsed < 20.0  # the blocking reward sleeps 30 s: it was not waited for
    assert f"custom_rm_path '{plugin}:{function}'" in str(error)
    assert "sample index 0" in str(error) and "RewardTimeout: no reward after 0.5 s (rollout.reward_timeout)" in str(error)
    # ~50 ticks on a quiet machine; a reward run on the loop would have let at most one through
    assert ticks >= 5, f"the caller's loop ran {ticks} times in {elapsed:.2f} s: the reward blocked it"


def test_nan_and_infinite_rewards_are_errors_naming_the_sample(tmp_path: Path) -> None:
    plugin = tmp_path / "nan_rm.py"
    plugin.write_text(HANGING)
    with pytest.raises(RewardError, match=r"sample index 1 .*the reward is nan, not a finite number"):
        asyncio.run(reward_group(RewardSpec(custom_rm_path=f"{plugin}:nan_for_the_second"), samples()))
    group = RewardSpec(custom_rm_path=f"{plugin}:infinite_group", group_rm=True, thread=RewardThread())
    with pytest.raises(RewardError, match=r"sample index 1 .*the reward is inf"):
        asyncio.run(reward_group(group, samples()))
    assert asyncio.run(reward_group(RewardSpec(rm_type="tiny_task"), samples())) == [1.0, 1.0]
