"""Weight-sync orchestration: trainer rank 0 broadcasts, the controller drives every engine.

Owns the SGLang protocol sequence on the engine side and its interleaving with the trainer:

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
to the engines still up, over a new group.
Pausing and resuming generation around the sync is the caller's (the loop knows the mode). However a
sync ends (done, engine or trainer error, cancellation), the trainer-side task has ended and its
outcome was read, and the weight-plan future is settled, so nothing is left for asyncio to complain about.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from hpc_rl.controller.engine_admin import STUCK_NOTICE_S, BucketUpdate, EngineAdmin, EngineAdminError
from hpc_rl.controller.registry import EngineInfo
from hpc_rl.controller.stopping import stop_task
from hpc_rl.controller.trainer_channel import TrainerChannel, TrainerFailed
from hpc_rl.protocol.http_client import EngineHTTPTransportError, ReadGate
from hpc_rl.protocol.messages import AbortWeightGroupCommand, SyncWeightsCommand
from hpc_rl.weights import DEFAULT_GROUP_NAME

log = logging.getLogger(__name__)

GATE_PERIOD_S = 5.0
"""During a weight update, the engines other than the first have their answers read at least this often
(and when the first engine is done): an engine's failure is named at most this late. (A failed engine
stalls every engine's broadcast anyway; at 1.0 s the 10 s syncs of 1,024 simulated engines read each
engine ~10 times: 0.58-1.01 controller CPU s per sync against 0.42-0.64 at 5 s, bench_admin_fanout.)"""


@dataclass
class WeightGroupState:
    """Which engines the live weight-update group was built with."""

    members: list[tuple[int, str, int]] = field(default_factory=list)
    """(engine index, URL, incarnation) of each member: a restarted engine (same index and URL, new
    process) is a new member, so the group is rebuilt even when no sync happened while it was down."""
    group_name: str = DEFAULT_GROUP_NAME
    generation: int = 0


def rank_offsets(engines: list[EngineInfo]) -> tuple[dict[int, int], int]:
    """Engine i joins at 1 + sum of earlier engines' TP sizes; world = 1 + all engines' GPUs."""
    offsets: dict[int, int] = {}
    next_rank = 1
    for engine in engines:
        offsets[engine.engine_index] = next_rank
        next_rank += engine.tp_size
    return offsets, next_rank


ABORT_GRACE_S = 30.0
"""After an engine broke a sync and the trainer aborted its side of the group: how long the other engines get
to answer their update (gloo peers fail at once when rank 0's side goes; SGLang on NCCL may stay in the
broadcast until its own watchdog) before they count as broken too (failed, so restarted)."""


class WeightGroupBroken(RuntimeError):
    """Engines broke a weight sync (one died or failed mid-update): the trainer's side of the group was
    aborted. `positions`: the engines (positions in the list updated; `engines`: their indices, once known)
    whose update failed or did not end within the grace period after the abort; the first error is the cause."""

    def __init__(self, message: str, positions: list[int]) -> None:
        super().__init__(message)
        self.positions = positions
        self.engines: list[int] = []


StuckEngine = Callable[[EngineAdmin, str], Awaitable[None]]
"""Called with an engine found stuck during a weight update and why (the fleet fails it: restart path)."""
STUCK_PROBE_CONCURRENCY = 64


async def watch_fan_out(admins: list[EngineAdmin], updates: list[asyncio.Future[None]], on_stuck: StuckEngine | None,
                        *, notice_s: float = STUCK_NOTICE_S, probe_timeout_s: float = STUCK_NOTICE_S) -> None:
    """While the update runs: when no engine has answered for `notice_s` (a broadcast waits for every
    engine, so one stuck engine silences all), say so, probe /health of each engine still updating, and
    name (and hand to `on_stuck`) every one that does not answer: the stuck one, not its waiting peers."""
    limit = asyncio.Semaphore(STUCK_PROBE_CONCURRENCY)
    reported: set[str] = set()

    async def probe(admin: EngineAdmin) -> bool:
        async with limit:
            return await admin.healthy(probe_timeout_s)

    while True:
        await asyncio.sleep(notice_s)
        waiting = [a for a, update in zip(admins, updates) if not update.done()]
        if not waiting or min(a.silent_for() for a in waiting) < notice_s:
            continue
        silent = min(a.silent_for() for a in waiting)
        healthy = await asyncio.gather(*(probe(a) for a in waiting))
        stuck = [a for a, ok in zip(waiting, healthy) if not ok and a.url not in reported]
        if not stuck:
            log.warning("weight update: no engine has answered for %.0f s; all %d still updating answer /health "
                        "(waiting on the trainer's broadcast)", silent, len(waiting))
        for admin in stuck:
            reported.add(admin.url)
            why = (f"stuck in a weight update: no answer for {silent:.0f} s and /health does not answer within "
                   f"{probe_timeout_s:g} s")
            log.warning("engine %s: %s", admin.url, why)
            if on_stuck is not None:
                await on_stuck(admin, why)


async def update_every_engine(admins: list[EngineAdmin], buckets: list[BucketUpdate], *,
                              on_stuck: StuckEngine | None = None, notice_s: float = STUCK_NOTICE_S,
                              on_break: Callable[[EngineAdminError], Awaitable[None]] | None = None,
                              settle_s: float = 0.0) -> None:
    """Every engine's pipelined update (begin, the buckets, end) at once: a bucket's broadcast completes only
    when every engine has joined it, so the engines cannot be taken a few at a time. The answers come in
    waves, each bucket's on every engine together: the first engine's are read as they come, every other
    engine's wait in its socket (a shut ReadGate) until the first engine is done, or GATE_PERIOD_S has
    passed, and are then read in one go. That is ~2 reads per engine instead of one per call (18 for
    Qwen3-4B), the event loop's read being most of the controller's CPU in a sync at 1,024 engines.
    Raises the first EngineAdminError, naming the engine and the call, as soon as it is read. Meanwhile
    `watch_fan_out` names (and hands to `on_stuck`) an engine that stalls the update. With `on_break`, an
    error first awaits it (it aborts the trainer's side of the group, so the broadcast the other engines are
    in ends), then every other engine gets `settle_s` to answer and WeightGroupBroken is raised."""
    gate = ReadGate()
    if len(admins) > 1:
        gate.shut()
    updates = [asyncio.ensure_future(admin.weight_update(buckets, gate=gate) if index
                                     else admin.weight_update(buckets)) for index, admin in enumerate(admins)]
    first, every = updates[0], asyncio.gather(*updates)
    watchdog = asyncio.create_task(
        watch_fan_out(admins, updates, on_stuck, notice_s=notice_s, probe_timeout_s=notice_s),
        name="weight update watchdog")
    try:
        while not every.done():
            await asyncio.wait((every, first), timeout=GATE_PERIOD_S, return_when=asyncio.FIRST_COMPLETED)
            gate.open()  # read what came; shut again until the first engine is done
            if first.done():
                break
            gate.shut()
        await every
    except EngineAdminError as error:
        gate.open()
        if on_break is None:
            raise
        await on_break(error)
        breaker = [position for position, admin in enumerate(admins) if getattr(admin, "url", None) == error.url]
        broken = sorted(set(breaker) | set(await _settled_failures(updates, settle_s)))
        raise WeightGroupBroken(str(error), broken) from error
    except asyncio.CancelledError:
        every.cancel()
        every.add_done_callback(lambda gathered: gathered.cancelled() or gathered.exception())  # read: no warning
        raise
    finally:
        gate.open()
        await stop_task(watchdog, "the weight update watchdog")


async def _settled_failures(tasks: list[asyncio.Future[None]], settle_s: float) -> list[int]:
    """Positions of the engines whose update did not end within `settle_s` (then cancelled: wedged in the
    broadcast) or ended without an answer (the process is gone). An engine that answered, even with the
    error the abort caused, is up: the next push gives it every bucket again."""
    _, late = await asyncio.wait(tasks, timeout=settle_s)
    for task in late:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return [position for position, task in enumerate(tasks)
            if task.cancelled() or isinstance(getattr(task.exception(), "__cause__", None), EngineHTTPTransportError)]


async def push_weights_to_engines(*, version: int, channel: TrainerChannel, engines: list[EngineInfo],
                                  admins: dict[int, EngineAdmin], group: WeightGroupState, backend: str,
                                  bucket_bytes: int, timeout_s: float = 600.0,
                                  on_stuck: StuckEngine | None = None,
                                  clear_stale_groups: bool = False) -> dict[str, float]:
    """Push the trainer's current weights to `engines` as `version`; returns timing metrics. `clear_stale_groups`
    (external engines, which outlive runs): a group of the new group's name is destroyed on each engine first."""
    start = time.perf_counter()
    members = [(e.engine_index, e.url, e.incarnation) for e in engines]
    new_group = members != group.members
    offsets, world_size = rank_offsets(engines)
    if new_group:
        group.generation += 1
    group_name = f"{group.group_name}_{group.generation}"

    def command(rank: int, seq: int) -> SyncWeightsCommand:
        return SyncWeightsCommand(seq=seq, weight_version=version, new_group=new_group, world_size=world_size,
                                  group_name=group_name, backend=backend, bucket_bytes=bucket_bytes)

    plan_future = channel.expect_weight_plan()
    what = f"the trainer side of weight sync v{version}"
    trainer_task = asyncio.create_task(channel.run(command, timeout_s=timeout_s), name=what)
    trainer_outcome_read = False

    async def abort_trainer_side(error: EngineAdminError) -> None:
        """An engine broke the sync: once rank 0 reported its broadcasts done (NCCL's wait does not block),
        it aborts the group, which ends the broadcast every other engine is in."""
        nonlocal trainer_outcome_read
        trainer_outcome_read = True
        try:
            await trainer_task
        except TrainerFailed:
            raise error from None  # the trainer is gone, nothing to abort: the loop reports its failure
        log.warning("weight sync v%d broken (%s): aborting the weight-update group", version, error)
        await channel.run(lambda rank, seq: AbortWeightGroupCommand(seq=seq, reason=str(error)), timeout_s=timeout_s)

    async def give_up_the_group(inits: list[asyncio.Future[None]]) -> None:
        """An engine failed its init call (it died, or answered an error): the new group will never be complete.
        Rank 0, which waits for every member, is told to stop (its sync command then ends without a broadcast;
        one that had joined after all has the group aborted); the other engines' init calls are dropped (they
        are up: on gloo their join waits for the lost member until the group's timeout, on NCCL it returned
        already); WeightGroupBroken names the engines whose call failed."""
        nonlocal trainer_outcome_read
        first = next(init.exception() for init in inits if init.done() and init.exception() is not None)
        if not isinstance(first, EngineAdminError):
            for init in inits:
                init.cancel()
            await asyncio.gather(*inits, return_exceptions=True)
            raise first
        log.warning("weight sync v%d: %s before the weight-update group was complete; rank 0 stops waiting for it",
                    version, first)
        channel.give_up_join(str(first))
        trainer_outcome_read = True
        try:
            done = await trainer_task  # a TrainerFailed is the loop's to report
            if "join_abandoned" not in done[0].metrics:  # rank 0 had joined and broadcast: the group is broken
                await channel.run(lambda rank, seq: AbortWeightGroupCommand(seq=seq, reason=str(first)),
                                  timeout_s=timeout_s)
        finally:
            for init in inits:
                init.cancel()
            outcomes = await asyncio.gather(*inits, return_exceptions=True)
        raise WeightGroupBroken(str(first), [position for position, outcome in enumerate(outcomes)
                                             if isinstance(outcome, EngineAdminError)])

    try:
        plan = await asyncio.wait_for(asyncio.shield(plan_future), timeout_s)
        if new_group:
            if group.members:
                old_name = f"{group.group_name}_{group.generation - 1}"
                await asyncio.gather(*(admins[i].destroy_weight_group(old_name) for i, _, _ in group.members
                                       if i in admins), return_exceptions=True)
            if clear_stale_groups:  # an external engine new to the group may hold one of this name from an earlier run
                joined = {index for index, _, _ in group.members}
                await asyncio.gather(*(admins[e.engine_index].destroy_weight_group(group_name)
                                       for e in engines if e.engine_index not in joined), return_exceptions=True)
            inits = [asyncio.ensure_future(admins[e.engine_index].init_weight_group(
                master_address=plan.master_address, master_port=plan.master_port, rank_offset=offsets[e.engine_index],
                world_size=world_size, group_name=group_name, backend=backend)) for e in engines]
            await asyncio.wait(inits, return_when=asyncio.FIRST_EXCEPTION)
            if any(init.done() and init.exception() is not None for init in inits):
                await give_up_the_group(inits)  # raises WeightGroupBroken (or what the trainer failed with)
            group.members = members
        buckets = [BucketUpdate.of(names=bucket["names"], dtypes=bucket["dtypes"], shapes=bucket["shapes"],
                                   group_name=group_name,
                                   weight_version=str(version) if index == len(plan.buckets) - 1 else None,
                                   load_format=plan.load_format)
                   for index, bucket in enumerate(plan.buckets)]
        await update_every_engine([admins[e.engine_index] for e in engines], buckets, on_stuck=on_stuck,
                                  on_break=abort_trainer_side, settle_s=ABORT_GRACE_S)
        trainer_outcome_read = True
        await trainer_task
    except WeightGroupBroken as broken:
        group.members = []  # rebuild next time
        broken.engines = [engines[position].engine_index for position in broken.positions]
        raise
    except (EngineAdminError, asyncio.TimeoutError):
        group.members = []  # rebuild next time
        raise
    finally:
        if not plan_future.done():
            plan_future.cancel()  # no plan is coming that anyone would read
        elif not plan_future.cancelled():
            plan_future.exception()  # read it: a trainer failure there reaches the loop via the channel
        if not trainer_outcome_read:
            error = await stop_task(trainer_task, what, log_error=False)
            if error is not None and error is not channel.failure:  # the loop reports a trainer failure
                log.warning("%s failed too: %s: %s", what, type(error).__name__, error)
    seconds = time.perf_counter() - start
    total_bytes = sum(int(b.get("num_bytes", 0)) for b in plan.buckets)
    log.info("weights v%d -> %d engine(s): %d bucket(s), %.1f MB in %.2f s%s", version, len(engines),
             len(plan.buckets), total_bytes / 1e6, seconds, " (new group)" if new_group else "")
    return {"weight_sync/seconds": seconds, "weight_sync/buckets": float(len(plan.buckets)),
            "weight_sync/mbytes": total_bytes / 1e6, "weight_sync/new_group": float(new_group)}
