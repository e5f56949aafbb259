"""An engine that dies while a new weight-update group is built (its /init_weights_update_group fails) must not hold
trainer rank 0, which waits for every member, for the group's 600 s timeout: the controller tells rank 0 to stop
waiting, drops the other engines' joins and names the lost engine (WeightGroupBroken: failed, restarted, the push
made again over a new group). Rank 0's side is real (a gloo group with a member that never comes); the controller's
runs against the fakes of test_weight_sync_recovery."""

from __future__ import annotations

import asyncio
import time

import pytest

from hpc_rl.controller.engine_admin import EngineAdminError
from hpc_rl.controller.registry import EngineInfo
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.transports.broadcast import WeightGroupBroken, WeightGroup, push_weights_to_engines
from hpc_rl.process.child_process import free_port
from hpc_rl.protocol.http_client import EngineHTTPTransportError
from hpc_rl.protocol.messages import CommandDone, SyncWeightsCommand, WeightPlan
from hpc_rl.weights.process_group import JOIN_POLL_S, WeightGroupJoinAbandoned, init_weight_update_group
from tests.unit.test_weight_sync_recovery import ScriptedEngineAdmin, weight_updates


def test_rank_0_stops_waiting_for_a_member_that_never_joins_when_told() -> None:
    asked: list[float] = []
    started = time.monotonic()

    def give_up() -> str:  # the controller learns of the death at the third question
        asked.append(time.monotonic())
        return "engine 1 died" if len(asked) == 3 else ""

    with pytest.raises(WeightGroupJoinAbandoned, match="stopped waiting for the engines to join g_join: engine 1 died"):
        init_weight_update_group(master_address="127.0.0.1", master_port=free_port(), rank=0, world_size=2,
                                 group_name="g_join", backend="gloo", timeout_seconds=600, device_id="r0/gpu0",
                                 give_up=give_up)
    assert time.monotonic() - started < 60.0  # old: the group's timeout (600 s)
    assert len(asked) == 3  # stopped waiting when told
    assert all(later - earlier >= 0.9 * JOIN_POLL_S for earlier, later in zip(asked, asked[1:]))  # every half second


class EngineDyingInInit(ScriptedEngineAdmin):
    """A fake engine whose init call fails as a dead process's does (no answer)."""

    async def init_weight_group(self, **kwargs: object) -> None:
        await asyncio.sleep(0.1)
        self.events.append(f"{self.url} died in init")
        raise EngineAdminError(f"{self.url}/init_weights_update_group failed: connection reset",
                               url=self.url) from EngineHTTPTransportError("connection reset")


class EngineJoiningForever(ScriptedEngineAdmin):
    """A fake engine whose join waits for the lost member (the gloo twin does, until the group's timeout)."""

    async def init_weight_group(self, **kwargs: object) -> None:
        self.events.append(f"{self.url} joining {kwargs['group_name']}")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.events.append(f"{self.url} join dropped")
            raise


async def rank0_waiting_for_the_group(channel: TrainerChannel, events: list[str], *, joins: bool = False) -> None:
    """Rank 0: after its plan, waits until every engine joined (their fakes record it) asking every 50 ms whether
    to go on waiting (or, `joins`, has joined at once)."""
    while True:
        command = await channel.next_command(0)
        events.append(f"trainer {type(command).__name__}")
        metrics: dict[str, object] = {}
        if isinstance(command, SyncWeightsCommand):
            channel.on_weight_plan(WeightPlan(weight_version=command.weight_version, master_address="127.0.0.1",
                                              master_port=1, buckets=[{"names": ["w"], "dtypes": ["float32"],
                                                                       "shapes": [[1]], "num_bytes": 4}]))
            joined = f" init {command.group_name}"
            while command.new_group and not joins and not (verdict := channel.join_verdict(command.seq)):
                if sum(event.endswith(joined) for event in events) == command.world_size - 1:
                    break
                await asyncio.sleep(0.05)
            else:
                if command.new_group and not joins:
                    events.append("trainer gave up the join")
                    metrics = {"join_abandoned": verdict}
        channel.on_done(CommandDone(rank=0, seq=command.seq, metrics=metrics))


