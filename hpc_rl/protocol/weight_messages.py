"""Weight-sync messages between the controller and the trainer ranks: the commands of each transport
(broadcast, disk, colocated, LoRA adapters), aborting a weight-update group, rank 0's broadcast plan and its
wait for the engines to join the group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hpc_rl.protocol.message_base import Message


@dataclass(kw_only=True)
class SyncWeightsCommand(Message):
    """Send the current weights to the engines as `weight_version` (rank 0 broadcasts)."""

    TYPE: ClassVar[str] = "sync_weights"
    seq: int
    weight_version: int
    new_group: bool
    world_size: int
    group_name: str
    backend: str
    bucket_bytes: int


@dataclass(kw_only=True)
class DiskWeightsCommand(Message):
    """Write the current weights as an HF directory at `path` (every rank takes part; slime's
    --update-weight-transport disk): the engines then load it with /update_weights_from_disk."""

    TYPE: ClassVar[str] = "disk_weights"
    seq: int
    weight_version: int
    path: str
    engine_urls: list[str] = field(default_factory=list)
    """The engines that will read it (handed to the post-write hook, slime's rollout_engines)."""


@dataclass(kw_only=True)
class LoraAdapterCommand(Message):
    """Write the actor's LoRA adapter (only the adapter; issue 33) as a PEFT directory at `path` (every rank takes
    part: the TP shards are gathered): the engines then load it with /load_lora_adapter."""

    TYPE: ClassVar[str] = "lora_adapter"
    seq: int
    weight_version: int
    path: str


@dataclass(kw_only=True)
class LoraTensorCommand(Message):
    """Send the actor's LoRA adapter (only the adapter; issue 33) to the engine on each rank's GPU through SGLang's
    /load_lora_adapter_from_tensors as `lora_name` (every rank takes part: the TP shards are gathered; the rank on
    each engine's TP rank 0 posts it)."""

    TYPE: ClassVar[str] = "lora_tensor"
    seq: int
    weight_version: int
    lora_name: str
    engine_urls: list[str]
    """By engine index; "" for an engine that is down or already holds `lora_name`."""
    rank_engines: list[list[int]]
    """Per trainer rank: [engine index, engine TP rank] of the engine on its GPU (as ColocatedSyncCommand's)."""


@dataclass(kw_only=True)
class ColocatedSyncCommand(Message):
    """Colocated mode: every rank sends the current weights to the engine on its own GPU, per bucket,
    through `/update_weights_from_tensor` (no weight-update group; the controller opens the session)."""

    TYPE: ClassVar[str] = "colocated_sync"
    VERSION: ClassVar[int] = 2
    """2: ranks are paired with engines by the GPU they share (`rank_engines`), not by rank arithmetic."""
    seq: int
    weight_version: int
    engine_urls: list[str]
    """By engine index; "" for an engine that is down (its ranks still take part in the TP gathers)."""
    rank_engines: list[list[int]]
    """Per trainer rank: [engine index, engine TP rank] of the engine whose TP rank runs on the rank's GPU
    (paired by device identity, `weights.device_identity.pair_ranks_with_engines`)."""
    bucket_bytes: int


@dataclass(kw_only=True)
class AbortWeightGroupCommand(Message):
    """An engine broke a weight sync: rank 0 aborts the weight-update group without waiting for its pending
    broadcasts (on NCCL they never complete); the next sync builds a new group."""

    TYPE: ClassVar[str] = "abort_weight_group"
    seq: int
    reason: str = ""


@dataclass(kw_only=True)
class WeightPlan(Message):
    """Trainer rank 0 -> controller during a sync: where to meet and the buckets it will broadcast."""

    TYPE: ClassVar[str] = "weight_plan"
    weight_version: int
    master_address: str
    master_port: int
    buckets: list[dict[str, Any]]
    """Per bucket: names, dtypes, shapes (lists, in broadcast order) and num_bytes."""
    load_format: str | None = None


@dataclass(kw_only=True)
class WeightGroupJoinCheck(Message):
    """Trainer rank 0 -> controller, every half second while it waits for the engines to join a new weight-update
    group (sync command `seq`): should it go on waiting? (An engine that dies before joining never comes; only the
    controller knows, from the engine's failed init call.)"""

    TYPE: ClassVar[str] = "weight_group_join_check"
    rank: int
    seq: int


@dataclass(kw_only=True)
class WeightGroupJoinVerdict(Message):
    """The controller's answer to a WeightGroupJoinCheck: "" (keep waiting) or why rank 0 stops waiting (it then
    ends the sync command without broadcasting; the controller rebuilds the group without the lost engine)."""

    TYPE: ClassVar[str] = "weight_group_join_verdict"
    give_up: str = ""
