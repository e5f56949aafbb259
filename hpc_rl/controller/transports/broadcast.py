"""The broadcast transport's controller half: trainer rank 0 broadcasts over a weight-update group (NCCL on
GPUs, gloo on CPU), the controller drives every engine. Its trainer half: `hpc_rl.training.transports.broadcast`.

Owns the live group (`WeightGroup`), one push over it (`GroupPush`), and recovery from an engine that
breaks it (`BroadcastTransport`). The SGLang protocol sequence on the engine side and its interleaving with
the trainer:

    controller                           trainer ranks                 engines (HTTP, concurrently)
    SyncWeights(version, new_group) -->  gather TP shards, plan buckets
                                    <--  rank 0: WeightPlan(addr, port, buckets)
    [new group] destroy old group ---------------------------------->  /destroy_weights_update_group
                init group (rank offsets) --------------------------->  /init_weights_update_group
                                         rank 0 joins the group  <==>  (the calls return when all joined)
    per engine, pipelined on one connection (one write; the engine runs them in order):
      begin -------------------------------------------------------->  /begin_weight_update
      per bucket: update (names, dtypes, shapes) ------------------->  /update_weights_from_distributed
                                         rank 0 broadcasts bucket ==>  (each call returns after its bucket)
      end ---------------------------------------------------------->  /end_weight_update
                                    <--  CommandDone from every rank

The group is rebuilt only when the set of engine processes changed: a restarted engine (same index and
URL, new incarnation) joins a new group, whether or not a sync happened while it was down.

An engine that dies (or fails) before the new group is complete (its /init_weights_update_group fails) would
hold rank 0, which waits for every member, until the group's timeout (600 s): the controller tells rank 0 to
stop waiting (`TrainerChannel.give_up_join`, asked by rank 0 every half second), drops the other engines' init
calls and raises `WeightGroupBroken` naming the engine, which is failed and restarted as below; the push is
made again over a new group of the engines still up.

An engine that dies (or fails) mid-update breaks the group: on NCCL the broadcast never completes, rank 0
does not notice (its `wait()` does not block) and its next GPU work would hang until NCCL's watchdog.
The controller knows at once (the engine's update call fails): it has rank 0 abort the group
(`AbortWeightGroupCommand`), gives the other engines ABORT_GRACE_S to end their update, and raises
`WeightGroupBroken` naming every engine that failed; the caller fails them (restart) and pushes again
to the engines still up, over a new group (`BroadcastTransport.push`).

Pausing and resuming generation around the sync is the caller's (the loop knows the mode); whether the engines
flush their cache after the update is its too (`flush_cache` of each update call: False while requests are
paused in place); the fan-out of the update calls is `transports.fanout`. However a sync ends (done, engine or
trainer error, cancellation), the trainer-side task has ended and its outcome was read, and the weight-plan
future is settled, so nothing is left for asyncio to complain about.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from hpc_rl.controller.engine_admin import BucketUpdate, EngineAdmin, EngineAdminError
from hpc_rl.controller.registry import EngineInfo
from hpc_rl.controller.stopping import stop_task
from hpc_rl.controller.trainer_channel import TrainerChannel, TrainerFailed
from hpc_rl.controller.transports.base import WeightTransport
from hpc_rl.controller.transports.fanout import StuckEngine, WeightGroupBroken, update_every_engine
from hpc_rl.controller.transports.fanout_workers import call_every_engine, calls_in_workers, started_in_workers
from hpc_rl.protocol.messages import AbortWeightGroupCommand, SyncWeightsCommand, WeightPlan
from hpc_rl.rollout.answer_pool import AnswerPool
from hpc_rl.weights import DEFAULT_GROUP_NAME

log = logging.getLogger(__name__)

__all__ = ["ABORT_GRACE_S", "BroadcastTransport", "GroupPush", "WeightGroup", "WeightGroupBroken",
           "push_weights_to_engines", "rank_offsets"]

ABORT_GRACE_S = 30.0
"""After an engine broke a sync and the trainer aborted its side of the group: how long the other engines get
to answer their update (gloo peers fail at once when rank 0's side goes; SGLang on NCCL may stay in the
broadcast until its own watchdog) before they count as broken too (failed, so restarted)."""


@dataclass
class WeightGroup:
    """The live weight-update group: which engines it was built with, and its name."""

    members: list[tuple[int, str, int]] = field(default_factory=list)
    """(engine index, URL, incarnation) of each member: a restarted engine (same index and URL, new
    process) is a new member, so the group is rebuilt even when no sync happened while it was down."""
    group_name: str = DEFAULT_GROUP_NAME
    generation: int = 0

    @property
    def name(self) -> str:
        return f"{self.group_name}_{self.generation}"

    def previous_name(self) -> str:
        return f"{self.group_name}_{self.generation - 1}"

    def holds(self, engine_index: int) -> bool:
        return any(index == engine_index for index, _, _ in self.members)


def rank_offsets(engines: list[EngineInfo]) -> tuple[dict[int, int], int]:
    """Engine i joins at 1 + sum of earlier engines' TP sizes; world = 1 + all engines' GPUs."""
    offsets: dict[int, int] = {}
    next_rank = 1
    for engine in engines:
        offsets[engine.engine_index] = next_rank
        next_rank += engine.tp_size
    return offsets, next_rank


class GroupPush:
    """One push of `version` over the group (module docstring): the trainer side's task and the weight-plan
    future live here, so however the push ends both are settled and read."""

    def __init__(self, *, version: int, channel: TrainerChannel, engines: list[EngineInfo],
                 admins: dict[int, EngineAdmin], group: WeightGroup, backend: str, bucket_bytes: int,
                 timeout_s: float = 600.0, on_stuck: StuckEngine | None = None, clear_stale_groups: bool = False,
                 flush_cache: bool = True, pool: AnswerPool | None = None) -> None:
        self.pool = pool
        """The answer workers: they make the update's exchanges (transports.fanout_workers); None: the loop does."""
        self.version, self.channel, self.engines, self.admins, self.group = version, channel, engines, admins, group
        self.backend, self.bucket_bytes, self.timeout_s = backend, bucket_bytes, timeout_s
        self.on_stuck, self.clear_stale_groups, self.flush_cache = on_stuck, clear_stale_groups, flush_cache
        self.members = [(e.engine_index, e.url, e.incarnation) for e in engines]
        self.new_group = self.members != group.members
        self.offsets, self.world_size = rank_offsets(engines)
        self.trainer_task: asyncio.Task[Any] | None = None
        self.trainer_outcome_read = False

    def _command(self, rank: int, seq: int) -> SyncWeightsCommand:
        return SyncWeightsCommand(seq=seq, weight_version=self.version, new_group=self.new_group,
                                  world_size=self.world_size, group_name=self.group.name, backend=self.backend,
                                  bucket_bytes=self.bucket_bytes)

    async def _trainer_outcome(self) -> Any:
        assert self.trainer_task is not None
        self.trainer_outcome_read = True
        return await self.trainer_task

    async def _abort_group(self, reason: str) -> None:
        await self.channel.run(lambda rank, seq: AbortWeightGroupCommand(seq=seq, reason=reason),
                               timeout_s=self.timeout_s)

    async def run(self) -> dict[str, float]:
        """Push the trainer's current weights to the engines as `version`; timing metrics."""
        start = time.perf_counter()
        if self.new_group:
            self.group.generation += 1
        plan_future = self.channel.expect_weight_plan()
        what = f"the trainer side of weight sync v{self.version}"
        self.trainer_task = asyncio.create_task(self.channel.run(self._command, timeout_s=self.timeout_s), name=what)
        try:
            plan = await asyncio.wait_for(asyncio.shield(plan_future), self.timeout_s)
            if self.new_group:
                await self._build_group(plan)
            await update_every_engine([self.admins[e.engine_index] for e in self.engines], self._buckets(plan),
                                      on_stuck=self.on_stuck, on_break=self._abort_trainer_side,
                                      settle_s=ABORT_GRACE_S, pool=self.pool)
            await self._trainer_outcome()
        except WeightGroupBroken as broken:
            self.group.members = []  # rebuild next time
            broken.engines = [self.engines[position].engine_index for position in broken.positions]
            raise
        except (EngineAdminError, asyncio.TimeoutError):
            self.group.members = []  # rebuild next time
            raise
        finally:
            await self._settle(plan_future, what)
        seconds = time.perf_counter() - start
        total_bytes = sum(int(b.get("num_bytes", 0)) for b in plan.buckets)
        log.info("weights v%d -> %d engine(s): %d bucket(s), %.1f MB in %.2f s%s%s%s", self.version,
                 len(self.engines), len(plan.buckets), total_bytes / 1e6, seconds,
                 " (new group)" if self.new_group else "", "" if self.flush_cache else " (in place, cache kept)",
                 f" (through {self.pool.workers} answer worker(s))" if self.pool is not None else "")
        return {"weight_sync/seconds": seconds, "weight_sync/buckets": float(len(plan.buckets)),
                "weight_sync/mbytes": total_bytes / 1e6, "weight_sync/new_group": float(self.new_group),
                "perf/weight_sync_bytes": float(total_bytes)}

    def _buckets(self, plan: WeightPlan) -> list[BucketUpdate]:
        last = len(plan.buckets) - 1
        return [BucketUpdate.of(names=bucket["names"], dtypes=bucket["dtypes"], shapes=bucket["shapes"],
                                group_name=self.group.name,
                                weight_version=str(self.version) if index == last else None,
                                load_format=plan.load_format, flush_cache=self.flush_cache)
                for index, bucket in enumerate(plan.buckets)]

    async def _build_group(self, plan: WeightPlan) -> None:
        """Destroy the old group on its members, then every engine joins the new one (with rank 0)."""
        group, admins = self.group, self.admins
        if group.members:
            await call_every_engine(self.pool, [admins[i] for i, _, _ in group.members if i in admins],
                                    "destroy_weight_group", group.previous_name())
        # An external engine new to the group may hold one of this name from an earlier run, and an engine job's
        # from the controller before a trainer restart (which named its groups from _1 too).
        joined = {index for index, _, _ in group.members}
        stale = [e for e in self.engines if e.engine_index not in joined and (self.clear_stale_groups or e.job_id)]
        await call_every_engine(self.pool, [admins[e.engine_index] for e in stale], "destroy_weight_group", group.name)
        each = [{"master_address": plan.master_address, "master_port": plan.master_port,
                 "rank_offset": self.offsets[e.engine_index], "world_size": self.world_size, "group_name": group.name,
                 "backend": self.backend} for e in self.engines]
        remote = calls_in_workers(self.pool, [admins[e.engine_index] for e in self.engines], "init_weight_group", each)
        inits = await started_in_workers(remote)
        if inits is None:  # (no pool, or its workers could not start: the loop makes them)
            remote = None
            inits = [asyncio.ensure_future(admins[e.engine_index].init_weight_group(**call))
                     for e, call in zip(self.engines, each)]
        try:
            await asyncio.wait(inits, return_when=asyncio.FIRST_EXCEPTION)
            if any(init.done() and init.exception() is not None for init in inits):
                await self._give_up_the_group(inits)  # raises WeightGroupBroken (or what the trainer failed with)
        finally:
            if remote is not None:
                remote.close()
        group.members = self.members

    async def _abort_trainer_side(self, error: EngineAdminError) -> None:
        """An engine broke the sync: once rank 0 reported its broadcasts done (NCCL's wait does not block),
        it aborts the group, which ends the broadcast every other engine is in."""
        try:
            await self._trainer_outcome()
        except TrainerFailed:
            raise error from None  # the trainer is gone, nothing to abort: the loop reports its failure
        log.warning("weight sync v%d broken (%s): aborting the weight-update group", self.version, error)
        await self._abort_group(str(error))

    async def _give_up_the_group(self, inits: list[asyncio.Future[None]]) -> None:
        """An engine failed its init call (it died, or answered an error): the new group will never be complete.
        Rank 0, which waits for every member, is told to stop (its sync command then ends without a broadcast;
        one that had joined after all has the group aborted); the other engines' init calls are dropped (they
        are up: on gloo their join waits for the lost member until the group's timeout, on NCCL it returned
        already); WeightGroupBroken names the engines whose call failed."""
        first = next(init.exception() for init in inits if init.done() and init.exception() is not None)
        if not isinstance(first, EngineAdminError):
            for init in inits:
                init.cancel()
            await asyncio.gather(*inits, return_exceptions=True)
            raise first
        log.warning("weight sync v%d: %s before the weight-update group was complete; rank 0 stops waiting for it",
                    self.version, first)
        self.channel.give_up_join(str(first))
        try:
            done = await self._trainer_outcome()  # a TrainerFailed is the loop's to report
            if "join_abandoned" not in done[0].metrics:  # rank 0 had joined and broadcast: the group is broken
                await self._abort_group(str(first))
        finally:
            for init in inits:
                init.cancel()
            outcomes = await asyncio.gather(*inits, return_exceptions=True)
        raise WeightGroupBroken(str(first), [position for position, outcome in enumerate(outcomes)
                                             if isinstance(outcome, EngineAdminError)])

    async def _settle(self, plan_future: asyncio.Future[WeightPlan], what: str) -> None:
        """However the push ended: the plan future is settled and read, and so is the trainer side's task."""
        if not plan_future.done():
            plan_future.cancel()  # no plan is coming that anyone would read
        elif not plan_future.cancelled():
            plan_future.exception()  # read it: a trainer failure there reaches the loop via the channel
        if not self.trainer_outcome_read and self.trainer_task is not None:
            error = await stop_task(self.trainer_task, what, log_error=False)
            if error is not None and error is not self.channel.failure:  # the loop reports a trainer failure
                log.warning("%s failed too: %s: %s", what, type(error).__name__, error)


