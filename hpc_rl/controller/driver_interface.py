"""What the driver may ask of the controller, beyond its lifecycle (start, register_engine,
hand_gpus_to_trainer, run, close): the one door between `hpc_rl.launch` and the controller's state.

Owns those calls: a stop is under way (signals), an error for status.json (a lost node, how the trainer died),
USR2's checkpoint-and-requeue (kept until the loop exists), whether the run stopped for a requeue, a trainer
step or an engine process that exited, monitoring off, and SIGTERM's save-then-stop (`signal_stop`). The
driver writes no attribute of the controller and reads none but `address`. `Controller` inherits this class;
the attributes below are the controller's own (`app.py` sets them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import Registry
from hpc_rl.controller.run_loop import RunLoop
from hpc_rl.controller.signal_stop import stop_with_checkpoint
from hpc_rl.controller.trainer_channel import TrainerChannel, TrainerFailed


class DriverInterface:
    """The driver's calls into the controller (see the module docstring)."""

    channel: TrainerChannel
    fleet: EngineFleet
    registry: Registry
    loop: RunLoop | None
    stopping: bool
    last_error: str
    outcome: str
    _stop_for_requeue: bool

    def note_stopping(self) -> None:
        """A stop was asked for (a signal): a trainer or engine that disconnects from now on is not a failure."""
        self.stopping = True

    def report_error(self, message: str) -> None:
        """What ended (or ends) the run, as status.json's last_error shows it (a lost node, a trainer's exit)."""
        self.last_error = message

    def request_checkpoint_and_stop(self) -> None:
        """USR2: save at the next rollout boundary, then stop for a requeue (kept until the loop is built)."""
        self._stop_for_requeue = True
        if self.loop is not None:
            self.loop.stop_requested = True

    @property
    def stopped_for_requeue(self) -> bool:
        """The run saved and stopped at a rollout boundary as USR2 asked (the job runs again)."""
        return self.loop is not None and self.loop.stopped_for_requeue

    def trainer_exited(self, message: str) -> None:
        """The trainer step exited while the run goes on: it fails with `message` (unless it failed already)."""
        if self.channel.failure is None:
            self.channel.fail(TrainerFailed(message))

    @property
    def failed(self) -> bool:
        return self.channel.failure is not None

    def engine_exited(self, engine_index: int, reason: str) -> Coroutine[Any, Any, None] | None:
        """An engine's process exited: the fleet's failure path (restart or fail), or None when the engine is
        not registered or failed already."""
        engine = self.registry.engines.get(engine_index)
        if engine is None or engine.state.value == "failed":
            return None
        return self.fleet.fail_engine(engine_index, reason)

    async def stop_engine_monitoring(self) -> None:
        await self.fleet.stop_monitoring()

    async def stop_with_checkpoint(self, run: asyncio.Task[Any], grace_s: float) -> str:
        """SIGTERM: engines that die now stay down; save what `grace_s` allows and end `run` (`signal_stop`)."""
        self.fleet.restart = None  # (Slurm signals every step at once)
        await self.fleet.stop_monitoring()
        outcome = await stop_with_checkpoint(self.loop, self.channel, run, grace_s)
        self.outcome = "stopped"
        return outcome
