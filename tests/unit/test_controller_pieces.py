"""Controller pieces without processes: batches for DP ranks, the trainer channel, the registry barrier,
and the weight-sync call sequence (engines and trainer replaced by fakes named as such)."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from hpc_rl.controller.registry import EngineInfo, EngineState, Registry, RegistrationTimeout, TrainerInfo
from hpc_rl.controller.train_batches import (RewardShaping, group_normalized_rewards, normalized_rewards,
                                             pack_samples, split_for_data_parallel)
from hpc_rl.controller.trainer_channel import TrainerChannel, TrainerFailed
from hpc_rl.controller.engine_admin import BucketUpdate
from hpc_rl.controller.transports.broadcast import WeightGroup, push_weights_to_engines, rank_offsets
from hpc_rl.data.samples import Sample
from hpc_rl.protocol.messages import CommandDone, StopCommand, SyncWeightsCommand, WeightPlan


def make_groups(rewards: list[list[float]], response_len=lambda i: 2 + i % 3) -> list[list[Sample]]:
    groups, index = [], 0
    for g, group_rewards in enumerate(rewards):
        group = []
        for r in group_rewards:
            n = response_len(index)
            group.append(Sample(index=index, group_index=g, prompt="p", prompt_token_ids=[1, 2, 3],
                                response_token_ids=list(range(10, 10 + n)), response_logprobs=[-0.5] * n,
                                weight_versions=[0] * n, reward=r))
            index += 1
        groups.append(group)
    return groups

def close(values: np.ndarray, expected: list[float], tol: float = 1e-5) -> None:
    assert values.dtype == np.float32
    np.testing.assert_allclose(values, np.array(expected, dtype=np.float32), atol=tol, rtol=tol)


def test_grpo_group_normalisation_hand_values() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # group 1: mean 0.5, centred +-0.5, unbiased std sqrt(1/3) = 0.5773503 -> 0.5 / 0.5773513 = 0.8660239
    # group 2: all equal -> 0 (not NaN: 0 / (0 + 1e-6))
    a = 0.8660239
    for est in ("grpo", "gspo", "cispo"):
        close(group_normalized_rewards(rewards, 4, est), [a, -a, -a, a, 0, 0, 0, 0])


def test_dr_grpo_and_baseline_only_centre() -> None:
    rewards = [1.0, 0.0, 0.0, 3.0]
    close(group_normalized_rewards(rewards, 2, "grpo", std_normalization=False), [0.5, -0.5, -1.5, 1.5])
    close(group_normalized_rewards(rewards, 2, "reinforce_plus_plus_baseline"), [0.5, -0.5, -1.5, 1.5])


def test_single_sample_groups_and_unnormalised_estimators() -> None:
    close(group_normalized_rewards([3.0, -1.0], 1, "grpo"), [0.0, 0.0])
    close(group_normalized_rewards([3.0, -1.0], 1, "ppo"), [3.0, -1.0])
    close(group_normalized_rewards([3.0, -1.0], 2, "reinforce_plus_plus"), [3.0, -1.0])
    with pytest.raises(ValueError, match="groups"):
        group_normalized_rewards([1.0, 2.0, 3.0], 2, "grpo")


def test_grpo_normalisation_by_hand() -> None:
    shaping = RewardShaping(advantage_estimator="grpo", n_samples_per_prompt=2)
    # group [1, 0]: mean 0.5, unbiased std 0.7071 -> +-0.7071; group [1, 1]: 0
    values = normalized_rewards(make_groups([[1.0, 0.0], [1.0, 1.0]]), shaping)
    assert values[0] == pytest.approx(0.5 / (0.5 ** 0.5 + 1e-6), rel=1e-6)
    assert values[1] == pytest.approx(-values[0])
    assert values[2:] == [0.0, 0.0]
    dr_grpo = RewardShaping(advantage_estimator="grpo", n_samples_per_prompt=2, std_normalization=False)
    assert normalized_rewards(make_groups([[1.0, 0.0]]), dr_grpo) == [0.5, -0.5]
    ppo = RewardShaping(advantage_estimator="ppo", n_samples_per_prompt=2)
    assert normalized_rewards(make_groups([[1.0, 0.0]]), ppo) == [1.0, 0.0]


def test_dp_split_keeps_every_sample_once_and_balances() -> None:
    groups = make_groups([[1.0, 0.0, 1.0, 0.0]] * 4, response_len=lambda i: 1 + (i * 7) % 11)
    shaping = RewardShaping(advantage_estimator="grpo", n_samples_per_prompt=4)
    parts = split_for_data_parallel(groups, shaping, 2)
    indices = sorted(i for p in parts for i in p["sample_indices"].tolist())
    assert indices == list(range(16))
    assert [len(p["sample_indices"]) for p in parts] == [8, 8]
    tokens = [int(p["prompt_lengths"].sum() + p["response_lengths"].sum()) for p in parts]
    assert abs(tokens[0] - tokens[1]) <= 11
    assert parts[0]["prompt_lengths"].tolist() == [3] * 8
    assert len(parts[0]["loss_masks"]) == len(parts[0]["rollout_logprobs"]) == int(parts[0]["response_lengths"].sum())
    assert parts[0]["tokens"].dtype == np.int64


def test_packed_loss_masks_are_ones_unless_a_sample_has_its_own() -> None:
    def sample(index: int, mask: list[int] | None) -> Sample:
        return Sample(index=index, group_index=0, prompt="p", prompt_token_ids=[1], response_token_ids=[5, 6, 7],
                      response_logprobs=[-0.1, -0.2, -0.3], weight_versions=[0, 0, 0], loss_mask=mask)

    assert pack_samples([sample(0, None), sample(1, None)], [0.0, 0.0])["loss_masks"].tolist() == [1] * 6
    mixed = pack_samples([sample(0, None), sample(1, [1, 0, 1])], [0.0, 0.0])["loss_masks"]
    assert mixed.tolist() == [1, 1, 1, 1, 0, 1] and mixed.dtype == np.uint8


def test_channel_runs_commands_on_every_rank_in_order() -> None:
    async def scenario() -> None:
        channel = TrainerChannel(2)

        async def fake_rank(rank: int) -> list[str]:
            seen = []
            while True:
                command = await channel.next_command(rank)
                seen.append(command.TYPE)
                channel.on_done(CommandDone(rank=rank, seq=command.seq, metrics={"rank": rank}))
                if isinstance(command, StopCommand):
                    return seen

        ranks = [asyncio.create_task(fake_rank(r)) for r in range(2)]
        done = await channel.run(lambda rank, seq: SyncWeightsCommand(
            seq=seq, weight_version=1, new_group=True, world_size=2, group_name="g", backend="gloo", bucket_bytes=1))
        assert [d.rank for d in done] == [0, 1]
        await channel.run(lambda rank, seq: StopCommand(seq=seq))
        assert await asyncio.gather(*ranks) == [["sync_weights", "stop"]] * 2

    asyncio.run(scenario())


def test_channel_fails_pending_work_when_a_rank_fails() -> None:
    async def scenario() -> None:
        channel = TrainerChannel(2)
        run = asyncio.create_task(channel.run(lambda rank, seq: StopCommand(seq=seq)))
        await asyncio.sleep(0)
        channel.on_done(CommandDone(rank=1, seq=1, ok=False, error="CUDA OOM"))
        with pytest.raises(TrainerFailed, match="trainer rank 1 failed command 1: CUDA OOM"):
            await run

    asyncio.run(scenario())


def test_registration_timeout_names_who_is_missing() -> None:
    async def scenario() -> None:
        registry = Registry(trainer_world_size=2, num_engines=2)
        registry.add_trainer(TrainerInfo(rank=0, world_size=2, host="h", pid=1))
        registry.add_engine(EngineInfo(engine_index=1, url="http://x"))
        with pytest.raises(RegistrationTimeout, match="trainer rank 1, engine 0"):
            await registry.wait_ready(0.2)

    asyncio.run(scenario())


def test_rank_offsets() -> None:
    engines = [EngineInfo(engine_index=0, url="a", tp_size=2), EngineInfo(engine_index=1, url="b", tp_size=4)]
    assert rank_offsets(engines) == ({0: 1, 1: 3}, 7)


class FakeEngineAdmin:
    """Records the admin calls the sync makes (a fake of controller.engine_admin.EngineAdmin)."""

    def __init__(self, name: str, calls: list[tuple[str, str]]) -> None:
        self.name, self.calls = name, calls

    async def init_weight_group(self, **kwargs: object) -> None:
        self.calls.append((self.name, f"init rank_offset={kwargs['rank_offset']} world={kwargs['world_size']}"))

    async def destroy_weight_group(self, group_name: str) -> None:
        self.calls.append((self.name, "destroy"))

    async def begin_weight_update(self) -> None:
        self.calls.append((self.name, "begin"))

    async def update_weights_from_distributed(self, **kwargs: object) -> None:
        self.calls.append((self.name, f"update {kwargs['names']} version={kwargs['weight_version']}"))

    async def end_weight_update(self) -> None:
        self.calls.append((self.name, "end"))

    async def weight_update(self, buckets: list[BucketUpdate], *, gate: object = None) -> None:
        await self.begin_weight_update()
        for bucket in buckets:
            body = orjson.loads(bucket.body)
            await self.update_weights_from_distributed(names=body["names"], weight_version=body.get("weight_version"))
        await self.end_weight_update()


def test_weight_sync_sequence_and_group_reuse() -> None:
    async def scenario() -> None:
        calls: list[tuple[str, str]] = []
        channel = TrainerChannel(1)
        engines = [EngineInfo(engine_index=0, url="http://a"), EngineInfo(engine_index=1, url="http://b", job_id="7")]
        admins = {0: FakeEngineAdmin("e0", calls), 1: FakeEngineAdmin("e1", calls)}
        group = WeightGroup()

        async def fake_rank0() -> None:
            for _ in range(2):
                command = await channel.next_command(0)
                assert isinstance(command, SyncWeightsCommand)
                calls.append(("trainer", f"sync new_group={command.new_group}"))
                channel.on_weight_plan(WeightPlan(weight_version=command.weight_version, master_address="127.0.0.1",
                                                  master_port=1234, buckets=[
                                                      {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]},
                                                      {"names": ["b"], "dtypes": ["float32"], "shapes": [[3]]}]))
                channel.on_done(CommandDone(rank=0, seq=command.seq))

        rank = asyncio.create_task(fake_rank0())
        await push_weights_to_engines(version=1, channel=channel, engines=engines, admins=admins, group=group,
                                      backend="gloo", bucket_bytes=10)
        first = list(calls)
        assert first[0] == ("trainer", "sync new_group=True")
        assert ("e0", "init rank_offset=1 world=3") in first and ("e1", "init rank_offset=2 world=3") in first
        # an engine job's engine may hold a group of this name from the controller before a trainer restart
        assert [c for who, c in first if who == "e1"][:2] == ["destroy", "init rank_offset=2 world=3"]
        e0 = [c for who, c in first if who == "e0"]
        assert e0 == ["init rank_offset=1 world=3", "begin", "update ['a'] version=None",
                      "update ['b'] version=1", "end"]
        calls.clear()
        await push_weights_to_engines(version=2, channel=channel, engines=engines, admins=admins, group=group,
                                      backend="gloo", bucket_bytes=10)
        assert ("trainer", "sync new_group=False") in calls
        assert not any("init" in c for _, c in calls)  # same engines: the group is reused
        await rank

    asyncio.run(scenario())


def test_restarted_engine_rejoins_the_group_without_a_sync_while_it_was_down() -> None:
    """Engine 0 dies after a sync and comes back at the same URL before the next one (several rollouts,
    no sync due meanwhile): the next sync must build a new group that the new process joins."""
    async def scenario() -> None:
        calls: list[tuple[str, str]] = []
        channel = TrainerChannel(1)
        registry = Registry(trainer_world_size=1, num_engines=2)
        for index, url in enumerate(["http://a", "http://b"]):
            registry.add_engine(EngineInfo(engine_index=index, url=url))
        admins = {0: FakeEngineAdmin("e0", calls), 1: FakeEngineAdmin("e1", calls)}
        group = WeightGroup()
        new_groups: list[bool] = []

        async def fake_rank0() -> None:
            for _ in range(2):
                command = await channel.next_command(0)
                new_groups.append(command.new_group)
                channel.on_weight_plan(WeightPlan(weight_version=command.weight_version, master_address="127.0.0.1",
                                                  master_port=1234, buckets=[
                                                      {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]}]))
                channel.on_done(CommandDone(rank=0, seq=command.seq))

        rank = asyncio.create_task(fake_rank0())
        await push_weights_to_engines(version=1, channel=channel, engines=registry.live_engines(), admins=admins,
                                      group=group, backend="gloo", bucket_bytes=10)
        registry.set_engine_state(0, EngineState.FAILED, "killed")
        # ... rollouts go on with engine 1 only; no sync is due; the restart of engine 0 lands at the same URL:
        registry.add_engine(EngineInfo(engine_index=0, url="http://a", restarts=1))
        calls.clear()
        await push_weights_to_engines(version=1, channel=channel, engines=registry.live_engines(), admins=admins,
                                      group=group, backend="gloo", bucket_bytes=10)
        await rank
        assert new_groups == [True, True]
        assert ("e0", "init rank_offset=1 world=3") in calls and ("e1", "init rank_offset=2 world=3") in calls

    asyncio.run(scenario())


class SlowRouterForTest:
    """A fake of sglang-router membership whose removal takes a while (it runs in a thread, as the real one)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def add_workers(self, urls: list[str]) -> None:
        self.calls += [("add", url) for url in urls]

    def remove_worker(self, url: str) -> None:
        import time

        time.sleep(0.2)
        self.calls.append(("remove", url))


def test_one_failure_reported_twice_restarts_the_engine_once() -> None:
    """The driver sees the process exit while the health check times out: one restart, not two."""
    from hpc_rl.controller.engine_fleet import EngineFleet

    async def scenario() -> None:
        restarts: list[int] = []

        async def restart(index: int) -> str:
            restarts.append(index)
            return "http://a"

        registry = Registry(trainer_world_size=1, num_engines=1)
        router = SlowRouterForTest()
        fleet = EngineFleet(registry, router, api_key=None, restart=restart, max_restarts=3, health_interval_s=3600)
        await fleet.start()
        try:
            await fleet.register(0, "http://a", serving=True)
            await asyncio.gather(fleet.fail_engine(0, "process exited"), fleet.fail_engine(0, "health check failed"))
            await asyncio.sleep(0.1)
            assert restarts == [0]
            assert [e["event"] for e in fleet.events] == ["failed", "restarting", "restarted"]
            assert router.calls.count(("remove", "http://a")) == 1
        finally:
            await fleet.close()

    asyncio.run(scenario())
