"""When the loop saves, and what the controller's part of a checkpoint holds.

Owns the save schedule (every `save_interval` rollouts, at the end of a run with a `save` dir, and at
the next rollout boundary after a timeout/preemption warning), the controller state a checkpoint saved
after rollout k carries (next rollout id, weight version, the scheduler's state as rollout k+1 started:
data cursor, partial buffer, counters, and rollout k's `rollouts.jsonl` record when it is not written yet:
the record is written after the save, so a controller that dies between the two would lose it; a resume
writes it from the checkpoint, `RunRecorder.recover`), and saving once per rollout. Not here: writing the files (the
trainer ranks do, `hpc_rl.training.checkpoint`) and reading them back on resume (`RunLoop.restore`).
"""

from __future__ import annotations

from typing import Any

from hpc_rl.config.schema import CheckpointConfig
from hpc_rl.controller.colocated_memory import TRAINER_TAGS, ColocatedMemory
from hpc_rl.controller.fault_hooks import KILL_CONTROLLER_AFTER_SAVE, kill_here_if_asked
from hpc_rl.controller.rollouts import Rollouts
from hpc_rl.controller.trainers import Trainers
from hpc_rl.telemetry.run_files import rollout_record

Unrecorded = tuple[int, dict[str, Any], list[Any]]
"""(rollout id, metrics so far, groups) of a rollout trained but not recorded yet (`RunLoop.unrecorded`)."""


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

    def controller_state(self, next_rollout_id: int, weight_version: int,
                         unrecorded: Unrecorded | None = None) -> dict[str, Any]:
        """What a checkpoint saved after rollout next_rollout_id-1 must hold to resume exactly (with that
        rollout's record when `unrecorded` is it: not in rollouts.jsonl yet)."""
        state: dict[str, Any] = {"next_rollout_id": next_rollout_id, "weight_version": weight_version,
                                 "scheduler": self.rollouts.state_before(next_rollout_id)}
        if unrecorded is not None and unrecorded[0] == next_rollout_id - 1:
            rollout_id, metrics, groups = unrecorded
            state["rollout_record"] = rollout_record(rollout_id, metrics, groups)
        return state

    async def save_if_due(self, rollout_id: int, weight_version: int, *, stopping: bool,
                          unrecorded: Unrecorded | None = None) -> dict[str, float]:
        """Every rank saves rollout `rollout_id` (with the trainer holding `weight_version`), if due now;
        `unrecorded`: the rollout trained but not in rollouts.jsonl yet (its record goes in the checkpoint)."""
        if self._saved_rollout == rollout_id or not self.due(rollout_id, stopping=stopping):
            return {}
        if self.colocated is not None and self.colocated.trainer_offloaded:  # a stop asked after the save point
            await self.colocated.trainer("onload", TRAINER_TAGS)
        seconds = await self.trainers.save(rollout_id, self.controller_state(rollout_id + 1, weight_version,
                                                                             unrecorded))
        self._saved_rollout = rollout_id
        kill_here_if_asked(KILL_CONTROLLER_AFTER_SAVE, rollout_id)  # tests: the window before the record
        if self.rollouts.retention is not None:  # retained rollouts up to this one are not needed any more
            await self.rollouts.retention.checkpointed(rollout_id)
        return {"time/save": seconds}