async def push_weights_to_engines(*, version: int, channel: TrainerChannel, engines: list[EngineInfo],
                                  admins: dict[int, EngineAdmin], group: WeightGroup, backend: str,
                                  bucket_bytes: int, timeout_s: float = 600.0,
                                  on_stuck: StuckEngine | None = None, clear_stale_groups: bool = False,
                                  flush_cache: bool = True, pool: AnswerPool | None = None) -> dict[str, float]:
    """One `GroupPush`. `clear_stale_groups` (external engines, which outlive runs): a group of the new group's
    name is destroyed on each engine first. `flush_cache` False: the engines keep their KV cache (in place).
    `pool`: the answer workers make the update's exchanges."""
    return await GroupPush(version=version, channel=channel, engines=engines, admins=admins, group=group,
                           backend=backend, bucket_bytes=bucket_bytes, timeout_s=timeout_s, on_stuck=on_stuck,
                           clear_stale_groups=clear_stale_groups, flush_cache=flush_cache, pool=pool).run()


class BroadcastTransport(WeightTransport):
    """The decoupled default: the group, its pushes, and what an engine that breaks or leaves it costs."""

    name = "broadcast"
    keeps_cache = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = WeightGroup()
        self.abort_due = ""
        """Why the trainer must abort its weight-update group before its next command (a member engine failed
        after the last sync: on NCCL a broadcast to it may never complete); "" when not."""

    def engine_failed(self, engine_index: int) -> None:
        """A member of the live group failed: the group is dropped (the next sync builds a new one) and the
        trainer aborts its side before it runs anything else."""
        if self.group.holds(engine_index):
            self.group.members = []
            self.abort_due = f"engine {engine_index} failed while in the weight-update group"

    async def before_trainer_work(self) -> None:
        """Have the trainer abort a weight-update group a failed engine was in (see `engine_failed`), or one a
        cut sync left with broadcasts pending (a stop: the save that follows would wait behind them)."""
        if self.abort_due:
            reason, self.abort_due = self.abort_due, ""
            log.warning("aborting the trainer's weight-update group: %s", reason)
            await self.channel.run(lambda rank, seq: AbortWeightGroupCommand(seq=seq, reason=reason),
                                   timeout_s=self.settings.timeout_s)

    async def push(self, version: int, engines: list[EngineInfo], *, flush_cache: bool = True) -> dict[str, float]:
        """An engine that breaks the push (dies or fails mid-update) is failed (restarted, and given the weights
        before it serves again), the trainer has aborted the broken group, and the push is made once more, over
        a new group of the engines still up; a second break fails the run."""
        await self.before_trainer_work()
        try:
            try:
                return await self._push_once(version, engines, flush_cache)
            except WeightGroupBroken as broken:  # the trainer aborted its side already
                return await self._push_again(version, engines, broken, flush_cache)
        except asyncio.CancelledError:  # cut (a stop): rank 0 may have broadcasts pending that will never complete
            self.group.members = []
            self.abort_due = f"weight sync v{version} was cut short"
            raise

    async def _push_once(self, version: int, engines: list[EngineInfo], flush_cache: bool) -> dict[str, float]:
        settings = self.settings
        return await push_weights_to_engines(version=version, channel=self.channel, engines=engines,
                                             admins=self.fleet.admins, group=self.group, backend=settings.backend,
                                             bucket_bytes=settings.bucket_bytes, timeout_s=settings.timeout_s,
                                             on_stuck=self._engine_stuck, clear_stale_groups=settings.external_engines,
                                             flush_cache=flush_cache, pool=getattr(self.fleet, "answer_pool", None))

    async def _push_again(self, version: int, engines: list[EngineInfo], broken: WeightGroupBroken,
                          flush_cache: bool) -> dict[str, float]:
        start = time.perf_counter()
        members = {e.engine_index: e.incarnation for e in engines}  # a broken one may be restarted already
        for index in broken.engines:
            await self.fleet.fail_engine(index, f"broke weight sync v{version}: {broken}",
                                         incarnation=members.get(index))
        self.abort_due = ""
        survivors = self.registry.live_engines()
        log.warning("weight sync v%d: engine(s) %s failed mid-update; pushing again to %d engine(s)", version,
                    broken.engines, len(survivors))
        metrics = await self._push_once(version, survivors, flush_cache) if survivors else {}
        metrics["weight_sync/recovery_seconds"] = time.perf_counter() - start
        return metrics

    async def _engine_stuck(self, admin: EngineAdmin, why: str) -> None:
        """An engine found stuck during the weight update (the fan-out's watchdog): failed as dead (restarted)."""
        index = next((i for i, known in self.fleet.admins.items() if known is admin), None)
        if index is not None:
            await self.fleet.fail_engine(index, why)
