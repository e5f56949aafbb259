"""The loop's side of the engines' weights: which version the trainer holds, when a sync is due, and
each sync's sequence in every mode.

    decoupled (sync or async):  [pause (retract)] -> transport.push (transports.broadcast: the group;
                                transports.disk: the shared filesystem) -> engines serve the version
                                -> [continue]; the pause/continue pair only while a rollout generates (an
                                engine restarted mid-rollout in sync mode): the loop's syncs come between
                                rollouts (async: after the one ahead)
    async, in place             flush_cache_interval N != 1 (PipelineRL; slime's --flush-cache-interval):
                                the sync does not wait for the rollout ahead. pause(in_place): requests stay
                                in the running batch with their KV cache -> push(flush_cache=False) ->
                                continue: the same requests go on with the new weights, each token recording
                                its version. Every N-th sync (none with 0) flushes, in the order SGLang
                                requires (its /flush_cache fails while requests sit in place): pause(retract),
                                so the running batch is empty -> push(flush_cache=True) -> continue.
    colocated, async:           the same as decoupled, pushed through transports.colocated
    colocated, sync mode:       before_train: the engines hand the GPUs to the trainer; after_train:
                                the memory moves back with the new weights (order in colocated_memory.py)

Owns the trainer's weight version (what a checkpoint stores and what the next sync publishes), the
sync interval and which syncs flush, calling an admin method on every live engine (a failure fails that
engine only), and what a starting (restarted) engine needs before it serves. Not here: how the weights
travel (`controller.transports`: one module per transport, each with its trainer half in
`training.transports`), the colocated memory moves (`colocated_memory`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hpc_rl.controller.colocated_memory import KV_TAGS, TRAINER_TAGS, WEIGHTS_TAG, ColocatedMemory
from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import EngineState, Registry
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.transports import WeightSyncSettings, WeightTransport, make_transport
from hpc_rl.controller.transports.fanout_workers import call_every_engine

log = logging.getLogger(__name__)

__all__ = ["WeightSyncSettings", "WeightUpdates"]


class WeightUpdates:
    """The trainer's weight version and its way to every live engine."""

    def __init__(self, settings: WeightSyncSettings, *, registry: Registry, fleet: EngineFleet,
                 channel: TrainerChannel, engines_serve: Callable[[int], None], num_rollout: int) -> None:
        self.settings, self.registry, self.fleet, self.channel = settings, registry, fleet, channel
        self.engines_serve = engines_serve
        """Told the version the engines serve after each sync (the rollout scheduler's `set_weight_version`)."""
        self.num_rollout = num_rollout
        self.version = 0
        """The trainer's weight version: what a checkpoint stores; the engines serve it after the next sync."""
        self.colocated = ColocatedMemory(channel, self.engines_call, timeout_s=settings.timeout_s) \
            if settings.colocate else None
        """Colocated mode: the trainer's offload state and the memory moves (None: decoupled)."""
        self.transport: WeightTransport = make_transport(settings, channel=channel, fleet=fleet, registry=registry,
                                                         memory=self.colocated)
        """How the weights travel (`controller.transports`)."""
        self.pushes = 0
        """Pushes made (to at least one engine): which ones flush (`flush_cache_interval`) counts on it."""
        self.flushes = 0
        """Of those, the ones that flushed the engines' cache."""
        self.cache_kept = False
        """The last push kept the engines' cache (in place): SGLang's prefix (radix) cache may still hold KV computed
        by older weights, which requests started after the push reuse until a flush (measured on real SGLang:
        docs/sglang-cpu-checks.md), so their log-probs are not the served version's alone (`LogprobGuard`)."""
        self.moves_memory = settings.colocate and not settings.async_rollout
        """Colocated sync mode: engines and trainer trade the GPUs around every train step."""
        self.engines_released = False
        """Colocated: the engines released all their memory for the trainer's start (`hand_gpus_to_trainer`)."""

    def engine_failed(self, engine_index: int) -> None:
        """The fleet failed an engine: the transport forgets it (broadcast: a group it was in is dropped, and
        the trainer aborts its side before it runs anything else)."""
        self.transport.engine_failed(engine_index)

    @property
    def in_place(self) -> bool:
        """Syncs update the engines while the rollout ahead generates (`flush_cache_interval` other than 1)."""
        return self.settings.in_place_updates

    def flush_due(self) -> bool:
        """Whether the next push flushes the engines' cache: every `flush_cache_interval`-th (1: every one, the
        default; 0: never); always with a transport whose engine call flushes anyway (disk, colocated)."""
        interval = self.settings.flush_cache_interval
        if interval == 1 or not self.transport.keeps_cache:
            return True
        return bool(interval) and (self.pushes + 1) % interval == 0

    def restore(self, version: int) -> None:
        """A resumed run: the checkpoint's trainer holds `version` (the engines get it in `start`)."""
        self.version = version
        self.engines_serve(version)

    def sync_due(self, rollout_id: int) -> bool:
        """Every `update_weights_interval` rollouts, and after the last one; never in a trainer-only job (SFT)."""
        if self.settings.num_engines == 0:
            return False
        interval = self.settings.update_weights_interval
        return bool(interval) and (rollout_id + 1) % interval == 0 or rollout_id + 1 == self.num_rollout

    async def hand_gpus_to_trainer(self) -> None:
        """Colocated, before the trainer starts (slime's order): the engines sized their KV cache from the free
        GPU memory; now they release all of it (weights, KV cache, CUDA graphs) so the trainer builds its model
        and optimizer on GPUs the engines do not hold. `start` gives it back with the trainer's weights."""
        if self.moves_memory:
            await self.engines_call("release_memory", [*KV_TAGS, WEIGHTS_TAG])
            self.engines_released = True

    async def start(self, *, resumed: bool) -> None:
        """Before the first rollout: colocated sync mode gives the GPUs to the engines (generation comes
        first) and, when they released everything for the trainer's start, their weights are the trainer's
        (slime pushes them once at start too); a resumed run pushes the checkpoint's weights (the engines
        loaded the initial ones), and so does a run whose trainer starts from a LoRA adapter (sync_at_start)."""
        if self.moves_memory and self.engines_released:  # as after a train step: the memory moves back with weights
            self.engines_released = False
            metrics = await self._colocated_after_train(self.version, sync_due=True)
            log.info("weights v%d given to the colocated engines before the first rollout (%.2f s)", self.version,
                     metrics.get("time/colocated_after_train", 0.0))
            return
        if self.moves_memory:
            assert self.colocated is not None
            await self.colocated.trainer("offload", TRAINER_TAGS)
        if resumed and self.settings.num_engines:
            await self.sync(self.version, reason="resumed from a checkpoint", generating=False)
        elif self.settings.sync_at_start and self.settings.num_engines:
            await self.sync(self.version, reason="the adapter the trainer starts from (lora_adapter_path)",
                            generating=False)

    async def before_train(self, sync_due: bool) -> dict[str, Any]:
        """Colocated sync mode: the engines release their memory and the trainer onloads; decoupled: the trainer
        aborts a weight-update group an engine broke since the last sync (see `engine_failed`)."""
        if not self.moves_memory:
            await self.transport.before_trainer_work()
            return {}
        assert self.colocated is not None
        return await self.colocated.before_train(sync_due)

    async def after_train(self, version: int, *, sync_due: bool, generating: bool = True) -> dict[str, Any]:
        """The trainer now holds `version`: push it to the engines if a sync is due (`generating`: whether a
        rollout is generating meanwhile, see `sync`)."""
        if self.moves_memory:
            return await self._colocated_after_train(version, sync_due=sync_due)
        if sync_due:
            return await self.sync(version, generating=generating)
        self.version = version  # trainer moved on; engines keep the older version
        return {}

    async def sync(self, version: int, *, reason: str = "", generating: bool = True) -> dict[str, float]:
        """Push the trainer's weights as `version` to every live engine; waiting engines start serving.

        While a rollout generates, the engines pause around the push (retract: their requests wait and go on
        with the new weights, each token recording its version; in place, when this push keeps the cache: they
        stay in the running batch with their KV cache, see the module docstring). With no request in flight (the
        loop's syncs between rollouts, in both modes) there is nothing to pause: SGLang's weight-update calls
        take its model update lock, which waits only for requests in flight, so the pause/continue pair is left
        out."""
        start = time.perf_counter()
        waiting = self._waiting_engines()
        flush = self.flush_due()
        if generating:
            await self.engines_call("pause", "retract" if flush else "in_place")
        metrics = await self._push(version, flush_cache=flush)
        await self._now_serving(version, waiting)
        if generating:
            await self.engines_call("resume_generation")
        if reason:
            log.info("weights v%d pushed (%s)", version, reason)
        metrics["time/weight_sync"] = time.perf_counter() - start
        return metrics

    async def serve_waiting(self, reason: str) -> dict[str, float]:
        """Engines waiting for weights (joined from an engine job or restarted since the last sync) get the trainer's
        current version and serve; the engines serving go on generating: the push goes to the waiting ones only,
        over a weight-update group of their own (the serving engines only destroy their group), and the next sync
        builds one group of every engine again. The trainer must be idle (sync mode's rollouts, evals). Colocated
        sync mode pushes to every engine (`sync`): their memory moves together."""
        if self.moves_memory:
            return await self.sync(self.version, reason=reason)
        start = time.perf_counter()
        waiting = [e for e in self.registry.live_engines() if e.state == EngineState.STARTING]
        if not waiting:
            return {}
        metrics = await self.transport.push(self.version, waiting, flush_cache=True)
        await self.fleet.serve_before_router([e.engine_index for e in waiting if e.state == EngineState.STARTING])
        metrics["time/weight_sync_waiting_engines"] = time.perf_counter() - start
        log.info("weights v%d pushed to %d waiting engine(s) in %.2f s (%s); the others kept generating",
                 self.version, len(waiting), metrics["time/weight_sync_waiting_engines"], reason)
        return metrics

    async def engines_call(self, method: str, *args: Any, engines: list[int] | None = None) -> None:
        """`EngineAdmin.method(*args)` on every live engine at once; an engine whose call fails is failed."""
        indices = engines if engines is not None else [e.engine_index for e in self.registry.live_engines()]
        pool = getattr(self.fleet, "answer_pool", None)  # its workers make the calls (the loop reads a few frames)
        results = await call_every_engine(pool, [self.fleet.admins[i] for i in indices], method, *args)
        for index, result in zip(indices, results):
            if isinstance(result, BaseException):
                await self.fleet.fail_engine(index, f"{method} failed: {result}")

    def _waiting_engines(self) -> list[int]:
        return [e.engine_index for e in self.registry.live_engines() if e.state == EngineState.STARTING]

    async def _push(self, version: int, *, flush_cache: bool = True) -> dict[str, float]:
        """The trainer's weights to every live (paused) engine, through the run's transport."""
        engines = self.registry.live_engines()
        if not engines:  # all restarting: each gets the trainer's current version before it serves
            log.warning("weights v%d not pushed: no engine is up", version)
            return {}
        metrics = await self.transport.push(version, engines, flush_cache=flush_cache)
        self.pushes += 1
        self.flushes += flush_cache
        self.cache_kept = not flush_cache
        if self.settings.flush_cache_interval != 1:
            metrics["weight_sync/flushed_cache"] = float(flush_cache)
        return metrics

    async def _now_serving(self, version: int, waiting: list[int]) -> None:
        self.version = version
        self.engines_serve(version)
        await self.fleet.mark_serving(waiting)

    async def _colocated_after_train(self, version: int, *, sync_due: bool) -> dict[str, Any]:
        """Colocated, sync mode (see hpc_rl.controller.colocated_memory): free grads and optimizer state, reload the
        engines' released weights with the new version, free the trainer's weights, give the engines their
        KV cache back and let them generate. (The loop saved a due checkpoint just before.)"""
        assert self.colocated is not None
        start = time.perf_counter()
        metrics = await self.colocated.trainer("offload", ["grads", "optimizer"])
        if sync_due:
            waiting = self._waiting_engines()
            await self.engines_call("resume_memory", [WEIGHTS_TAG])
            metrics.update(await self._push(version))
            await self._now_serving(version, waiting)
        else:
            self.version = version  # trainer moved on; engines keep the older version
        await self.colocated.trainer("offload", [WEIGHTS_TAG])
        await self.engines_call("resume_memory", KV_TAGS)
        await self.engines_call("resume_generation")
        metrics["time/colocated_after_train"] = time.perf_counter() - start
        return metrics
