"""Stopping the controller's tasks leaves no exception unread: `stop_task`, a weight sync that fails or is
cancelled, the async loop's rollout-ahead when the loop is cancelled, and the driver's shutdown, which
cancels the controller's run before stopping the trainer (the "Task exception was never retrieved" seen
on scancel). Engines, trainer and steps are fakes named as such; every scenario runs on a loop that
records what asyncio would have printed about unread or abandoned tasks."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from hpc_rl.config import load_config
from hpc_rl.controller.engine_admin import EngineAdminError
from hpc_rl.controller.registry import EngineInfo, Registry, TrainerInfo
from hpc_rl.controller.rollout_stack import assemble_loop
from hpc_rl.controller.stopping import stop_task
from hpc_rl.controller.trainer_channel import TrainerChannel, TrainerFailed
from hpc_rl.controller.transports.broadcast import WeightGroup, push_weights_to_engines
from hpc_rl.data.samples import Sample
from hpc_rl.protocol.messages import CommandDone, SyncWeightsCommand, WeightPlan
from hpc_rl.rollout.scheduler import RolloutResult


def run_recording_asyncio_complaints(main: Callable[[], Awaitable[Any]]) -> list[str]:
    """Run `main()` on a fresh loop; return what asyncio reported (unread exceptions, pending tasks)."""
    complaints: list[str] = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _loop, context: complaints.append(context["message"]))
    try:
        loop.run_until_complete(main())
        gc.collect()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    gc.collect()
    return complaints


# ---- stop_task ----------------------------------------------------------------------------------------
def test_stop_task_cancels_waits_and_reports_an_error_once(caplog: pytest.LogCaptureFixture) -> None:
    async def cleanup_fails() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("abort failed: engine gone") from None

    async def slow_to_stop() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(0.2)
            raise RuntimeError("late failure") from None

    async def main() -> None:
        quiet = asyncio.create_task(asyncio.Event().wait())
        await asyncio.sleep(0)
        assert await stop_task(quiet, "an idle wait") is None and quiet.cancelled()

        failing = asyncio.create_task(cleanup_fails())
        await asyncio.sleep(0)
        error = await stop_task(failing, "rollout 3 generation")
        assert isinstance(error, RuntimeError)

        ended = asyncio.create_task(cleanup_fails())
        await asyncio.sleep(0)
        ended.cancel()
        await asyncio.sleep(0)  # ended with its error before anyone came to stop it
        assert isinstance(await stop_task(ended, "unreported", log_error=False), RuntimeError)

        slow = asyncio.create_task(slow_to_stop())
        await asyncio.sleep(0)
        assert await stop_task(slow, "a slow task", timeout_s=0.05) is None
        await asyncio.sleep(0.3)  # it ends later: its error is logged then, not lost

    with caplog.at_level(logging.WARNING, logger="hpc_rl.controller.stopping"):
        assert run_recording_asyncio_complaints(main) == []
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count("rollout 3 generation ended with an error: RuntimeError: abort failed: engine gone") == 1
    assert not any("unreported" in m for m in messages)
    assert "a slow task did not stop within 0 s of being cancelled; going on without it" in messages
    assert "a slow task ended with an error: RuntimeError: late failure" in messages


# ---- weight sync ---------------------------------------------------------------------------------------
class FailingEngineAdmin:
    """An engine (fake of EngineAdmin) whose weight update fails after the trainer has failed too."""

    def __init__(self, trainer_failed: asyncio.Event) -> None:
        self.trainer_failed = trainer_failed

    async def init_weight_group(self, **kwargs: object) -> None:
        pass

    async def weight_update(self, buckets: list) -> None:
        await self.trainer_failed.wait()
        await asyncio.sleep(0.05)  # the trainer side of the sync has ended (with TrainerFailed) by now
        raise EngineAdminError("http://e0/begin_weight_update answered HTTP 500")


PLAN = WeightPlan(weight_version=1, master_address="127.0.0.1", master_port=1, buckets=[])
ENGINES = [EngineInfo(engine_index=0, url="http://e0")]


def test_weight_sync_failing_on_both_sides_leaves_nothing_unread() -> None:
    async def main() -> None:
        channel = TrainerChannel(1)
        trainer_failed = asyncio.Event()

        async def fake_rank0_fails_after_the_plan() -> None:
            command = await channel.next_command(0)
            assert isinstance(command, SyncWeightsCommand)
            channel.on_weight_plan(PLAN)
            channel.on_done(CommandDone(rank=0, seq=command.seq, ok=False, error="NCCL timeout"))
            trainer_failed.set()

        rank = asyncio.create_task(fake_rank0_fails_after_the_plan())
        with pytest.raises(EngineAdminError):
            await push_weights_to_engines(version=1, channel=channel, engines=ENGINES,
                                          admins={0: FailingEngineAdmin(trainer_failed)},  # type: ignore[dict-item]
                                          group=WeightGroup(), backend="gloo", bucket_bytes=1)
        await rank
        assert isinstance(channel.failure, TrainerFailed)

    assert run_recording_asyncio_complaints(main) == []


def test_weight_sync_cancelled_then_trainer_lost_leaves_nothing_unread() -> None:
    """A sync interrupted by shutdown, then the trainer disconnects (the channel fails everything)."""

    async def main() -> None:
        channel = TrainerChannel(1)
        sync = asyncio.create_task(push_weights_to_engines(version=1, channel=channel, engines=ENGINES, admins={},
                                                           group=WeightGroup(), backend="gloo", bucket_bytes=1))
        await channel.next_command(0)  # the rank got the command; no plan comes
        sync.cancel()
        await asyncio.gather(sync, return_exceptions=True)
        channel.fail(TrainerFailed("trainer rank 0 disconnected"))

    assert run_recording_asyncio_complaints(main) == []


# ---- the loop ------------------------------------------------------------------------------------------
class FakeScheduler:
    """Rollout 0 is ready at once; rollout 1 (started ahead, async mode) runs until cancelled and then
    fails while cleaning up, as an abort to engines that are already gone would."""

    def __init__(self) -> None:
        self.buffer: list[Any] = []
        self.ahead_started = asyncio.Event()
        self.ahead_ended = False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def set_weight_version(self, version: int) -> None:
        pass

    async def run(self, rollout_id: int, weight_version: int) -> RolloutResult:
        if rollout_id == 0:
            groups = [[Sample(index=i, group_index=0, prompt="p", prompt_token_ids=[1], response_token_ids=[2],
                              response_logprobs=[-0.5], weight_versions=[0], reward=float(i))
                       for i in range(2)]]
            return RolloutResult(groups=groups)
        self.ahead_started.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.ahead_ended = True
            raise RuntimeError("abort_all failed: engines gone")
        raise AssertionError("unreachable")


class FakeFleet:
    """What the loop reads of the fleet (a fake of controller.engine_fleet.EngineFleet)."""

    def __init__(self) -> None:
        self.engine_waiting = asyncio.Event()
        self.fatal = None
        self.admins: dict[int, Any] = {}


def test_cancelling_the_async_loop_mid_training_stops_the_rollout_ahead(caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(["configs/tiny_cpu.yaml"])
    config.rollout.async_rollout = True
    config.rollout.n_samples_per_prompt = 2
    scheduler = FakeScheduler()

    async def main() -> None:
        registry = Registry(trainer_world_size=1, num_engines=1)
        registry.add_trainer(TrainerInfo(rank=0, world_size=1, host="h", pid=1, info={"dp_rank": 0, "dp_size": 1}))
        loop = assemble_loop(config, scheduler=scheduler, registry=registry, channel=TrainerChannel(1),  # type: ignore[arg-type]
                             fleet=FakeFleet(), recorder=None, evaluate=None, num_rollout=3)  # type: ignore[arg-type]
        run = asyncio.create_task(loop.run(resumed=False))
        await asyncio.wait_for(scheduler.ahead_started.wait(), 5)  # rollout 1 generates while rollout 0 trains
        run.cancel()  # shutdown (the trainer never answers here)
        await asyncio.gather(run, return_exceptions=True)
        assert run.cancelled() and scheduler.ahead_ended

    with caplog.at_level(logging.WARNING, logger="hpc_rl.controller.stopping"):
        assert run_recording_asyncio_complaints(main) == []
    errors = [r.getMessage() for r in caplog.records if "abort_all failed" in r.getMessage()]
    assert len(errors) == 1 and "rollout 1 generation ended with an error" in errors[0]


# ---- the driver's shutdown ------------------------------------------------------------------------------
class FakeTrainerStep:
    """Stopping it disconnects the trainer, which fails the channel (as the real torchrun step does)."""

    def __init__(self, channel: TrainerChannel, events: list[str], loop: asyncio.AbstractEventLoop) -> None:
        self.channel, self.events, self.loop = channel, events, loop

    def stop(self, grace_seconds: float = 10.0) -> int:
        self.events.append("trainer stopped")
        self.loop.call_soon_threadsafe(self.channel.fail, TrainerFailed("trainer rank 0 disconnected"))
        return 0


class FakeControllerForShutdown:
    """The parts of Controller that Driver.shutdown touches (a fake)."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.stopping = False
        self.channel = TrainerChannel(1)

    def note_stopping(self) -> None:
        self.stopping = True

    async def stop_engine_monitoring(self) -> None:
        self.events.append("monitoring stopped")

    async def run(self) -> None:
        try:
            await self.channel.run(lambda rank, seq: CommandDone(rank=rank, seq=seq))  # waits on the trainer
        finally:
            self.events.append("controller run ended")

    async def close(self) -> None:
        self.events.append("controller closed")


