"""The RL loop, as the algorithm: for each rollout id, generate -> train -> sync weights -> eval -> save.

Processes (one Slurm job; `python -m hpc_rl.submit` on the login node submitted it):

    driver (first trainer node) ── controller: this loop, asyncio, no torch
        ├── TCP, HMAC'd commands ──> torchrun trainer ranks (Megatron-core: TP/PP/CP/DP)
        └── HTTP ──> SGLang engines (srun steps; colocated: on the trainer's GPUs): batched /generate
                     straight to an engine, single requests through sglang-router
                                            ^── weights: trainer rank 0 broadcasts (NCCL/gloo group)

One rollout's data path, and the call below that owns each step:

    prompts (partial buffer first, then the dataset) ─> engines /generate ─> tokens, logprobs
      ─> rewards, per group ─> dynamic-sampling filter ─> rollout_batch_size groups  rollouts.next
      ─> group-normalised rewards, DP split ─> ranks: loss, optimizer step           trainers.train
      ─> rank 0's buckets ─> every engine serves version k+1 (if due)                weights.after_train
      ─> eval (eval_interval) ─> checkpoint (save_interval) ─> rollouts.jsonl,       evaluate, checkpoints
         TensorBoard, one progress line                                              recorder.rollout

Modes: sync runs the steps in order. Async starts rollout k+1 inside rollouts.next(k), so it generates
while k trains; before a sync the loop waits for it to finish (slime's train_async.py), so every sample
is one weight version behind the trainer and no request is in flight while the weights change (a sync
with nothing in flight needs no pause/continue pair: SGLang takes its update lock at once); with
rollout.flush_cache_interval other than 1 the sync does not wait: the engines pause in place and the rollout's
requests go on with the new weights (weight_updates.py). Colocated (sync): engines and trainer trade the GPUs in
weights.before_train / after_train (colocated_memory.py), and the checkpoint is written in between, while the
trainer holds its whole state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hpc_rl.config.schema import EvalConfig
from hpc_rl.controller.checkpoints import Checkpoints, every
from hpc_rl.controller.rollouts import Rollouts
from hpc_rl.controller.trainers import Trainers
from hpc_rl.controller.weight_updates import WeightUpdates
from hpc_rl.telemetry.recorder import RunRecorder

Evaluate = Callable[[int, int], Awaitable[dict[str, float]]]
"""Eval rollouts with the engines' current weights (the arguments: their version, and the rollout id the eval
follows, 0 before training); eval/... metrics."""


class RunLoop:
    """Rollouts `next_rollout_id` .. `num_rollout` - 1, one call per step into the part that owns it."""

    def __init__(self, *, rollouts: Rollouts, trainers: Trainers, weights: WeightUpdates, checkpoints: Checkpoints,
                 recorder: RunRecorder, evaluate: Evaluate | None, eval_config: EvalConfig, num_rollout: int,
                 first_rollout_id: int = 0) -> None:
        self.rollouts, self.trainers, self.weights = rollouts, trainers, weights
        self.checkpoints, self.recorder, self.evaluate = checkpoints, recorder, evaluate
        self.eval_config, self.num_rollout = eval_config, num_rollout
        self.next_rollout_id = first_rollout_id
        """Where a run that does not resume starts (checkpoint.start_rollout_id); `restore` moves it."""
        self.stop_requested = False
        """Set on a timeout/preemption warning: save at the next rollout boundary and stop (requeue)."""
        self.stopped_for_requeue = False
        self.restored_scheduler: dict[str, Any] | None = None
        """The scheduler state of the checkpoint this run resumed from (None: a fresh start): retained rollouts
        that continue it are trained first (`Rollouts.retention`)."""
        self.unrecorded: tuple[int, dict[str, Any], list[Any]] | None = None
        """(rollout id, metrics so far, groups) of a rollout trained but not yet recorded (its sync, eval or save
        still to come): a stop that cuts the loop there and saves it records it (`record_cut_rollout`)."""

    async def run(self, *, resumed: bool) -> dict[str, Any]:
        """However this ends (done, requeue, error, cancellation), a rollout started ahead has stopped."""
        try:
            if self.rollouts.retention is not None:  # before the engines get the checkpoint's weights (start)
                await asyncio.to_thread(self.rollouts.retention.attach, next_rollout_id=self.next_rollout_id,
                                        weight_version=self.weights.version, scheduler_state=self.restored_scheduler)
            await self.weights.start(resumed=resumed and self.next_rollout_id > 0)
            if self.evaluate and self.next_rollout_id == 0 and not self.eval_config.skip_eval_before_train:
                self.recorder.eval_before_training(await self.rollouts.watch(self.evaluate(self.weights.version, 0),
                                                                            "eval before training"))
            for rollout_id in range(self.next_rollout_id, self.num_rollout):
                start = time.perf_counter()
                result = await self.rollouts.next(rollout_id)  # generate, score, filter; partial buffer in and out
                metrics = dict(result.metrics)
                sync_due = self.weights.sync_due(rollout_id)
                metrics |= await self.weights.before_train(sync_due)  # colocated: the engines hand over the GPUs
                metrics |= await self.trainers.train(rollout_id, result.groups, self.weights.version)
                self.unrecorded = (rollout_id, metrics, result.groups)  # trained: a stop that saves it records it
                version = self.weights.version + 1
                if self.weights.moves_memory:  # colocated: save now, while the trainer holds its whole state
                    metrics |= await self.checkpoints.save_if_due(rollout_id, version, stopping=self.stop_requested,
                                                                  unrecorded=self.unrecorded)
                if sync_due and not self.weights.in_place:  # async: the rollout ahead ends on the weights it
                    await self.rollouts.finish_ahead()  # started with (in place: its requests pause and go on)
                metrics |= await self.weights.after_train(version, sync_due=sync_due,
                                                          generating=self.rollouts.generating)
                if self.evaluate and every(self.eval_config.eval_interval, rollout_id):
                    eval_start = time.perf_counter()
                    metrics |= await self.rollouts.watch(self.evaluate(self.weights.version, rollout_id),
                                                         f"eval after rollout {rollout_id}")  # engines watched
                    metrics["time/eval"] = time.perf_counter() - eval_start
                stopping = self.stop_requested
                if not stopping:
                    metrics |= await self.checkpoints.save_if_due(rollout_id, self.weights.version, stopping=False,
                                                                  unrecorded=self.unrecorded)
                metrics |= {"rollout/weight_version": float(self.weights.version),
                            "rollout/buffer_size": float(self.rollouts.buffer_size),
                            "time/step": time.perf_counter() - start}
                self.recorder.rollout(rollout_id, metrics, result.groups)
                self.unrecorded = None
                if stopping:  # recorded first: a save the stop's kill cuts short leaves an older checkpoint, whose
                    await self.checkpoints.save_if_due(rollout_id, self.weights.version, stopping=True)  # resume
                self.next_rollout_id = rollout_id + 1  # drops this record; one that lands after the grace keeps it
                if self.stop_requested and rollout_id + 1 < self.num_rollout:
                    self.stopped_for_requeue = True
                    self.recorder.print(f"stopping after rollout {rollout_id + 1} for requeue (checkpoint saved)")
                    break
        finally:
            await self.rollouts.stop_ahead()
        return self.recorder.last

    def record_cut_rollout(self, rollout_id: int) -> bool:
        """A stop cut the loop after rollout `rollout_id` trained and saved it: its record is written (with the
        metrics it had), so rollouts.jsonl holds every rollout the checkpoint holds. Whether there was one."""
        if self.unrecorded is None or self.unrecorded[0] != rollout_id:
            return False
        _, metrics, groups = self.unrecorded
        self.recorder.rollout(rollout_id, metrics, groups)
        self.unrecorded = None
        self.next_rollout_id = rollout_id + 1
        return True

    def restore(self, controller_state: dict[str, Any]) -> None:
        """Continue from a checkpoint's controller state (`Checkpoints.controller_state`)."""
        self.rollouts.restore(controller_state["scheduler"])
        self.restored_scheduler = controller_state["scheduler"]
        self.weights.restore(int(controller_state["weight_version"]))
        self.next_rollout_id = int(controller_state["next_rollout_id"])
        self.recorder.forget_from(self.next_rollout_id)
        self.recorder.recover(controller_state.get("rollout_record"))  # the attempt died before writing it
