"""Rollouts for the loop, one at a time (sync) or one ahead of training (async), with the engines watched.

Owns when a rollout's generation starts (async mode: rollout k+1 starts as soon as rollout k is
handed to the trainer, and a weight sync waits for it to finish, as slime's train_async.py), watching the
engines and the trainer while one generates or an eval runs (a lost fleet or a lost rank ends it; a restarted
engine gets the current weights at once when the trainer is idle: in sync mode, and during every eval), the
scheduler's state at each rollout boundary (what a checkpoint saved after rollout k-1
stores, although rollout k may already be generating), and stopping a rollout started ahead.
Not here: one rollout's generation, scoring, filtering and partial buffer (`hpc_rl.rollout.scheduler`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.retention import Retention
from hpc_rl.controller.stopping import stop_task
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.weight_updates import WeightUpdates
from hpc_rl.rollout.buffer_snapshot import json_state
from hpc_rl.rollout.scheduler import RolloutResult, RolloutScheduler

log = logging.getLogger(__name__)

T = TypeVar("T")


class Rollouts:
    """`await next(k)`: rollout k's kept groups (exactly rollout_batch_size), generated and scored."""

    def __init__(self, scheduler: RolloutScheduler, *, fleet: EngineFleet, channel: TrainerChannel,
                 weights: WeightUpdates, overlap: bool, num_rollout: int, retention: Retention | None = None) -> None:
        self.scheduler, self.fleet, self.channel, self.weights = scheduler, fleet, channel, weights
        self.retention = retention
        """Rollouts generated and not trained yet, journaled; a resume trains them first (controller/retention.py)."""
        self.overlap = overlap
        """Async mode: generate rollout k+1 while the trainer trains on rollout k."""
        self.num_rollout = num_rollout
        self._ahead: asyncio.Task[RolloutResult] | None = None
        self._boundary_states: dict[int, dict[str, Any]] = {}

    async def next(self, rollout_id: int) -> RolloutResult:
        """Rollout `rollout_id` (its metrics include time/rollout); async mode starts the next one."""
        start = time.perf_counter()
        self._boundary_states = {k: v for k, v in self._boundary_states.items() if k >= rollout_id}  # older: saved
        if self._ahead is None:
            self._ahead = asyncio.create_task(self._generate(rollout_id), name=f"rollout {rollout_id}")
        current = self._ahead
        try:
            result = await current
        finally:
            if current.done():  # its outcome is read here; one still unwinding is left to stop_ahead()
                self._ahead = None
        log.info("rollout %d generated in %.2f s", rollout_id, time.perf_counter() - start)
        result.metrics["time/rollout"] = time.perf_counter() - start
        if self.overlap and rollout_id + 1 < self.num_rollout:
            self._ahead = asyncio.create_task(self._generate(rollout_id + 1), name=f"rollout {rollout_id + 1} (ahead)")
        return result

    async def finish_ahead(self) -> None:
        """Async mode, before a weight sync: the rollout generated ahead ends with the weights it started with
        (slime's train_async.py waits for it too), so no request is in flight while the weights change and
        every sample of it is exactly one version behind the trainer. `next` reads its outcome. One exception: no
        engine serves and some wait for weights (every serving engine left or failed; the others joined or restarted
        since the last sync): the rollout ahead cannot end, so this returns and the sync comes now, while it generates
        (its later tokens are then the new version's, each token recording its version, as in place)."""
        while self._ahead is not None and not self._ahead.done():
            await asyncio.wait({self._ahead}, timeout=0.5)
            if self.fleet.engine_waiting.is_set() and not self.fleet.registry.serving_engines():
                log.info("no engine serves and %d wait(s) for weights: the sync comes while the rollout ahead "
                         "generates", sum(e.state.value == "starting" for e in self.fleet.registry.live_engines()))
                return

    @property
    def generating(self) -> bool:
        """A rollout is generating (started ahead and not done)."""
        return self._ahead is not None and not self._ahead.done()

    async def stop_ahead(self) -> None:
        """Stop a rollout started ahead of training (if any) and read its outcome."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            await stop_task(ahead, "a rollout started ahead of training")

    @property
    def buffer_size(self) -> int:
        return len(self.scheduler.buffer)

    # -- checkpoint --------------------------------------------------------------------------------------
    def state_before(self, rollout_id: int) -> dict[str, Any]:
        """The scheduler's state as rollout `rollout_id` started (or now, if it has not started)."""
        return json_state(self._boundary_states.get(rollout_id) or self.scheduler.state_dict())

    def restore(self, scheduler_state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(scheduler_state)

    # -- one rollout, watched ----------------------------------------------------------------------------
    def _check_engines(self) -> None:
        if self.fleet.fatal is not None:
            raise RuntimeError(f"rollout engines lost: {self.fleet.fatal}")
        if self.channel.failure is not None:
            raise self.channel.failure

    async def _generate(self, rollout_id: int) -> RolloutResult:
        """One rollout, watching the engines meanwhile (a restarted engine gets the current weights at once in
        sync mode, where the trainer is idle while a rollout generates); a retained one is taken instead, and a
        generated one journaled (`retention`)."""
        self._boundary_states[rollout_id] = before = self._snapshot()
        if self.retention is None or not self.retention.enabled:
            return await self.watch(self.scheduler.run(rollout_id, self.weights.version),
                                    f"rollout {rollout_id} generation", may_sync=not self.overlap)
        retained = self.retention.take(rollout_id, before)
        if retained is not None:  # the state it left, with the version the engines serve now
            self.scheduler.load_state_dict({**retained.state_after, **{k: v for k, v in before.items()
                                                                      if k == "weight_version"}})
            return RolloutResult(groups=retained.groups, metrics=retained.metrics | {
                "rollout/retained_samples_trained": float(retained.num_samples),
                "rollout/retained_weight_lag": float(self.weights.version - retained.weight_version),
                "rollout/generations_saved": float(self.retention.trained_samples)})  # this attempt's, so far
        version = self.weights.version
        result = await self.watch(self.scheduler.run(rollout_id, version),
                                  f"rollout {rollout_id} generation", may_sync=not self.overlap)
        await self.retention.keep(rollout_id, version, before, result.groups, result.metrics, self._snapshot())
        return result

    def _snapshot(self) -> dict[str, Any]:
        """The scheduler's state now, its partial buffer as memory copies (`RolloutScheduler.snapshot`: the state
        a rollout left is not copied again as the next one's start; a scheduler without one: its `state_dict`)."""
        snapshot = getattr(self.scheduler, "snapshot", None)
        return snapshot() if snapshot is not None else self.scheduler.state_dict()

    async def watch(self, work: Awaitable[T], what: str, *, may_sync: bool = True) -> T:
        """`work` (a rollout's generation, an eval) while the engines are watched: a lost fleet or a lost rank
        ends it, and, with `may_sync` (the trainer is idle meanwhile), an engine that restarted gets the current
        weights now, so `work` can use it: a restarted engine never serves before it has them, and an eval whose
        only engine restarted does not wait for one forever. However this ends (result, engine or trainer failure,
        cancellation), `work` has ended too and its outcome was read."""
        run = asyncio.ensure_future(work)
        outcome_read = False
        try:
            while True:
                waiting = asyncio.create_task(self.fleet.engine_waiting.wait())
                try:
                    done, _ = await asyncio.wait({run, waiting}, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiting.cancel()
                if run in done:
                    outcome_read = True
                    return run.result()
                self._check_engines()
                if self.fleet.engine_waiting.is_set() and may_sync:  # (joined or restarted: only they get the push)
                    await self.weights.serve_waiting("engine joined or restarted")
        finally:
            if not outcome_read:
                await stop_task(run, what)
