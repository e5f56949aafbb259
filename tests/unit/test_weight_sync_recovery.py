"""The controller's side of an engine breaking a weight sync (issue 22 item 3), against fakes: rank 0 aborts the
group before anything else, every engine that died or stayed wedged is named, the weights go again to the
engines still up over a new group, and an engine that fails after a sync has the trainer abort the group before
its next command."""

from __future__ import annotations

import asyncio

import pytest

from hpc_rl.config.sections.cluster import ClusterConfig, ControllerConfig
from hpc_rl.config.sections.rollout import RolloutConfig
from hpc_rl.controller.engine_admin import BucketUpdate, EngineAdminError
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.transports.broadcast import WeightGroupBroken, WeightGroup, push_weights_to_engines
from hpc_rl.controller.weight_updates import WeightSyncSettings, WeightUpdates
from hpc_rl.protocol.http_client import EngineHTTPTransportError
from hpc_rl.protocol.messages import AbortWeightGroupCommand, CommandDone, SyncWeightsCommand, WeightPlan


class ScriptedEngineAdmin:
    """A fake of EngineAdmin: `dies` -> its update fails as a dead process's would (no answer); `wedged` ->
    it never answers until cancelled (an engine still in a broadcast that will not complete)."""

    def __init__(self, url: str, events: list[str], *, dies: bool = False, wedged: bool = False) -> None:
        self.url, self.events, self.dies, self.wedged = url, events, dies, wedged

    async def init_weight_group(self, **kwargs: object) -> None:
        self.events.append(f"{self.url} init {kwargs['group_name']}")

    async def destroy_weight_group(self, group_name: str) -> None:
        self.events.append(f"{self.url} destroy {group_name}")

    async def weight_update(self, buckets: list[BucketUpdate], *, gate: object = None) -> None:
        if self.dies:
            self.dies = False
            raise EngineAdminError(f"{self.url}/begin_weight_update failed: connection reset",
                                   url=self.url) from EngineHTTPTransportError("connection reset")
        if self.wedged:
            self.wedged = False
            await asyncio.sleep(3600)
        self.events.append(f"{self.url} updated")


async def trainer_rank0(channel: TrainerChannel, events: list[str]) -> None:
    """Rank 0: answers every command at once (NCCL: its broadcasts do not block it)."""
    while True:
        command = await channel.next_command(0)
        events.append(f"trainer {type(command).__name__}")
        if isinstance(command, SyncWeightsCommand):
            channel.on_weight_plan(WeightPlan(weight_version=command.weight_version, master_address="127.0.0.1",
                                              master_port=1, buckets=[{"names": ["w"], "dtypes": ["float32"],
                                                                       "shapes": [[1]], "num_bytes": 4}]))
        channel.on_done(CommandDone(rank=0, seq=command.seq))


def test_a_dead_and_a_wedged_engine_are_named_after_rank_0_aborted_the_group(monkeypatch) -> None:
    monkeypatch.setattr("hpc_rl.controller.transports.broadcast.ABORT_GRACE_S", 0.2)

    async def scenario() -> None:
        events: list[str] = []
        channel = TrainerChannel(1)
        engines = [EngineInfo(engine_index=i, url=f"e{i}") for i in range(3)]
        admins = {0: ScriptedEngineAdmin("e0", events), 1: ScriptedEngineAdmin("e1", events, dies=True),
                  2: ScriptedEngineAdmin("e2", events, wedged=True)}
        group = WeightGroup()
        trainer = asyncio.create_task(trainer_rank0(channel, events))
        with pytest.raises(WeightGroupBroken) as broken:
            await push_weights_to_engines(version=1, channel=channel, engines=engines, admins=admins,  # type: ignore[arg-type]
                                          group=group, backend="nccl", bucket_bytes=4, timeout_s=5)
        trainer.cancel()
        assert broken.value.engines == [1, 2]  # e0 answered: it is up, the next push redoes its buckets
        assert group.members == []  # the next sync builds a new group
        assert events.index("trainer SyncWeightsCommand") < events.index("trainer AbortWeightGroupCommand")

    asyncio.run(scenario())


class RecordingFleet:
    """A fake of EngineFleet: fails engines in the registry (and tells the weight updates, as the real one)."""

    def __init__(self, registry: Registry, admins: dict[int, ScriptedEngineAdmin]) -> None:
        self.registry, self.admins, self.failed = registry, admins, []
        self.on_failed = None
        self.engine_waiting = asyncio.Event()

    async def fail_engine(self, index: int, reason: str, *, incarnation: int | None = None) -> None:
        if incarnation is not None and self.registry.engines[index].incarnation != incarnation:
            return  # its previous process's failure (the real fleet ignores it too)
        self.failed.append(index)
        self.registry.set_engine_state(index, EngineState.FAILED, reason)
        if self.on_failed is not None:
            self.on_failed(index)

    async def mark_serving(self, indices: list[int]) -> None:
        pass


def weight_updates(num_engines: int, admins: dict[int, ScriptedEngineAdmin]) -> tuple[WeightUpdates, RecordingFleet, TrainerChannel]:
    registry = Registry(trainer_world_size=1, num_engines=num_engines)
    for index in range(num_engines):
        registry.add_engine(EngineInfo(engine_index=index, url=f"e{index}", state=EngineState.SERVING))
    fleet = RecordingFleet(registry, admins)
    channel = TrainerChannel(1)
    settings = WeightSyncSettings.from_sections(ClusterConfig(device="cpu", rollout_num_gpus=num_engines),
                                                RolloutConfig(), ControllerConfig())
    weights = WeightUpdates(settings, registry=registry, fleet=fleet, channel=channel,  # type: ignore[arg-type]
                            engines_serve=lambda version: None, num_rollout=10)
    fleet.on_failed = weights.engine_failed
    return weights, fleet, channel


def test_the_push_goes_again_to_the_engines_still_up_over_a_new_group() -> None:
    async def scenario() -> None:
        events: list[str] = []
        admins = {0: ScriptedEngineAdmin("e0", events), 1: ScriptedEngineAdmin("e1", events, dies=True)}
        weights, fleet, channel = weight_updates(2, admins)
        trainer = asyncio.create_task(trainer_rank0(channel, events))
        metrics = await weights._push(1)
        trainer.cancel()
        assert fleet.failed == [1] and metrics["weight_sync/recovery_seconds"] >= 0
        assert [e for e in events if "init" in e] == ["e0 init weight_update_group_1", "e1 init weight_update_group_1",
                                                       "e0 init weight_update_group_2"]
        assert events[-1] == "e0 updated" and events.count("trainer AbortWeightGroupCommand") == 1
        abort = events.index("trainer AbortWeightGroupCommand")
        assert "trainer SyncWeightsCommand" in events[abort:]  # pushed again, after the abort

    asyncio.run(scenario())


def test_an_engine_failing_after_a_sync_has_the_trainer_abort_the_group_before_its_next_command() -> None:
    async def scenario() -> None:
        events: list[str] = []
        admins = {0: ScriptedEngineAdmin("e0", events), 1: ScriptedEngineAdmin("e1", events)}
        weights, fleet, channel = weight_updates(2, admins)
        trainer = asyncio.create_task(trainer_rank0(channel, events))
        await weights._push(1)
        await fleet.fail_engine(1, "process exited with code 1")  # on NCCL a broadcast to it may still be pending
        assert weights.transport.group.members == [] and weights.transport.abort_due
        await weights.before_train(sync_due=True)
        trainer.cancel()
        assert events[-1] == "trainer AbortWeightGroupCommand" and not weights.transport.abort_due

    asyncio.run(scenario())
