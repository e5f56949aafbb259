"""Weight transports: how the trainer's weights reach the engines, one module per way (see `base`).

    broadcast   trainer rank 0 -> a weight-update group (NCCL/gloo) -> every engine   (decoupled default)
    disk        every trainer rank -> an HF directory on a shared filesystem -> every engine loads it
    colocated   every trainer rank -> the engine on its own GPU (CUDA IPC / shared memory)
    lora        every trainer rank -> only the LoRA adapter, a PEFT directory on a shared filesystem -> every
                engine loads it by a versioned name (the base stays; issue 33)
    lora_tensor every trainer rank -> only the LoRA adapter, as tensors, to the engine on its GPU
                (/load_lora_adapter_from_tensors; colocated LoRA, with the base re-sent when the engines dropped it)

`make_transport` picks the one a run's settings name; `controller.weight_updates` decides when and in what
order (pause, push, serve, continue). Each module's trainer half is `hpc_rl.training.transports.<name>`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_rl.controller.transports.base import WeightSyncSettings, WeightTransport
from hpc_rl.controller.transports.broadcast import BroadcastTransport
from hpc_rl.controller.transports.colocated import ColocatedTransport
from hpc_rl.controller.transports.disk import DiskTransport
from hpc_rl.controller.transports.lora import LoraTransport
from hpc_rl.controller.transports.lora_tensor import LoraTensorTransport

if TYPE_CHECKING:
    from hpc_rl.controller.colocated_memory import ColocatedMemory
    from hpc_rl.controller.engine_fleet import EngineFleet
    from hpc_rl.controller.registry import Registry
    from hpc_rl.controller.trainer_channel import TrainerChannel

TRANSPORTS: dict[str, type[WeightTransport]] = {
    transport.name: transport for transport in (BroadcastTransport, DiskTransport, ColocatedTransport,
                                                   LoraTransport, LoraTensorTransport)}
"""Each transport by its name (`WeightSyncSettings.transport_name`)."""


def make_transport(settings: WeightSyncSettings, *, channel: TrainerChannel, fleet: EngineFleet,
                   registry: Registry, memory: ColocatedMemory | None) -> WeightTransport:
    """The transport `settings` names (colocated ones also get the trainer's memory state)."""
    kind = TRANSPORTS[settings.transport_name]
    extra = {"memory": memory} if kind in (ColocatedTransport, LoraTensorTransport) else {}
    return kind(settings, channel=channel, fleet=fleet, registry=registry, **extra)


__all__ = ["TRANSPORTS", "WeightSyncSettings", "WeightTransport", "make_transport"]
