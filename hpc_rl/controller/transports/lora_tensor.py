"""The LoRA adapter transport through tensors (issue 33; miles' colocated LoRA sync): each sync sends the trained
adapter to the engine on each trainer rank's GPU with SGLang's /load_lora_adapter_from_tensors. Its trainer half:
`hpc_rl.training.transports.lora_tensor`. The body and its one pickle: `weights.lora_sync`.

Owns one push to colocated engines (ranks paired with engines by device, `colocated.colocated_pairs`):

    [base due]  the base weights, as the colocated transport sends them (/update_weights_from_tensor, bucketed),
                when the engines' weights were released with SGLang's memory saver (colocated sync mode), which
                discards them; not with lora_base_cpu_backup (miles' --lora-base-cpu-backup: the engines keep a host
                copy of the base, SGLang's --enable-weights-cpu-backup, and get it back on resume)
    adapter     every trainer rank takes part in gathering it; the rank on each engine's TP rank 0 posts it once
                (one copy per engine TP rank in the body) as `policy-v<N>`
    then        as the directory transport (`lora.LoraTransport`): each engine reports version N, its older adapter
                is unloaded (a refused unload only warns)

Bytes per sync (`perf/weight_sync_bytes`): the adapter's, plus the base's when it was re-sent. The trainer's weights
are onloaded around the push if they were offloaded (as the colocated transport does).
"""

from __future__ import annotations

import time
from typing import Any

from hpc_rl.controller.colocated_memory import WEIGHTS_TAG, ColocatedMemory
from hpc_rl.controller.registry import EngineInfo
from hpc_rl.controller.trainer_channel import merge_metrics
from hpc_rl.controller.transports.colocated import colocated_pairs, push_weights_colocated
from hpc_rl.controller.transports.lora import LoraTransport
from hpc_rl.protocol.messages import LoraTensorCommand


class LoraTensorTransport(LoraTransport):
    """The adapter (and, when the engines dropped it, the base) to colocated engines as tensors."""

    name = "lora_tensor"

    def __init__(self, *args: Any, memory: ColocatedMemory | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.memory = memory

    @property
    def base_due(self) -> bool:
        """Whether each push re-sends the base: colocated sync mode releases the engines' weights before every
        train step that a sync follows, and SGLang's memory saver discards them unless they are backed up on the
        host (lora_base_cpu_backup)."""
        settings = self.settings
        return settings.colocate and not settings.async_rollout and not settings.lora_base_cpu_backup

    async def push(self, version: int, engines: list[EngineInfo], *, flush_cache: bool = True) -> dict[str, float]:
        was_offloaded = self.memory is not None and WEIGHTS_TAG in self.memory.trainer_offloaded
        if self.memory is not None:
            await self.memory.trainer("onload", [WEIGHTS_TAG])
        try:
            return await super().push(version, engines, flush_cache=flush_cache)
        finally:
            if was_offloaded and self.memory is not None:
                await self.memory.trainer("offload", [WEIGHTS_TAG])

    async def _send(self, version: int, name: str, engines: list[EngineInfo]) -> dict[str, float]:
        settings, start = self.settings, time.perf_counter()
        pairs = colocated_pairs(self.registry)
        metrics: dict[str, float] = {}
        base_bytes = 0.0
        if self.base_due:
            base = await push_weights_colocated(version=version, channel=self.channel, engines=engines,
                                                admins=self.fleet.admins, num_engines=settings.num_engines,
                                                rank_engines=pairs, bucket_bytes=settings.bucket_bytes,
                                                timeout_s=settings.timeout_s)
            base_bytes = base["perf/weight_sync_bytes"]
            metrics.update({"weight_sync/base_seconds": base["weight_sync/seconds"],
                            "weight_sync/base_bytes": base_bytes})
        adapter_start = time.perf_counter()
        urls = [""] * settings.num_engines
        for engine in engines:
            if self.loaded.get(engine.engine_index) != name:
                urls[engine.engine_index] = engine.url
        done = await self.channel.run(lambda rank, seq: LoraTensorCommand(
            seq=seq, weight_version=version, lora_name=name, engine_urls=urls, rank_engines=pairs),
            timeout_s=settings.timeout_s)
        adapter_bytes = float(merge_metrics(done).get("adapter_bytes", 0))
        end = time.perf_counter()
        return {**metrics, "weight_sync/adapter_seconds": end - adapter_start,
                "weight_sync/adapter_bytes": adapter_bytes,
                "weight_sync/mbytes": (adapter_bytes + base_bytes) / 1e6,
                "perf/weight_sync_bytes": adapter_bytes + base_bytes, "weight_sync/send_seconds": end - start}

    def _forget_older(self, version: int) -> None:
        """No directories: the adapter went as tensors."""
