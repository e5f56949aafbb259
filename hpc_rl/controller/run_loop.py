"""The RL loop the controller drives: rollout -> train -> weight sync, sync or async, with eval and saves.

Sync mode, per rollout k:

    [engines serve v=k]  rollout k (scheduler) ──> train k on every rank ──> v=k+1 ──> sync ──> eval/save
                                                   (colocated: hpc_rl.controller.colocated moves memory
                                                    around training, saves before the trainer offloads,
                                                    and syncs through /update_weights_from_tensor)
Async mode (overlap generation of k+1 with training of k; sync every update_weights_interval):

    rollout k ──┬─> train k ──> v=k+1 ──> sync (engines pause with abort, in-flight samples resume
                │                            after continue; tokens record the version that made them)
                └─> rollout k+1 (started as soon as rollout k returned) ──┬─> train k+1 ...
                                                                          └─> rollout k+2 ...
    The staleness of a sample = trainer version at its train step - version of its first token;
    the scheduler resets buffered partials that would exceed max_staleness.

An engine restarted after a failure waits for weights: when the trainer is idle (during a sync-mode
rollout) the loop pushes the current weights to every live engine at once; otherwise the next sync
includes it. The loop's state at each rollout boundary (data cursor, partial buffer, counters,
version) is what a checkpoint stores, so a resumed run replays the same data order.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpc_rl.config.schema import RunConfig
from hpc_rl.controller.colocated import KV_TAGS, TRAINER_TAGS, WEIGHTS_TAG, ColocatedMemory, push_weights_colocated
from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import EngineState, Registry
from hpc_rl.controller.stopping import stop_task
from hpc_rl.controller.train_batches import RewardShaping, split_for_data_parallel
from hpc_rl.controller.trainer_channel import TrainerChannel, merge_metrics
from hpc_rl.controller.weight_sync import WeightGroupState, push_weights_to_engines
from hpc_rl.protocol.messages import SaveCommand, StopCommand, TrainCommand
from hpc_rl.rollout.scheduler import RolloutResult, RolloutScheduler
from hpc_rl.telemetry.scalars import ScalarLog, progress_line

log = logging.getLogger(__name__)


@dataclass
class LoopState:
    """Where the run is: the next rollout to generate and the weight version the engines serve."""

    next_rollout_id: int = 0
    weight_version: int = 0


def trainer_summary(reported: dict[str, Any]) -> dict[str, Any]:
    """A rollout's train metrics: the last optimizer step's, plus the first step's ppo_kl / kl_loss
    (the first-step sanity checks: both are exactly 0 when weights = rollout weights = reference)."""
    steps = reported.get("steps") or []
    summary = {k: v for k, v in reported.items() if k != "steps"}
    if steps:
        summary.update(steps[-1])
        for key in ("ppo_kl", "kl_loss"):
            if key in steps[0]:
                summary[f"first_step_{key}"] = steps[0][key]
        summary["num_steps"] = len(steps)
    return summary


class RunLoop:
    """Drives trainer ranks and engines through `num_rollout` rollouts."""

    def __init__(self, *, config: RunConfig, registry: Registry, channel: TrainerChannel, fleet: EngineFleet,
                 scheduler: RolloutScheduler, scalars: ScalarLog, num_rollout: int,
                 run_eval: Callable[[int], Any] | None = None, print_fn: Callable[[str], None] = print) -> None:
        self.config = config
        self.registry = registry
        self.channel = channel
        self.fleet = fleet
        self.scheduler = scheduler
        self.scalars = scalars
        self.num_rollout = num_rollout
        self.run_eval = run_eval
        self.print = print_fn
        self.state = LoopState()
        self.group = WeightGroupState()
        self.shaping = RewardShaping(
            advantage_estimator=config.algorithm.advantage_estimator,
            n_samples_per_prompt=config.rollout.n_samples_per_prompt,
            std_normalization=not config.algorithm.disable_grpo_std_normalization,
            disabled=config.algorithm.disable_rewards_normalization,
        )
        self.backend = "gloo" if config.cluster.device == "cpu" else "nccl"
        self.colocated = ColocatedMemory(channel, self._engines_call,
                                         timeout_s=config.controller.engine_request_timeout) \
            if config.cluster.colocate else None
        """Colocated mode: the trainer's offload state and the memory moves (None: decoupled)."""
        self.trainer_busy = False
        self.last_metrics: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self._boundary_states: dict[int, dict[str, Any]] = {}
        self.stop_requested = False
        """Set on a timeout/preemption warning: save at the next rollout boundary and stop (requeue)."""
        self.stopped_for_requeue = False
        self._ahead: asyncio.Task[RolloutResult] | None = None
        """Async mode: the next rollout, started while the trainer works on the current one."""

    # -- state ---------------------------------------------------------------------------------------------
    def controller_state(self, next_rollout_id: int) -> dict[str, Any]:
        """What a checkpoint saved after rollout next_rollout_id-1 must hold to resume exactly."""
        scheduler_state = self._boundary_states.get(next_rollout_id) or self.scheduler.state_dict()
        return {"next_rollout_id": next_rollout_id, "weight_version": self.state.weight_version,
                "scheduler": scheduler_state}

    def restore(self, controller_state: dict[str, Any]) -> None:
        self.state.next_rollout_id = int(controller_state["next_rollout_id"])
        self.state.weight_version = int(controller_state["weight_version"])
        self.scheduler.load_state_dict(controller_state["scheduler"])
        self.scheduler.set_weight_version(self.state.weight_version)

    # -- the phases ----------------------------------------------------------------------------------------
    def _check_engines(self) -> None:
        if self.fleet.fatal is not None:
            raise RuntimeError(f"rollout engines lost: {self.fleet.fatal}")
        if self.channel.failure is not None:
            raise self.channel.failure

    async def _rollout(self, rollout_id: int) -> RolloutResult:
        """One rollout, watching the engines meanwhile. However this ends (result, engine or trainer
        failure, cancellation), the scheduler's task has ended too and its outcome was read."""
        self._boundary_states[rollout_id] = self.scheduler.state_dict()
        run = asyncio.create_task(self.scheduler.run(rollout_id, self.state.weight_version),
                                  name=f"rollout {rollout_id} generation")
        outcome_read = False
        try:
            while True:
                waiting = asyncio.create_task(self.fleet.engine_waiting.wait())
                try:
                    done, _ = await asyncio.wait({run, waiting}, timeout=1.0,
                                                 return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiting.cancel()
                if run in done:
                    outcome_read = True
                    return run.result()
                self._check_engines()
                if (self.fleet.engine_waiting.is_set() and not self.trainer_busy
                        and not self.config.rollout.async_rollout):
                    # A restarted engine: give it the current weights now, so the rollout can use it.
                    await self.sync_weights(self.state.weight_version, reason="engine restarted")
        finally:
            if not outcome_read:
                await stop_task(run, f"rollout {rollout_id} generation")

    async def _engines_call(self, method: str, *args: Any, engines: list[int] | None = None) -> None:
        indices = engines if engines is not None else [e.engine_index for e in self.registry.live_engines()]
        results = await asyncio.gather(*(getattr(self.fleet.admins[i], method)(*args) for i in indices),
                                       return_exceptions=True)
        for index, result in zip(indices, results):
            if isinstance(result, BaseException):
                await self.fleet.fail_engine(index, f"{method} failed: {result}")

    async def sync_weights(self, version: int, *, reason: str = "") -> dict[str, float]:
        """Push the trainer's weights as `version` to every live engine; waiting engines start serving."""
        start = time.perf_counter()
        engines = self.registry.live_engines()
        waiting = [e.engine_index for e in engines if e.state == EngineState.STARTING]
        pause_mode = "abort" if self.config.rollout.async_rollout else "retract"
        await self._engines_call("pause", pause_mode)
        metrics = await self._push_weights(version)
        await self._now_serving(version, waiting)
        await self._engines_call("resume_generation")
        if reason:
            log.info("weights v%d pushed (%s)", version, reason)
        metrics["time/weight_sync"] = time.perf_counter() - start
        return metrics

    async def _push_weights(self, version: int) -> dict[str, float]:
        """The trainer's weights to every live (paused) engine: a broadcast group (decoupled) or, colocated,
        each trainer rank to the engine on its GPUs (the trainer's weights onloaded for it if need be)."""
        engines = self.registry.live_engines()
        timeout_s = self.config.controller.engine_request_timeout
        bucket_bytes = self.config.rollout.update_weight_buffer_size
        if self.colocated is None:
            return await push_weights_to_engines(version=version, channel=self.channel, engines=engines,
                                                 admins=self.fleet.admins, group=self.group, backend=self.backend,
                                                 bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        was_offloaded = WEIGHTS_TAG in self.colocated.trainer_offloaded
        await self.colocated.trainer("onload", [WEIGHTS_TAG])
        metrics = await push_weights_colocated(
            version=version, channel=self.channel, engines=engines, admins=self.fleet.admins,
            num_engines=self.config.cluster.num_engines,
            engine_tp_size=self.config.cluster.rollout_num_gpus_per_engine, bucket_bytes=bucket_bytes,
            timeout_s=timeout_s)
        if was_offloaded:
            await self.colocated.trainer("offload", [WEIGHTS_TAG])
        return metrics

    async def _now_serving(self, version: int, waiting: list[int]) -> None:
        self.state.weight_version = version
        self.scheduler.set_weight_version(version)
        await self.fleet.mark_serving(waiting)

    async def _colocated_after_train(self, rollout_id: int, new_version: int, *, sync_due: bool,
                                     save_due: bool) -> dict[str, Any]:
        """Colocated, sync mode (see hpc_rl.controller.colocated): save while the trainer holds everything,
        free grads and optimizer state, reload the engines' released weights with the new version, free
        the trainer's weights, give the engines their KV cache back and let them generate."""
        assert self.colocated is not None
        metrics: dict[str, Any] = {}
        start = time.perf_counter()
        if save_due:
            metrics["time/save"] = await self._save(rollout_id, weight_version=new_version if sync_due else None)
        metrics.update(await self.colocated.trainer("offload", ["grads", "optimizer"]))
        if sync_due:
            waiting = [e.engine_index for e in self.registry.live_engines() if e.state == EngineState.STARTING]
            await self._engines_call("resume_memory", [WEIGHTS_TAG])
            metrics.update(await self._push_weights(new_version))
            await self._now_serving(new_version, waiting)
        else:
            self.state.weight_version = new_version  # trainer moved on; engines keep the older version
        await self.colocated.trainer("offload", [WEIGHTS_TAG])
        await self._engines_call("resume_memory", KV_TAGS)
        await self._engines_call("resume_generation")
        metrics["time/colocated_after_train"] = time.perf_counter() - start
        return metrics

    async def _train(self, rollout_id: int, result: RolloutResult) -> dict[str, Any]:
        dp_of = {rank: int(t.info.get("dp_rank", 0)) for rank, t in self.registry.trainers.items()}
        dp_size = max(1, int(next(iter(self.registry.trainers.values())).info.get("dp_size", 1)))
        batches = split_for_data_parallel(result.groups, self.shaping, dp_size)
        start = time.perf_counter()
        self.trainer_busy = True
        try:
            done = await self.channel.run(lambda rank, seq: TrainCommand(
                seq=seq, rollout_id=rollout_id, batch=batches[dp_of[rank]],
                meta={"weight_version": self.state.weight_version, "num_rollout": self.num_rollout}))
        finally:
            self.trainer_busy = False
        metrics = {f"train/{k}" if "/" not in k else k: v for k, v in trainer_summary(merge_metrics(done)).items()}
        metrics["time/train"] = time.perf_counter() - start
        return metrics

    async def _save(self, rollout_id: int, *, weight_version: int | None = None) -> float:
        start = time.perf_counter()
        state = self.controller_state(rollout_id + 1)
        if weight_version is not None:  # colocated saves before the sync that makes it current
            state["weight_version"] = weight_version
        await self.channel.run(lambda rank, seq: SaveCommand(seq=seq, rollout_id=rollout_id, controller_state=state))
        return time.perf_counter() - start

    def _save_due(self, rollout_id: int) -> bool:
        return self._due(self.config.checkpoint.save_interval, rollout_id) or self.stop_requested or (
            rollout_id + 1 == self.num_rollout and self.config.checkpoint.save is not None)

    def _due(self, interval: int | None, rollout_id: int) -> bool:
        return bool(interval) and (rollout_id + 1) % interval == 0  # type: ignore[operator]

    # -- the loop ------------------------------------------------------------------------------------------
    async def run(self, *, resumed: bool) -> dict[str, Any]:
        """Every rollout from `state.next_rollout_id` on. However this ends (done, requeue, error,
        cancellation), a rollout started ahead (async mode) has been stopped and its outcome read."""
        try:
            return await self._run(resumed)
        finally:
            ahead, self._ahead = self._ahead, None
            if ahead is not None:
                await stop_task(ahead, "a rollout started ahead of training")

    async def _run(self, resumed: bool) -> dict[str, Any]:
        start_id = self.state.next_rollout_id
        if self.colocated is not None and not self.config.rollout.async_rollout:
            await self.colocated.trainer("offload", TRAINER_TAGS)  # generation first: the engines get the GPUs
        if resumed and start_id > 0:
            await self.sync_weights(self.state.weight_version, reason="resumed from a checkpoint")
        if self.run_eval is not None and start_id == 0 and not self.config.eval.skip_eval_before_train:
            metrics = await self.run_eval(self.state.weight_version)
            self.scalars.log(metrics, 0)
            self.print(progress_line(-1, self.num_rollout, metrics).replace("rollout 0/", "eval before training /"))
        colocate = self.config.cluster.colocate
        overlap = self.config.rollout.async_rollout
        for rollout_id in range(start_id, self.num_rollout):
            metrics: dict[str, Any] = {}
            start = time.perf_counter()
            if self._ahead is None:
                self._ahead = asyncio.create_task(self._rollout(rollout_id), name=f"rollout {rollout_id}")
            current = self._ahead
            try:
                result = await current
            finally:
                if current.done():  # its outcome is read here; one still unwinding is left to run()
                    self._ahead = None
            log.info("rollout %d generated in %.2f s", rollout_id, time.perf_counter() - start)
            metrics.update(result.metrics)
            metrics["time/rollout"] = time.perf_counter() - start
            if overlap and rollout_id + 1 < self.num_rollout:
                self._ahead = asyncio.create_task(self._rollout(rollout_id + 1),
                                                  name=f"rollout {rollout_id + 1} (ahead)")
            released = colocate and not overlap
            sync_due = self._due(self.config.rollout.update_weights_interval, rollout_id) or \
                rollout_id + 1 == self.num_rollout
            saved = False
            if released:
                assert self.colocated is not None
                metrics.update(await self.colocated.before_train(sync_due))
            metrics.update(await self._train(rollout_id, result))
            new_version = self.state.weight_version + 1
            if released:
                saved = self._save_due(rollout_id)  # now, while the trainer holds its whole state
                metrics.update(await self._colocated_after_train(rollout_id, new_version, sync_due=sync_due,
                                                                 save_due=saved))
            elif sync_due:
                metrics.update(await self.sync_weights(new_version))
            else:
                self.state.weight_version = new_version  # trainer moved on; engines keep the older version
            if self.run_eval is not None and self._due(self.config.eval.eval_interval, rollout_id):
                eval_start = time.perf_counter()
                metrics.update(await self.run_eval(self.state.weight_version))
                metrics["time/eval"] = time.perf_counter() - eval_start
            if not saved and self._save_due(rollout_id):
                if self.colocated is not None and self.colocated.trainer_offloaded:  # stop asked after the save point
                    await self.colocated.trainer("onload", TRAINER_TAGS)
                metrics["time/save"] = await self._save(rollout_id)
            metrics["rollout/weight_version"] = float(self.state.weight_version)
            metrics["rollout/buffer_size"] = float(len(self.scheduler.buffer))
            metrics["time/step"] = time.perf_counter() - start
            self.scalars.log(metrics, rollout_id + 1)
            self._append_record(rollout_id, metrics, result)
            self.print(progress_line(rollout_id, self.num_rollout, metrics))
            self.last_metrics = metrics
            self.history.append(metrics)
            self.state.next_rollout_id = rollout_id + 1
            self._boundary_states.pop(rollout_id, None)
            if self.stop_requested and rollout_id + 1 < self.num_rollout:
                self.stopped_for_requeue = True
                ahead, self._ahead = self._ahead, None
                if ahead is not None:
                    await stop_task(ahead, "a rollout started ahead of training")
                self.print(f"stopping after rollout {rollout_id + 1} for requeue (checkpoint saved)")
                break
        return self.last_metrics

    def _append_record(self, rollout_id: int, metrics: dict[str, Any], result: RolloutResult) -> None:
        """One JSON line per rollout in <run_dir>/rollouts.jsonl: metrics and which samples were trained."""
        samples = [s for g in result.groups for s in g]
        record = {"rollout_id": rollout_id, "metrics": metrics,
                  "sample_indices": [s.index for s in samples],
                  "data_rows": [s.metadata.get("data_row") for g in result.groups for s in g[:1]],
                  "start_rollout_ids": [s.metadata.get("start_rollout_id") for g in result.groups for s in g[:1]],
                  "weight_versions_first_token": [min(s.weight_versions) if s.weight_versions else None
                                                  for s in samples]}
        with open(Path(self.config.run_dir) / "rollouts.jsonl", "a") as handle:
            handle.write(json.dumps(record, default=float) + "\n")

    async def stop_trainers(self, reason: str) -> None:
        if self.channel.failure is None:
            await self.channel.run(lambda rank, seq: StopCommand(seq=seq, reason=reason), timeout_s=120)
