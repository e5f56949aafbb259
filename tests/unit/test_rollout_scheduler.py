"""RolloutScheduler against FakeSglangEngine: dynamic sampling, refill, abort, partial buffer, resume, eval."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from hpc_rl.data.prompts import PromptDataset, PromptRecord, PromptSource
from hpc_rl.data.samples import Sample, SampleStatus
from hpc_rl.rollout.engine_client import EngineClient, StaticEngineDirectory
from hpc_rl.rollout.eval import run_eval
from hpc_rl.rollout.filters import check_reward_nonzero_std
from hpc_rl.rollout.scheduler import RolloutScheduler, SchedulerSettings
from tests.unit.test_rollout_fake_engine import FakeSglangEngine

PROMPT_LEN = 2


def make_source(rows: int = 256) -> PromptSource:
    records = [PromptRecord(row=i, prompt=f"q{i}", label=i) for i in range(rows)]
    return PromptSource(PromptDataset(path="memory", records=records), shuffle=False, seed=0)


def encode(prompt: Any, metadata: dict[str, Any]) -> list[int]:
    return [10, int(str(prompt)[1:])]  # the engine reads the row from the second prompt token


def row(sample: Sample) -> int:
    return int(sample.metadata["data_row"])


async def half_constant_reward(samples: list[Sample]) -> list[float]:
    """Even rows: all rewards equal (check_reward_nonzero_std drops them); odd rows: 0, 1, 0, 1..."""
    return [0.0 if row(s) % 2 == 0 else float(k % 2) for k, s in enumerate(samples)]


class Harness:
    """One fake engine whose `slow_rows` generate ~forever; a client; schedulers built on demand."""

    def __init__(self) -> None:
        self.slow_rows: set[int] = set()
        self.engine = FakeSglangEngine(token_latency_s=0.001, natural_length=self.natural)
        self.client: EngineClient | None = None

    def natural(self, ids: list[int]) -> int:
        return (5000 if ids[1] in self.slow_rows else 5) - (len(ids) - PROMPT_LEN)

    def scheduler(self, *, reward_fn: Callable[[list[Sample]], Awaitable[list[float]]] = half_constant_reward,
                  group_filter: Any = check_reward_nonzero_std, **settings: Any) -> RolloutScheduler:
        defaults: dict[str, Any] = {"rollout_batch_size": 2, "n_samples_per_prompt": 4,
                                    "over_sampling_batch_size": 8, "partial_rollout": True}
        assert self.client is not None
        return RolloutScheduler(settings=SchedulerSettings(**{**defaults, **settings}), client=self.client,
                                source=make_source(), encoder=encode, reward_fn=reward_fn,
                                sampling_params={"max_new_tokens": 8000}, group_filter=group_filter)


def run_with(body: Callable[[Harness], Awaitable[None]]) -> None:
    async def main() -> None:
        harness = Harness()
        await harness.engine.start()
        harness.client = EngineClient(StaticEngineDirectory([harness.engine.url]), router_url=harness.engine.url)
        try:
            async with harness.client:
                await body(harness)
                assert not harness.engine.running, "requests left running on the engine"
        finally:
            await harness.engine.stop()
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()], "tasks leaked"

    asyncio.run(main())


def check_accounting(metrics: dict[str, float]) -> None:
    assert metrics["rollout/requests_sent"] == (
        metrics["rollout/requests_finished"] + metrics["rollout/requests_aborted"]
        + metrics["rollout/requests_transport_failed"] + metrics["rollout/requests_http_failed"])


def test_dynamic_sampling_aborts_surplus_and_partial_rollout_resumes_first() -> None:
    """The issue's done-when: half the groups dropped, exactly rollout_batch_size back, the rest aborted,
    and the next rollout resumes the unfinished groups first with their tokens."""

    async def body(h: Harness) -> None:
        h.slow_rows = {6, 7}
        scheduler = h.scheduler()
        first = await scheduler.run(rollout_id=0, weight_version=0)
        assert len(first.groups) == 2 and all(row(g[0]) % 2 == 1 for g in first.groups)
        assert all(s.status is SampleStatus.COMPLETED and s.reward is not None for g in first.groups for s in g)
        m = first.metrics
        assert m["rollout/groups_dropped/zero_std_0.0"] >= 1 and m["rollout/requests_aborted"] >= 8
        assert m["rollout/buffer_size"] == len(scheduler.buffer) >= 2
        check_accounting(m)
        buffered = {row(g[0]): [list(s.response_token_ids) for s in g] for g in scheduler.buffer.groups}
        assert {6, 7} <= set(buffered) and any(tokens for tokens in buffered[7])
        assert all(s.metadata["start_rollout_id"] == 0 for g in scheduler.buffer.groups for s in g)

        h.slow_rows = set(range(8, 300))  # new prompts now never finish: only resumed groups can be kept
        second = await scheduler.run(rollout_id=1, weight_version=0)
        assert second.metrics["rollout/groups_from_buffer"] == len(buffered)
        assert [row(g[0]) for g in second.groups] and all(row(g[0]) in buffered for g in second.groups)
        for group in second.groups:
            for sample, old in zip(group, buffered[row(group[0])]):
                assert sample.response_token_ids[:len(old)] == old  # partial tokens kept and continued
                assert sample.metadata["start_rollout_id"] == 0
        check_accounting(second.metrics)

    run_with(body)


def test_refill_submits_only_missing_groups() -> None:
    async def body(h: Harness) -> None:
        scheduler = h.scheduler(rollout_batch_size=4, over_sampling_batch_size=4, partial_rollout=False)
        result = await scheduler.run(rollout_id=0)
        assert sorted(row(g[0]) for g in result.groups) == [1, 3, 5, 7]
        assert result.metrics["rollout/groups_submitted"] == 8  # 4 + one per dropped group, not waves of 4
        assert result.metrics["rollout/groups_dropped"] == 4 and result.metrics["rollout/requests_aborted"] == 0

    run_with(body)


def test_without_partial_rollout_unfinished_groups_are_dropped() -> None:
    async def body(h: Harness) -> None:
        h.slow_rows = {6, 7}
        scheduler = h.scheduler(partial_rollout=False)
        result = await scheduler.run(rollout_id=0)
        assert len(result.groups) == 2 and len(scheduler.buffer) == 0
        assert result.metrics["rollout/groups_dropped/unfinished"] >= 2
        assert result.metrics["rollout/wasted_tokens"] > 0

    run_with(body)


def test_slow_reward_is_not_waited_for() -> None:
    cancelled: list[int] = []
    slow_reward_started = asyncio.Event()

    async def reward(samples: list[Sample]) -> list[float]:
        if row(samples[0]) >= 2:
            slow_reward_started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(row(samples[0]))
                raise
        else:
            # The batch fills only once a slow reward is running, so there is one to cancel.
            await asyncio.wait_for(slow_reward_started.wait(), 10)
        return [float(k % 2) for k in range(len(samples))]

    async def body(h: Harness) -> None:
        scheduler = h.scheduler(reward_fn=reward)
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await scheduler.run(rollout_id=0)
        assert loop.time() - started < 30  # the slow rewards sleep 60 s: they were not waited for
        assert sorted(row(g[0]) for g in result.groups) == [0, 1]
        assert cancelled and set(cancelled) <= set(range(2, 8))
        # Unscored groups wait in the buffer, reward cleared; the fully generated ones keep all their tokens.
        assert len(scheduler.buffer) == 6 and all(s.reward is None for g in scheduler.buffer.groups for s in g)
        for group in scheduler.buffer.groups:
            if row(group[0]) in cancelled:
                assert all(s.status is SampleStatus.COMPLETED and s.response_length == 5 for s in group)

    run_with(body)


def test_checkpoint_restores_exactly() -> None:
    async def body(h: Harness) -> None:
        h.slow_rows = {6, 7}
        scheduler = h.scheduler()
        await scheduler.run(rollout_id=0)
        state = json.loads(json.dumps(scheduler.state_dict()))
        restored = h.scheduler()
        restored.load_state_dict(state)
        assert restored.state_dict() == scheduler.state_dict()
        assert restored.next_group_index == scheduler.next_group_index >= 8
        assert [r.row for r in restored.source.next_records(3)] == [r.row for r in scheduler.source.next_records(3)]

    run_with(body)


def test_stale_partial_samples_are_regenerated_and_offpolicy_tokens_masked() -> None:
    async def keep_all(samples: list[Sample]) -> list[float]:
        return [1.0] * len(samples)

    async def body(h: Harness) -> None:
        h.slow_rows = {6, 7}
        # Old-policy tokens of resumed groups are masked (max_staleness 1 allows a lag of 1 version).
        scheduler = h.scheduler(reward_fn=keep_all, group_filter=None, mask_offpolicy_in_partial_rollout=True,
                                max_staleness=1)
        await scheduler.run(rollout_id=0, weight_version=0)
        h.slow_rows = set(range(8, 300))
        h.engine.set_weight_version(1)
        second = await scheduler.run(rollout_id=1, weight_version=1)
        assert second.metrics["rollout/samples_stale_reset"] == 0
        resumed = [s for g in second.groups for s in g if 0 in s.weight_versions]
        assert resumed, "expected resumed samples with version-0 tokens"
        for sample in (s for g in second.groups for s in g):
            assert sample.effective_loss_mask() == [int(v >= 1) for v in sample.weight_versions]

        # Now version 5 with max_staleness 1: any buffered sample with tokens is too old, regenerated.
        h.slow_rows = set(range(300)) - {r for g in scheduler.buffer.groups for r in [row(g[0])]}
        had_tokens = sum(s.response_length > 0 for g in scheduler.buffer.groups for s in g)
        h.engine.set_weight_version(5)
        third = await scheduler.run(rollout_id=2, weight_version=5)
        assert third.metrics["rollout/samples_stale_reset"] == had_tokens > 0
        assert all(min(s.weight_versions) >= 4 for g in third.groups for s in g if s.weight_versions)

    run_with(body)


def test_run_eval_metrics() -> None:
    async def reward(samples: list[Sample]) -> list[float]:
        return [1.0 if row(s) == 0 else 0.0 for s in samples]

    async def body(h: Harness) -> None:
        assert h.client is not None
        records = [PromptRecord(row=i, prompt=f"q{i}", label=None) for i in range(4)]
        metrics = await run_eval(client=h.client, datasets=[("toy", records)], encoder=encode, reward_fn=reward,
                                 n_samples=2, sampling_params={"max_new_tokens": 3})
        assert metrics["eval/toy/reward_mean"] == 0.25 and metrics["eval/toy/pass@1"] == 0.25
        assert metrics["eval/toy/response_len_mean"] == 3 and metrics["eval/toy/truncated_ratio"] == 1.0
        assert metrics["eval/toy/num_samples"] == 8

    run_with(body)


def test_reward_error_propagates_and_leaves_engines_clean() -> None:
    async def failing(samples: list[Sample]) -> list[float]:
        raise RuntimeError("reward server down")

    async def body(h: Harness) -> None:
        h.slow_rows = {6, 7}
        scheduler = h.scheduler(reward_fn=failing)
        try:
            await scheduler.run(rollout_id=0)
        except RuntimeError as error:
            assert "reward server down" in str(error)
        else:
            raise AssertionError("expected the reward error")
        assert len(scheduler.buffer) == 8  # nothing lost with partial_rollout
        assert scheduler._session is None and not scheduler._running

    run_with(body)
