"""The loop's side of the engines' weights: which version the trainer holds, when a sync is due, and
each sync's sequence in every mode.

    decoupled (sync or async):  [pause (retract)] -> push (weight_sync.push_weights_to_engines:
                                the broadcast group; or weight_disk, through the shared filesystem)
                                -> engines serve the version -> [continue]; the pause/continue pair only
                                while a rollout generates (an engine restarted mid-rollout in sync mode):
                                the loop's syncs come between rollouts (async: after the one ahead)
    colocated, async:           the same, pushed through /update_weights_from_tensor (colocated.py)
    colocated, sync mode:       before_train: the engines hand the GPUs to the trainer; after_train:
                                the memory moves back with the new weights (order in colocated.py)

Owns the trainer's weight version (what a checkpoint stores and what the next sync publishes), the
sync interval, calling an admin method on every live engine (a failure fails that engine only), and
what a starting (restarted) engine needs before it serves. Not here: the per-engine HTTP fan-out and
the group bookkeeping (`weight_sync`), the colocated memory moves (`colocated`), the trainer's side.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpc_rl.config.schema import ClusterConfig, ControllerConfig, RolloutConfig
from hpc_rl.controller.colocated import (KV_TAGS, TRAINER_TAGS, WEIGHTS_TAG, ColocatedMemory, colocated_pairs,
                                         push_weights_colocated)
from hpc_rl.controller.engine_admin import EngineAdmin
from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry
from hpc_rl.controller.trainer_channel import TrainerChannel
from hpc_rl.controller.weight_disk import push_weights_through_disk
from hpc_rl.controller.weight_sync import WeightGroupBroken, WeightGroupState, push_weights_to_engines
from hpc_rl.protocol.messages import AbortWeightGroupCommand

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class WeightSyncSettings:
    """The fields of the cluster, rollout and controller sections that decide how weights reach the engines."""

    backend: str
    """Collective backend of the weight-update group: gloo on CPU, nccl on GPUs."""
    colocate: bool
    async_rollout: bool
    update_weights_interval: int
    bucket_bytes: int
    timeout_s: float
    num_engines: int
    transport: str = "nccl"
    """nccl (the broadcast group) or disk (rollout.update_weight_transport: weight_disk)."""
    disk_dir: str | None = None
    keep_disk_files: bool = False
    external_engines: bool = False
    """The engines are another job's (rollout.rollout_external_engine_addrs): they may hold an earlier run's group."""

    @classmethod
    def from_sections(cls, cluster: ClusterConfig, rollout: RolloutConfig,
                      controller: ControllerConfig) -> WeightSyncSettings:
        return cls(backend="gloo" if cluster.device == "cpu" else "nccl", colocate=cluster.colocate,
                   async_rollout=rollout.async_rollout, update_weights_interval=rollout.update_weights_interval,
                   bucket_bytes=rollout.update_weight_buffer_size, timeout_s=controller.engine_request_timeout,
                   num_engines=cluster.num_engines,
                   transport=rollout.update_weight_transport, disk_dir=rollout.update_weight_disk_dir,
                   keep_disk_files=rollout.update_weight_disk_keep_files,
                   external_engines=bool(rollout.rollout_external_engine_addrs))


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
        self.group = WeightGroupState()
        self.colocated = ColocatedMemory(channel, self.engines_call, timeout_s=settings.timeout_s) \
            if settings.colocate else None
        """Colocated mode: the trainer's offload state and the memory moves (None: decoupled)."""
        self.moves_memory = settings.colocate and not settings.async_rollout
        """Colocated sync mode: engines and trainer trade the GPUs around every train step."""
        self.engines_released = False
        """Colocated: the engines released all their memory for the trainer's start (`hand_gpus_to_trainer`)."""
        self.abort_due = ""
        """Why the trainer must abort its weight-update group before its next command (a member engine failed
        after the last sync: on NCCL a broadcast to it may never complete); "" when not."""

    def engine_failed(self, engine_index: int) -> None:
        """The fleet failed an engine: if it was in the live weight-update group, the group is dropped (the
        next sync builds a new one) and the trainer aborts its side before it runs anything else."""
        if any(index == engine_index for index, _, _ in self.group.members):
            self.group.members = []
            self.abort_due = f"engine {engine_index} failed while in the weight-update group"

    async def abort_group_if_due(self) -> None:
        """Have the trainer abort a weight-update group a failed engine was in (see `engine_failed`), or one a
        cut sync left with broadcasts pending (a stop: the save that follows would wait behind them)."""
        if self.abort_due:
            reason, self.abort_due = self.abort_due, ""
            log.warning("aborting the trainer's weight-update group: %s", reason)
            await self.channel.run(lambda rank, seq: AbortWeightGroupCommand(seq=seq, reason=reason),
                                   timeout_s=self.settings.timeout_s)

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
        loaded the initial ones)."""
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

    async def before_train(self, sync_due: bool) -> dict[str, Any]:
        """Colocated sync mode: the engines release their memory and the trainer onloads; decoupled: the trainer
        aborts a weight-update group an engine broke since the last sync (see `engine_failed`)."""
        if not self.moves_memory:
            await self.abort_group_if_due()
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
        with the new weights, each token recording its version). With no request in flight (the loop's syncs
        between rollouts, in both modes) there is nothing to pause: SGLang's weight-update calls take its model
        update lock, which waits only for requests in flight, so the pause/continue pair is left out."""
        start = time.perf_counter()
        waiting = self._waiting_engines()
        if generating:
            await self.engines_call("pause", "retract")
        metrics = await self._push(version)
        await self._now_serving(version, waiting)
        if generating:
            await self.engines_call("resume_generation")
        if reason:
            log.info("weights v%d pushed (%s)", version, reason)
        metrics["time/weight_sync"] = time.perf_counter() - start
        return metrics

    async def engines_call(self, method: str, *args: Any, engines: list[int] | None = None) -> None:
        """`EngineAdmin.method(*args)` on every live engine at once; an engine whose call fails is failed."""
        indices = engines if engines is not None else [e.engine_index for e in self.registry.live_engines()]
        results = await asyncio.gather(*(getattr(self.fleet.admins[i], method)(*args) for i in indices),
                                       return_exceptions=True)
        for index, result in zip(indices, results):
            if isinstance(result, BaseException):
                await self.fleet.fail_engine(index, f"{method} failed: {result}")

    async def _engine_stuck(self, admin: EngineAdmin, why: str) -> None:
        """An engine found stuck during the weight update (weight_sync's watchdog): failed as dead (restarted)."""
        index = next((i for i, known in self.fleet.admins.items() if known is admin), None)
        if index is not None:
            await self.fleet.fail_engine(index, why)

    def _waiting_engines(self) -> list[int]:
        return [e.engine_index for e in self.registry.live_engines() if e.state == EngineState.STARTING]

    async def _push(self, version: int) -> dict[str, float]:
        """The trainer's weights to every live (paused) engine: a broadcast group (decoupled) or, colocated,
        each trainer rank to the engine on its GPUs (the trainer's weights onloaded for it if need be)."""
        engines = self.registry.live_engines()
        settings = self.settings
        if not engines:  # all restarting: each gets the trainer's current version before it serves
            log.warning("weights v%d not pushed: no engine is up", version)
            return {}
        if self.colocated is None and settings.transport == "disk":
            assert settings.disk_dir is not None, "validation requires update_weight_disk_dir with disk"
            return await push_weights_through_disk(version=version, channel=self.channel, engines=engines,
                                                   admins=self.fleet.admins, disk_dir=settings.disk_dir,
                                                   keep_files=settings.keep_disk_files, timeout_s=settings.timeout_s)
        if self.colocated is None:
            return await self._broadcast(version, engines)
        was_offloaded = WEIGHTS_TAG in self.colocated.trainer_offloaded
        await self.colocated.trainer("onload", [WEIGHTS_TAG])
        metrics = await push_weights_colocated(
            version=version, channel=self.channel, engines=engines, admins=self.fleet.admins,
            num_engines=settings.num_engines, rank_engines=colocated_pairs(self.registry),
            bucket_bytes=settings.bucket_bytes, timeout_s=settings.timeout_s)
        if was_offloaded:
            await self.colocated.trainer("offload", [WEIGHTS_TAG])
        return metrics

    async def _broadcast(self, version: int, engines: list[EngineInfo]) -> dict[str, float]:
        """The decoupled push. An engine that breaks it (dies or fails mid-update) is failed (restarted, and
        given the weights before it serves again), the trainer has aborted the broken group, and the push is
        made once more, over a new group of the engines still up; a second break fails the run."""
        settings = self.settings

        async def push(over: list[EngineInfo]) -> dict[str, float]:
            return await push_weights_to_engines(version=version, channel=self.channel, engines=over,
                                                 admins=self.fleet.admins, group=self.group, backend=settings.backend,
                                                 bucket_bytes=settings.bucket_bytes, timeout_s=settings.timeout_s,
                                                 on_stuck=self._engine_stuck,
                                                 clear_stale_groups=settings.external_engines)

        await self.abort_group_if_due()
        try:
            try:
                return await push(engines)
            except WeightGroupBroken as broken:  # the trainer aborted its side already
                start = time.perf_counter()
                members = {e.engine_index: e.incarnation for e in engines}  # a broken one may be restarted already
                for index in broken.engines:
                    await self.fleet.fail_engine(index, f"broke weight sync v{version}: {broken}",
                                                 incarnation=members.get(index))
                self.abort_due = ""
                survivors = self.registry.live_engines()
                log.warning("weight sync v%d: engine(s) %s failed mid-update; pushing again to %d engine(s)", version,
                            broken.engines, len(survivors))
                metrics = await push(survivors) if survivors else {}
                metrics["weight_sync/recovery_seconds"] = time.perf_counter() - start
                return metrics
        except asyncio.CancelledError:  # cut (a stop): rank 0 may have broadcasts pending that will never complete
            self.group.members = []
            self.abort_due = f"weight sync v{version} was cut short"
            raise

    async def _now_serving(self, version: int, waiting: list[int]) -> None:
        self.version = version
        self.engines_serve(version)
        await self.fleet.mark_serving(waiting)

    async def _colocated_after_train(self, version: int, *, sync_due: bool) -> dict[str, Any]:
        """Colocated, sync mode (see hpc_rl.controller.colocated): free grads and optimizer state, reload the
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
