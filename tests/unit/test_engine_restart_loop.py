"""Issue 37 case 6: an engine killed just before a weight sync was restarted, then failed AGAIN (and restarted
again) when the sync it broke was given up ABORT_GRACE_S later: the sync's verdict named the engine by index,
and the fleet failed the new process for its predecessor's death (events failed, restarting, restarted, failed,
restarting, restarted, ... in test_engine_killed_mid_rollout_loses_no_sample under load). A failure is now the
process's it was seen on (`incarnation`): the restarted engine is kept."""

from __future__ import annotations

import asyncio

from hpc_rl.controller.engine_admin import BucketUpdate, EngineAdminError
from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry
from hpc_rl.protocol.http_client import EngineHTTPTransportError
from tests.unit.test_weight_sync_recovery import ScriptedEngineAdmin, trainer_rank0, weight_updates


def test_a_late_failure_of_the_previous_process_does_not_fail_the_restarted_engine() -> None:
    async def scenario() -> tuple[list[str], EngineInfo]:
        registry = Registry(trainer_world_size=1, num_engines=1)
        restarted = asyncio.Event()

        async def restart(index: int) -> str:
            restarted.set()
            return "http://127.0.0.1:9"

        fleet = EngineFleet(registry, None, api_key=None, restart=restart, max_restarts=3, health_interval_s=3600)
        await fleet.start()
        try:
            await fleet.register(0, "http://127.0.0.1:9", serving=True)
            killed = registry.engines[0].incarnation
            await fleet.fail_engine(0, "process exited with code -9", incarnation=killed)
            await asyncio.wait_for(restarted.wait(), 5)
            while registry.engines[0].incarnation == killed:  # the restart registers the new process
                await asyncio.sleep(0.01)
            await fleet.fail_engine(0, "broke weight sync v2: cannot connect", incarnation=killed)
            await asyncio.sleep(0.05)
            return [e["event"] for e in fleet.events], registry.engines[0]
        finally:
            await fleet.close()

    events, engine = asyncio.run(scenario())
    assert events == ["failed", "restarting", "restarted"]
    assert engine.state == EngineState.STARTING and engine.restarts == 1


class RestartedMidSyncAdmin(ScriptedEngineAdmin):
    """Engine 1's process is dead when the sync begins (its update cannot connect), and the driver's restart
    registers the new process while the other engine is still given ABORT_GRACE_S to end its update."""

    def __init__(self, url: str, events: list[str], registry: Registry) -> None:
        super().__init__(url, events)
        self.registry = registry

    async def weight_update(self, buckets: list[BucketUpdate], *, gate: object = None) -> None:
        if self.registry.engines[1].restarts:  # the new process: it takes the push made again
            return await super().weight_update(buckets, gate=gate)
        old = self.registry.engines[1]
        self.registry.add_engine(EngineInfo(engine_index=1, url=old.url, restarts=1))  # restarted: STARTING
        raise EngineAdminError(f"{self.url}/begin_weight_update failed: cannot connect",
                               url=self.url) from EngineHTTPTransportError("cannot connect")


def test_a_sync_broken_by_an_engine_restarted_since_leaves_the_new_process_alone() -> None:
    async def scenario() -> tuple[list[int], EngineState]:
        events: list[str] = []
        admins = {0: ScriptedEngineAdmin("e0", events)}
        weights, fleet, channel = weight_updates(2, admins)
        admins[1] = RestartedMidSyncAdmin("e1", events, fleet.registry)
        trainer = asyncio.create_task(trainer_rank0(channel, events))
        await weights._push(1)
        trainer.cancel()
        return fleet.failed, fleet.registry.engines[1].state, events

    failed, state, events = asyncio.run(scenario())
    assert failed == []  # old code: [1], the new process failed for the old one's death
    assert state == EngineState.STARTING
    assert sorted(events[-2:]) == ["e0 updated", "e1 updated"]  # pushed again, to both