def test_driver_shutdown_cancels_the_controller_run_before_stopping_the_trainer() -> None:
    from hpc_rl.launch.driver import Driver
    from hpc_rl.launch.node_watch import NodeWatch
    from hpc_rl.launch.servers import Servers

    events: list[str] = []

    async def main() -> None:
        controller = FakeControllerForShutdown(events)
        driver = Driver.__new__(Driver)  # only the shutdown path: no config, run dir or processes
        driver.controller = controller  # type: ignore[assignment]
        driver.trainer_step = FakeTrainerStep(controller.channel, events, asyncio.get_running_loop())  # type: ignore[assignment]
        driver.servers = Servers.__new__(Servers)  # no engine, teacher or router started
        driver.servers.engine_steps, driver.servers.teacher_step, driver.servers.router = {}, None, None
        driver.nodes = NodeWatch.__new__(NodeWatch)
        driver.nodes._task = None  # no node watch (a local run)
        driver._engine_failures = {}
        driver.local = False  # (a local driver also ends the orphans it adopted: none here)
        driver.run_task = asyncio.create_task(controller.run())  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # the signal arrives while the run waits on the trainer
        await driver.shutdown()
        await asyncio.sleep(0.05)
        assert controller.stopping and driver.run_task.cancelled()

    assert run_recording_asyncio_complaints(main) == []
    assert events == ["monitoring stopped", "controller run ended", "trainer stopped", "controller closed"]
