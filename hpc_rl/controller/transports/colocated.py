"""The colocated transport's controller half: every trainer rank posts its weights to the engine on its own GPU
through SGLang's /update_weights_from_tensor (CUDA IPC handles; shared memory on the CPU twin). Its trainer
half: `hpc_rl.training.transports.colocated`.

Owns pairing trainer ranks with engines by device (`colocated_pairs`) and one colocated push (the engines'
begin/end session around the trainer's `ColocatedSyncCommand`), with the trainer's weights onloaded for it if
they were offloaded. Not here: the memory moves around training (`controller.colocated_memory`). SGLang's tensor
path always flushes the engines' cache (`keeps_cache` False).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hpc_rl.controller.colocated_memory import WEIGHTS_TAG, ColocatedMemory
from hpc_rl.controller.engine_admin import EngineAdmin
from hpc_rl.controller.registry import EngineInfo, Registry
from hpc_rl.controller.trainer_channel import TrainerChannel, merge_metrics
from hpc_rl.controller.transports.base import WeightTransport
from hpc_rl.protocol.messages import ColocatedSyncCommand
from hpc_rl.weights.device_identity import PlacementError, pair_ranks_with_engines

log = logging.getLogger(__name__)


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
            "weight_sync/mbytes": float(merged.get("bytes", 0)) / 1e6, "weight_sync/new_group": 0.0,
            "perf/weight_sync_bytes": float(merged.get("bytes", 0))}


class ColocatedTransport(WeightTransport):
    """`push_weights_colocated`, with the trainer's weights onloaded around it when they were offloaded."""

    name = "colocated"

    def __init__(self, *args: Any, memory: ColocatedMemory, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.memory = memory

    async def push(self, version: int, engines: list[EngineInfo], *, flush_cache: bool = True) -> dict[str, float]:
        settings = self.settings
        was_offloaded = WEIGHTS_TAG in self.memory.trainer_offloaded
        await self.memory.trainer("onload", [WEIGHTS_TAG])
        metrics = await push_weights_colocated(
            version=version, channel=self.channel, engines=engines, admins=self.fleet.admins,
            num_engines=settings.num_engines, rank_engines=colocated_pairs(self.registry),
            bucket_bytes=settings.bucket_bytes, timeout_s=settings.timeout_s)
        if was_offloaded:
            await self.memory.trainer("offload", [WEIGHTS_TAG])
        return metrics
