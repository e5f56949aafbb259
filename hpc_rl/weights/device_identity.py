"""Which device a weight-update group member runs on, and NCCL's refusal of two members on one device.

Owns: the device identity string of a process (`het group / node / GPU index`, from the job topology:
het groups are different nodes, so the triple names one physical GPU), and the check every member
runs when it joins a weight-update group. NCCL refuses a communicator with two ranks on one GPU
("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ..."), which is why colocated mode
has no such group. gloo does not care, so on CPU the same refusal is made here: each member publishes
its identity in the group's store before joining, and after the join (a barrier: every member has
published) each one reads the identities that were published and raises on a duplicate. A member that
publishes nothing (real SGLang) is not checked; on GPUs NCCL makes the check itself.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the driver imports this module; it must not load torch
    import torch.distributed as dist

DEVICE_ID_ENV = "HPC_RL_DEVICE_ID"
_KEY = "hpc_rl/device/{rank}"


class DuplicateDeviceError(RuntimeError):
    """Two members of one weight-update group on the same device (NCCL's "Duplicate GPU detected")."""


def device_identity(*, het_group: int, node_index: int, gpu_index: int) -> str:
    return f"group{het_group}/node{node_index}/gpu{gpu_index}"


def own_device_identity() -> str | None:
    """$HPC_RL_DEVICE_ID, else a torchrun trainer rank's (het group 0, node GROUP_RANK, GPU LOCAL_RANK),
    else None (unknown: not checked)."""
    if os.environ.get(DEVICE_ID_ENV):
        return os.environ[DEVICE_ID_ENV]
    if "LOCAL_RANK" in os.environ and "GROUP_RANK" in os.environ:
        return device_identity(het_group=0, node_index=int(os.environ["GROUP_RANK"]),
                               gpu_index=int(os.environ["LOCAL_RANK"]))
    return None


def publish_device(store: dist.Store, rank: int, device_id: str | None) -> None:
    """Before joining: tell the other members where this one runs."""
    if device_id:
        store.set(_KEY.format(rank=rank), device_id)


def refuse_duplicate_devices(store: dist.Store, rank: int, world_size: int) -> None:
    """After joining: raise DuplicateDeviceError if two published identities are equal."""
    seen: dict[str, int] = {}
    for other in range(world_size):
        key = _KEY.format(rank=other)
        if not store.check([key]):
            continue
        device = store.get(key).decode()
        if device in seen:
            raise DuplicateDeviceError(
                f"Duplicate GPU detected: rank {other} and rank {seen[device]} of the weight-update group are both "
                f"on device {device} (NCCL refuses this; colocated engines get weights through "
                f"/update_weights_from_tensor, not a weight-update group)")
        seen[device] = other
