"""What a run leaves behind for each rollout: TensorBoard scalars, a line in `rollouts.jsonl`, the
progress line on stdout; and the metrics history the controller's status reads.

Owns the order of those three, forgetting the records of rollouts a resumed run redoes, and recovering the
record a checkpoint carries when the attempt died before writing it. The record's
format is `run_files.rollout_record`'s; the scalars and the progress line are `scalars`'.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_rl.data.samples import Group
from hpc_rl.telemetry.run_files import (
    REDONE_RECORDS, ROLLOUT_RECORDS, append_line, append_rollout_record, drop_rollout_records_from, recorded_rollouts,
    write_debug_rollout_data,
)
from hpc_rl.telemetry.scalars import ScalarLog, progress_line
from hpc_rl.telemetry.zero_rewards import ZeroRewardWatch

log = logging.getLogger(__name__)


class RunRecorder:
    """One run's per-rollout output; `last` and `history` are the metrics recorded so far."""

    def __init__(self, run_dir: str | Path, scalars: ScalarLog, *, num_rollout: int,
                 print_fn: Callable[[str], None] = print, eval_sampling: str = "",
                 debug_rollout_data: str | None = None) -> None:
        self.records = Path(run_dir) / ROLLOUT_RECORDS
        self.debug_rollout_data = debug_rollout_data
        """logging.save_debug_rollout_data: every trained sample of each rollout, to this path template."""
        self.scalars = scalars
        self.num_rollout = num_rollout
        self.print = print_fn
        self.eval_sampling = eval_sampling
        """How eval samples ("greedy", "temperature 0.6"), shown next to its scores."""
        self.last: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.zero_rewards = ZeroRewardWatch()
        """Warns once when every reward was 0 for many rollouts in a row (`zero_rewards`)."""

    @property
    def warnings(self) -> list[str]:
        """What status shows under warnings about the rollouts recorded (a run that cannot score)."""
        return [self.zero_rewards.warning] if self.zero_rewards.warning else []

    def eval_before_training(self, metrics: dict[str, Any]) -> None:
        self.scalars.log(metrics, 0)
        self.print(progress_line(-1, self.num_rollout, metrics, eval_sampling=self.eval_sampling)
                   .replace("rollout 0/", "eval before training /"))

    def rollout(self, rollout_id: int, metrics: dict[str, Any], groups: list[Group]) -> None:
        """Rollout `rollout_id` is done: scalars at step rollout_id + 1, its record, its progress line."""
        self.scalars.log(metrics, rollout_id + 1)
        append_rollout_record(self.records, rollout_id, metrics, groups)
        if self.debug_rollout_data:
            write_debug_rollout_data(self.debug_rollout_data, rollout_id, groups)
        self.last = metrics
        self.history.append(metrics)
        rewards = [m["rollout/reward_mean"] for m in self.history if "rollout/reward_mean" in m]
        self.print(progress_line(rollout_id, self.num_rollout, metrics, rewards_so_far=rewards,
                                 eval_sampling=self.eval_sampling))
        self.zero_rewards.see(rollout_id, metrics, groups)

    def forget_from(self, first_redone: int) -> None:
        """A resumed run redoes rollouts >= `first_redone`: drop their records (the stopped attempt wrote them)."""
        dropped = drop_rollout_records_from(self.records, first_redone)
        if dropped:
            log.warning("%s: moved %d record(s) of rollouts >= %d to %s, written after the checkpoint by the "
                        "attempt that was stopped (those rollouts are redone now)", ROLLOUT_RECORDS, dropped,
                        first_redone, REDONE_RECORDS)

    def recover(self, record: dict[str, Any] | None) -> bool:
        """A checkpoint's copy of its last rollout's record (`Checkpoints.controller_state`): written when
        rollouts.jsonl lacks it but holds the rollout before it (the attempt died after the checkpoint committed,
        before the record; a new run dir that loads another run's checkpoint has neither: its history is that
        run's). Whether it was."""
        if not isinstance(record, dict) or not isinstance(record.get("rollout_id"), int):
            return False
        rollout_id, recorded = record["rollout_id"], recorded_rollouts(self.records)
        if rollout_id in recorded or (rollout_id > 0 and rollout_id - 1 not in recorded):
            return False
        append_line(self.records, json.dumps({**record, "recovered_from_checkpoint": True}))
        log.warning("%s: rollout %d's record was missing (its attempt died after the checkpoint was committed, "
                    "before the record was written): written from the checkpoint", ROLLOUT_RECORDS,
                    record["rollout_id"])
        return True

    def close(self) -> None:
        self.scalars.close()
