"""When the loop saves, and what the controller's part of a checkpoint holds.

Owns the save schedule (every `save_interval` rollouts, at the end of a run with a `save` dir, and at
the next rollout boundary after a timeout/preemption warning), the controller state a checkpoint saved
after rollout k carries (next rollout id, weight version, the scheduler's state as rollout k+1 started:
data cursor, partial buffer, counters), and saving once per rollout. Not here: writing the files (the
trainer ranks do, `hpc_rl.training.checkpoint`) and reading them back on resume (`RunLoop.restore`).
"""

from __future__ import annotations

from typing import Any

from hpc_rl.config.schema import CheckpointConfig
from hpc_rl.controller.colocated import TRAINER_TAGS, ColocatedMemory
from hpc_rl.controller.rollouts import Rollouts
from hpc_rl.controller.trainers import Trainers


def every(interval: int | None, rollout_id: int) -> bool:
    """True after every `interval`-th rollout (never without an interval)."""
    return bool(interval) and (rollout_id + 1) % interval == 0  # type: ignore[operator]


class Checkpoints:
    """`save_if_due(k, version, stopping=...)` after rollout k; a second call for the same rollout is a no-op."""

    def __init__(self, checkpoint: CheckpointConfig, *, trainers: Trainers, rollouts: Rollouts,
                 colocated: ColocatedMemory | None, num_rollout: int) -> None:
        self.checkpoint, self.trainers, self.rollouts = checkpoint, trainers, rollouts
        self.colocated = colocated
        self.num_rollout = num_rollout
        self._saved_rollout: int | None = None

    @property
    def saved_rollout(self) -> int | None:
        """The rollout this run saved last (None: none yet)."""
        return self._saved_rollout

    def due(self, rollout_id: int, *, stopping: bool) -> bool:
        return every(self.checkpoint.save_interval, rollout_id) or stopping or (
            rollout_id + 1 == self.num_rollout and self.checkpoint.save is not None)

    def controller_state(self, next_rollout_id: int, weight_version: int) -> dict[str, Any]:
        """What a checkpoint saved after rollout next_rollout_id-1 must hold to resume exactly."""
        return {"next_rollout_id": next_rollout_id, "weight_version": weight_version,
                "scheduler": self.rollouts.state_before(next_rollout_id)}

    async def save_if_due(self, rollout_id: int, weight_version: int, *, stopping: bool) -> dict[str, float]:
        """Every rank saves rollout `rollout_id` (with the trainer holding `weight_version`), if due now."""
        if self._saved_rollout == rollout_id or not self.due(rollout_id, stopping=stopping):
            return {}
        if self.colocated is not None and self.colocated.trainer_offloaded:  # a stop asked after the save point
            await self.colocated.trainer("onload", TRAINER_TAGS)
        seconds = await self.trainers.save(rollout_id, self.controller_state(rollout_id + 1, weight_version))
        self._saved_rollout = rollout_id
        return {"time/save": seconds}
