"""Colocated mode: engines share the trainer's GPUs; memory changes hands around each train step.

Owns where the trainer's state is and the order of the memory moves (slime's, with SGLang 0.5.23's calls);
the weights themselves go through the colocated transport (`transports.colocated`):

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

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hpc_rl.controller.trainer_channel import TrainerChannel, merge_metrics
from hpc_rl.protocol.messages import TrainerMemoryCommand

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