def test_an_engine_dying_in_init_is_named_and_rank_0_and_the_others_stop_waiting() -> None:
    async def scenario() -> tuple[WeightGroupBroken, list[str], float]:
        events: list[str] = []
        channel = TrainerChannel(1)
        engines = [EngineInfo(engine_index=i, url=f"e{i}") for i in range(3)]
        admins = {0: EngineJoiningForever("e0", events), 1: EngineDyingInInit("e1", events),
                  2: EngineJoiningForever("e2", events)}
        trainer = asyncio.create_task(rank0_waiting_for_the_group(channel, events))
        started = time.monotonic()
        with pytest.raises(WeightGroupBroken) as broken:
            await push_weights_to_engines(version=1, channel=channel, engines=engines, admins=admins,  # type: ignore[arg-type]
                                          group=WeightGroup(), backend="gloo", bucket_bytes=4, timeout_s=30)
        trainer.cancel()
        return broken.value, events, time.monotonic() - started

    broken, events, seconds = asyncio.run(scenario())
    assert broken.engines == [1] and "e1/init_weights_update_group failed" in str(broken)
    assert seconds < 20.0  # old: the init gather waited on e0 and e2 (and rank 0 on its join) until their timeouts (30 s)
    assert events.index("e1 died in init") < events.index("trainer gave up the join")
    assert events.count("e0 join dropped") == 1 and events.count("e2 join dropped") == 1
    assert "trainer AbortWeightGroupCommand" not in events  # rank 0 never joined: nothing to abort


def test_rank_0_that_joined_after_all_has_the_group_aborted() -> None:
    async def scenario() -> list[str]:
        events: list[str] = []
        channel = TrainerChannel(1)
        engines = [EngineInfo(engine_index=i, url=f"e{i}") for i in range(2)]
        admins = {0: ScriptedEngineAdmin("e0", events), 1: EngineDyingInInit("e1", events)}
        trainer = asyncio.create_task(rank0_waiting_for_the_group(channel, events, joins=True))
        with pytest.raises(WeightGroupBroken):
            await push_weights_to_engines(version=1, channel=channel, engines=engines, admins=admins,  # type: ignore[arg-type]
                                          group=WeightGroup(), backend="gloo", bucket_bytes=4, timeout_s=30)
        trainer.cancel()
        return events

    events = asyncio.run(scenario())
    assert events[-1] == "trainer AbortWeightGroupCommand"  # its broadcast to e1 may be pending (NCCL)


def test_the_push_then_goes_to_the_engines_still_up() -> None:
    async def scenario() -> tuple[list[int], list[str]]:
        events: list[str] = []
        admins = {0: ScriptedEngineAdmin("e0", events), 1: EngineDyingInInit("e1", events)}
        weights, fleet, channel = weight_updates(2, admins)  # type: ignore[arg-type]
        trainer = asyncio.create_task(rank0_waiting_for_the_group(channel, events))
        await asyncio.wait_for(weights._push(1), 30)
        trainer.cancel()
        return fleet.failed, events

    failed, events = asyncio.run(scenario())
    assert failed == [1]  # old: EngineAdminError out of the sync: the run failed
    assert events[-1] == "e0 updated" and "trainer gave up the join" in events


def test_the_channel_tells_only_the_sync_it_gave_up() -> None:
    async def scenario() -> None:
        channel = TrainerChannel(1)
        run = asyncio.create_task(channel.run(lambda rank, seq: SyncWeightsCommand(
            seq=seq, weight_version=1, new_group=True, world_size=2, group_name="g", backend="gloo", bucket_bytes=4)))
        command = await channel.next_command(0)
        assert channel.join_verdict(command.seq) == ""
        channel.give_up_join("e1 died")
        assert channel.join_verdict(command.seq) == "e1 died" and channel.join_verdict(command.seq + 1) == ""
        channel.on_done(CommandDone(rank=0, seq=command.seq))
        await run

    asyncio.run(scenario())


def _member(port: int) -> None:
    """An engine that joins the group and receives one broadcast (in a forked process: one group name per process)."""
    import os

    import torch
    import torch.distributed as dist

    group = init_weight_update_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                                     group_name="g_ok", backend="gloo", timeout_seconds=60, device_id="e/gpu0")
    tensor = torch.zeros(3)
    dist.broadcast(tensor, src=0, group=group)
    os._exit(0 if tensor.tolist() == [1.0, 1.0, 1.0] else 3)


def test_a_join_that_completes_is_used() -> None:
    """With a member that joins, rank 0 asking `give_up` meanwhile gets its group as before."""
    import multiprocessing

    import torch
    import torch.distributed as dist

    port = free_port()
    member = multiprocessing.get_context("fork").Process(target=_member, args=(port,))
    member.start()
    try:
        group = init_weight_update_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                                         group_name="g_ok", backend="gloo", timeout_seconds=60, device_id="r0/gpu0",
                                         give_up=lambda: "")
        dist.broadcast(torch.ones(3), src=0, group=group)
        member.join(30)
        assert member.exitcode == 0
    finally:
        if member.is_alive():
            member.kill()
