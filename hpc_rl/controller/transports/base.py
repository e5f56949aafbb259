"""The one interface every weight transport implements, and the settings that choose one.

A transport moves the trainer's weights, as one version, to a list of engines that are ready for it (paused,
or idle between rollouts; the caller, `controller.weight_updates`, owns that order and the version). Each
transport has a controller half (a `WeightTransport` here, in `controller/transports/<name>.py`) and a trainer
half (`training/transports/<name>.py`, the commands its controller half sends); the layer order keeps the two
halves in the two packages (the controller never imports torch), under the same module name.

    transport    controller half                         trainer half            engines' endpoint
    broadcast    transports.broadcast (WeightGroup)      SyncWeightsCommand      /update_weights_from_distributed
    disk         transports.disk                         DiskWeightsCommand      /update_weights_from_disk
    colocated    transports.colocated                    ColocatedSyncCommand    /update_weights_from_tensor
    lora         transports.lora                         LoraAdapterCommand      /load_lora_adapter (+ unload)
    lora_tensor  transports.lora_tensor                  LoraTensorCommand       /load_lora_adapter_from_tensors
                                                         (+ ColocatedSyncCommand for a released base)

A new way (LoRA adapters, FP8 blocks) is a new pair of modules and a row in `transports.TRANSPORTS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from hpc_rl.config.lora import LoraConfig
from hpc_rl.config.schema import ClusterConfig, ControllerConfig, RolloutConfig
from hpc_rl.controller.registry import EngineInfo
from hpc_rl.weights.lora_sync import adapter_transport

if TYPE_CHECKING:
    from hpc_rl.controller.engine_fleet import EngineFleet
    from hpc_rl.controller.registry import Registry
    from hpc_rl.controller.trainer_channel import TrainerChannel


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
    """nccl (the broadcast group) or disk (rollout.update_weight_transport: transports.disk)."""
    disk_dir: str | None = None
    keep_disk_files: bool = False
    external_engines: bool = False
    """The engines are another job's (rollout.rollout_external_engine_addrs): they may hold an earlier run's group."""
    flush_cache_interval: int = 1
    """rollout.flush_cache_interval (slime's --flush-cache-interval): 1 flushes the engines' cache at every sync
    (the engines finish or retract their requests first); N > 1 updates in place (requests keep running with
    their KV cache) and flushes every N-th sync; 0 never flushes. Only async, decoupled, broadcast."""
    lora_dir: str | None = None
    """The run dir of a LoRA run whose engines serve its adapter (issue 33): each version's PEFT directory goes
    under its adapters/ (transports.lora); None: the whole weights are synced."""
    lora_tensor: bool = False
    """The adapter goes as tensors (/load_lora_adapter_from_tensors, transports.lora_tensor): colocated engines, or
    lora.lora_sync_from_tensor."""
    lora_base_cpu_backup: bool = False
    """Colocated LoRA: the engines keep a host copy of the base across a release (lora.lora_base_cpu_backup), so a
    sync sends the adapter alone."""
    sync_at_start: bool = False
    """Push the trainer's weights before the first rollout of a fresh run (lora.lora_adapter_path: the adapter the
    trainer starts from)."""

    @classmethod
    def from_sections(cls, cluster: ClusterConfig, rollout: RolloutConfig,
                      controller: ControllerConfig, *, lora_dir: str | None = None,
                      lora: LoraConfig | None = None) -> WeightSyncSettings:
        return cls(backend="gloo" if cluster.device == "cpu" else "nccl", colocate=cluster.colocate,
                   async_rollout=rollout.async_rollout, update_weights_interval=rollout.update_weights_interval,
                   bucket_bytes=rollout.update_weight_buffer_size, timeout_s=controller.engine_request_timeout,
                   num_engines=cluster.num_engines,
                   transport=rollout.update_weight_transport, disk_dir=rollout.update_weight_disk_dir,
                   keep_disk_files=rollout.update_weight_disk_keep_files,
                   external_engines=bool(rollout.rollout_external_engine_addrs),
                   flush_cache_interval=rollout.flush_cache_interval, lora_dir=lora_dir,
                   lora_tensor=lora_dir is not None and lora is not None
                   and adapter_transport(lora, colocate=cluster.colocate) == "tensor",
                   lora_base_cpu_backup=bool(lora and lora.lora_base_cpu_backup),
                   sync_at_start=lora_dir is not None and bool(lora and lora.lora_adapter_path))

    @property
    def transport_name(self) -> str:
        """The key of `transports.TRANSPORTS` this run uses."""
        if self.lora_dir is not None:
            return "lora_tensor" if self.lora_tensor or self.colocate else "lora"
        return "colocated" if self.colocate else "disk" if self.transport == "disk" else "broadcast"

    @property
    def in_place_updates(self) -> bool:
        """Syncs update the engines while a rollout generates, its requests paused in place (flush_cache_interval
        other than 1; validation allows it only in async, decoupled mode over the broadcast group)."""
        return self.flush_cache_interval != 1 and self.async_rollout and not self.colocate


class WeightTransport(ABC):
    """How the trainer's weights reach the engines: `push` one version to engines ready for it."""

    name: ClassVar[str]
    keeps_cache: ClassVar[bool] = False
    """Whether `push(..., flush_cache=False)` is honoured: the engines keep their KV cache (requests paused in
    place go on with it). SGLang's disk and tensor paths always flush."""

    def __init__(self, settings: WeightSyncSettings, *, channel: TrainerChannel, fleet: EngineFleet,
                 registry: Registry) -> None:
        self.settings, self.channel, self.fleet, self.registry = settings, channel, fleet, registry

    @abstractmethod
    async def push(self, version: int, engines: list[EngineInfo], *, flush_cache: bool = True) -> dict[str, float]:
        """The trainer's current weights to `engines` as `version`; timing metrics (`weight_sync/...`)."""

    def engine_failed(self, engine_index: int) -> None:
        """The fleet failed an engine (a transport that keeps state about its engines forgets it)."""

    async def before_trainer_work(self) -> None:
        """Before the trainer's next command: settle what a failed engine left on the trainer's side."""
