"""Which GPU a process of the job runs on, by what it is: its node's name and the GPU id Slurm gave it.

Owns: the device identity `<node>/gpu<id>` of trainer ranks and engines, read from the step's own
environment (`SLURMD_NODENAME`; the GPU ids Slurm gave the step, `SLURM_STEP_GPUS`, else
`CUDA_VISIBLE_DEVICES`; a process uses the GPU at a position of that list: a trainer rank its
`LOCAL_RANK`, an engine SGLang's `--base-gpu-id` + its TP rank), never from rank arithmetic; the
pairing of colocated trainer ranks with the engines on their GPUs (`pair_ranks_with_engines`); the CPU
twin of SGLang's refusal of CUDA IPC handles from a GPU it cannot see (`refuse_invisible_device`); and
NCCL's refusal of two weight-update group members on one GPU, made on the gloo path too.

Why identities and not indices: torchrun numbers nodes by sorting their descriptors (names), Slurm lists
them in its own order (node9 before node10), so "trainer rank r shares engine r // t's GPUs" is false on
real clusters; and under `ConstrainDevices=yes` every step's `CUDA_VISIBLE_DEVICES` starts at 0 while
`SLURM_STEP_GPUS` keeps the node's ids. Two steps that hold the same GPUs of a node list them in the same
order, so a position names the same GPU in the trainer's step and in a colocated engine's.

Duplicate devices: NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU detected : rank
1 and rank 0 both on CUDA device ..."), which is why colocated mode has no such group. gloo does not care,
so on CPU the same refusal is made here: each member publishes its identity in the group's store before
joining, and after the join (a barrier: every member has published) each one reads the identities that
were published and raises on a duplicate. A member that publishes nothing (real SGLang) is not checked;
on GPUs NCCL makes the check itself. No torch at import: the driver and the controller read this module.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the driver imports this module; it must not load torch
    import torch.distributed as dist

DEVICE_ID_ENV = "HPC_RL_DEVICE_ID"
"""An explicit identity (tests, hand-started processes); an engine step's placement check sets it."""
_KEY = "hpc_rl/device/{rank}"
_SEPARATOR = "/gpu"


class DuplicateDeviceError(RuntimeError):
    """Two members of one weight-update group on the same device (NCCL's "Duplicate GPU detected")."""


class PlacementError(RuntimeError):
    """A process was placed on GPUs its step does not hold, or ranks and engines do not share GPUs."""


class InvisibleDeviceError(ValueError):
    """CUDA IPC handles of a GPU the engine cannot see (SGLang: `Invalid device_uuid=...`, its scheduler dies)."""


def device_identity(node: str, gpu: str | int) -> str:
    """`node9/gpu3`: GPU 3 (Slurm's id on that node) of node9."""
    return f"{node}{_SEPARATOR}{gpu}"


def split_identity(identity: str) -> tuple[str, str]:
    """`node9/gpu3` -> ('node9', '3')."""
    node, separator, gpu = identity.rpartition(_SEPARATOR)
    if not separator or not node:
        raise ValueError(f"{identity!r} is not a device identity (<node>/gpu<id>)")
    return node, gpu


def node_name(environ: Mapping[str, str] = os.environ) -> str:
    """Slurm's name of this node (`SLURMD_NODENAME`: virtual nodes of one machine share a host name),
    else the host name."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def step_gpu_ids(environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The GPU ids of this step, in order: Slurm's (`SLURM_STEP_GPUS`, the node's ids even under
    ConstrainDevices), else `CUDA_VISIBLE_DEVICES`; None when neither is set (every GPU of the node)."""
    for key in ("SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = environ.get(key)
        if value is not None and value.strip():
            return [item.strip() for item in value.split(",") if item.strip()]
    return None


def device_at(position: int, environ: Mapping[str, str] = os.environ, *, who: str = "this process") -> str:
    """The identity of the GPU at `position` of this step's GPU list (the index CUDA gives it)."""
    ids = step_gpu_ids(environ)
    if ids is None:
        return device_identity(node_name(environ), position)
    if not 0 <= position < len(ids):
        raise PlacementError(f"{who} uses GPU position {position} on {node_name(environ)}, but its Slurm step holds "
                             f"only {len(ids)} GPU(s) ({','.join(ids)}): the step must ask Slurm for the node's GPUs")
    return device_identity(node_name(environ), ids[position])


def engine_devices(base_gpu_id: int, tp_size: int, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs an engine's TP ranks use: positions base_gpu_id .. base_gpu_id + tp_size - 1 (SGLang's
    `--base-gpu-id`, `--gpu-id-step 1`)."""
    return [device_at(base_gpu_id + rank, environ, who=f"engine TP rank {rank}") for rank in range(tp_size)]


def trainer_rank_device(environ: Mapping[str, str] = os.environ) -> str:
    """A torchrun trainer rank's GPU: position LOCAL_RANK of its step's list (what `cuda:LOCAL_RANK` is)."""
    return device_at(int(environ.get("LOCAL_RANK", "0")), environ, who=f"trainer rank {environ.get('RANK', '?')}")


def own_device_identity(environ: Mapping[str, str] = os.environ) -> str | None:
    """$HPC_RL_DEVICE_ID, else a torchrun trainer rank's, else None (unknown: not checked)."""
    if environ.get(DEVICE_ID_ENV):
        return environ[DEVICE_ID_ENV]
    if "LOCAL_RANK" in environ:
        return trainer_rank_device(environ)
    return None


def refuse_invisible_device(sender: str, environ: Mapping[str, str] = os.environ) -> None:
    """The CPU engine's twin of SGLang's IPC check: a share from a GPU this engine's step cannot see
    (another node, or a GPU outside its step) raises InvisibleDeviceError with SGLang's words."""
    node, gpu = split_identity(sender)
    ids = step_gpu_ids(environ)
    if node != node_name(environ) or (ids is not None and gpu not in ids):
        visible = f"{node_name(environ)} GPUs {','.join(ids) if ids is not None else 'all'}"
        raise InvisibleDeviceError(f"Invalid device_uuid={sender} (this engine sees {visible}: the trainer rank "
                                   "that sent it is on another node or GPU)")


def pair_ranks_with_engines(rank_devices: Mapping[int, str],
                            engine_devices_by_index: Mapping[int, Sequence[str]]) -> dict[int, tuple[int, int]]:
    """Colocated mode: each trainer rank -> (engine index, engine TP rank) of the engine whose TP rank runs
    on the rank's GPU. Raises PlacementError naming every rank that shares no GPU with an engine."""
    owner: dict[str, tuple[int, int]] = {}
    for index, devices in sorted(engine_devices_by_index.items()):
        for tp_rank, device in enumerate(devices):
            if device in owner:
                raise PlacementError(f"engines {owner[device][0]} and {index} both run on {device}")
            owner[device] = (index, tp_rank)
    pairs, lonely = {}, []
    for rank, device in sorted(rank_devices.items()):
        if device in owner:
            pairs[rank] = owner[device]
        else:
            lonely.append(f"rank {rank} on {device}")
    if lonely:
        engines = "; ".join(f"engine {i}: {', '.join(d)}" for i, d in sorted(engine_devices_by_index.items()))
        raise PlacementError(f"colocated trainer ranks without an engine on their GPU: {', '.join(lonely)} "
                             f"(engines: {engines or 'none'})")
    return pairs


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
