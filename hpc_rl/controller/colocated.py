"""Colocated mode: engines share the trainer's GPUs; memory changes hands around each train step.

Owns the order of the memory moves and the colocated weight path (slime's, with SGLang 0.5.23's calls):

    generation     engines: weights + KV cache           trainer: offloaded (weights, grads, optimizer)
    before train   engines: pause(retract), release(kv_cache, cuda_graph [, weights if a sync follows])
                   trainer: onload everything
    train          [save, if due: needs the whole trainer state]
    after train    trainer: offload grads, optimizer
                   [sync due] engines: resume(weights) -> begin -> per bucket /update_weights_from_tensor
                              (every trainer rank -> the engine on its GPU, paired by device identity) -> end
                   trainer: offload weights
                   engines: resume(kv_cache, cuda_graph) -> continue

No weight-update group exists in colocated mode (NCCL refuses two ranks on one device). Released
weights are garbage after a resume (SGLang's memory saver discards them), so weights are released only
when a sync follows in the same step: with `update_weights_interval > 1` the steps without a sync keep
the engines' weights (the older version they keep serving) and release only the KV cache. (Refusing
such configs would also be correct; keeping the weights costs only their memory during training and
keeps slime's flag meaning the same in both modes.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hpc_rl.controller.engine_admin import EngineAdmin
from hpc_rl.controller.registry import EngineInfo, Registry
from hpc_rl.controller.trainer_channel import TrainerChannel, merge_metrics
from hpc_rl.protocol.messages import ColocatedSyncCommand, TrainerMemoryCommand
from hpc_rl.weights.device_identity import PlacementError, pair_ranks_with_engines

log = logging.getLogger(__name__)

KV_TAGS = ["kv_cache", "cuda_graph"]
WEIGHTS_TAG = "weights"
TRAINER_TAGS = ["weights", "grads", "optimizer"]


def engine_release_tags(sync_due: bool) -> list[str]:
    """Tags released before training: the weights only when this step reloads them."""
    return [*KV_TAGS, WEIGHTS_TAG] if sync_due else list(KV_TAGS)


EnginesCall = Callable[..., Awaitable[None]]
"""WeightUpdates.engines_call: call an EngineAdmin method on every live engine; failures fail that engine."""


class ColocatedMemory:
    """Where the trainer's state is (device or host), and the calls that move it."""

    def __init__(self, channel: TrainerChannel, engines_call: EnginesCall, *, timeout_s: float) -> None:
        self.channel, self.engines_call, self.timeout_s = channel, engines_call, timeout_s
        self.trainer_offloaded: set[str] = set()

    async def trainer(self, action: str, tags: list[str]) -> dict[str, Any]:
        tags = [t for t in tags if (t in self.trainer_offloaded) == (action == "onload")]
        if not tags:
            return {}
        done = await self.channel.run(lambda rank, seq: TrainerMemoryCommand(seq=seq, action=action, tags=tags),
                                      timeout_s=self.timeout_s)
        if action == "offload":
            self.trainer_offloaded |= set(tags)
        else:
            self.trainer_offloaded -= set(tags)
        return {f"time/trainer_{action}_{'_'.join(tags)}": float(merge_metrics(done).get(f"{action}/seconds", 0.0))}

    async def before_train(self, sync_due: bool) -> dict[str, Any]:
        start = time.perf_counter()
        await self.engines_call("pause", "retract")
        await self.engines_call("release_memory", engine_release_tags(sync_due))
        metrics = await self.trainer("onload", TRAINER_TAGS)
        metrics["time/colocated_before_train"] = time.perf_counter() - start
        return metrics


def colocated_pairs(registry: Registry) -> list[list[int]]:
    """Per trainer rank, [engine index, engine TP rank] of the engine on its GPU: paired by what each
    process is (its node and the GPU Slurm gave it), never by rank numbers (torchrun sorts nodes by name,
    Slurm does not). Every registered engine counts, a failed one too (its ranks still gather for the
    others). PlacementError names the ranks that share no GPU with any engine."""
    ranks = {rank: str(trainer.info.get("device") or "") for rank, trainer in registry.trainers.items()}
    unknown = sorted(rank for rank, device in ranks.items() if not device)
    if unknown:
        raise PlacementError(f"trainer ranks {unknown} did not report their GPU (their Hello has no 'device')")
    pairs = pair_ranks_with_engines(ranks, {i: e.devices for i, e in registry.engines.items()})
    return [list(pairs[rank]) for rank in range(registry.trainer_world_size)]


async def push_weights_colocated(*, version: int, channel: TrainerChannel, engines: list[EngineInfo],
                                 admins: dict[int, EngineAdmin], num_engines: int, rank_engines: list[list[int]],
                                 bucket_bytes: int, timeout_s: float = 600.0) -> dict[str, float]:
    """Open a weight-update session on every live engine, have every trainer rank send its buckets to the
    engine on its GPU (`ColocatedSyncCommand`, ranks paired by `colocated_pairs`), close the sessions. The
    caller paused the engines and resumed their weights."""
    start = time.perf_counter()
    urls = [""] * num_engines
    for engine in engines:
        urls[engine.engine_index] = engine.url
    await asyncio.gather(*(admins[e.engine_index].begin_weight_update() for e in engines))
    done = await channel.run(lambda rank, seq: ColocatedSyncCommand(
        seq=seq, weight_version=version, engine_urls=urls, rank_engines=rank_engines, bucket_bytes=bucket_bytes),
        timeout_s=timeout_s)
    await asyncio.gather(*(admins[e.engine_index].end_weight_update() for e in engines))
    seconds = time.perf_counter() - start
    merged = merge_metrics(done)
    log.info("weights v%d -> %d colocated engine(s) through /update_weights_from_tensor: %s bucket(s) in %.2f s",
             version, len(engines), merged.get("buckets"), seconds)
    return {"weight_sync/seconds": seconds, "weight_sync/buckets": float(merged.get("buckets", 0)),
            "weight_sync/mbytes": float(merged.get("bytes", 0)) / 1e6, "weight_sync/new_group": 0.0}
