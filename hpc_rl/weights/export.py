"""Full HF-named tensors from a (TP-sharded) Megatron model, for engines and HF checkpoints.

Owns: gathering one parameter's TP shards (all-gather on the TP group), undoing the TP layout
(`hf_mapping.unshard`) and mapping to HF names/layouts (`hf_mapping.to_hf`), one Megatron parameter
at a time so at most one full tensor per parameter is alive. Also the shapes a parameter will have
after the gather, without gathering (for planning buckets). Names are global: under pipeline
parallelism a stage's layers carry their global index (`stage`). Does not broadcast, nor move
tensors between pipeline stages (`sender`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.weights import hf_mapping
from hpc_rl.weights.stage import global_named_params, stage_layout, stage_name_map


def named_megatron_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """This rank's parameters under global canonical names (DDP/`module.` prefixes stripped)."""
    return global_named_params(model)


def full_shape(megatron_name: str, local_shape: torch.Size | tuple[int, ...], tp_size: int) -> tuple[int, ...]:
    """Shape of the gathered tensor."""
    split = hf_mapping.tp_split(megatron_name)
    shape = list(local_shape)
    if split.dim is not None:
        shape[split.dim] *= tp_size
    return tuple(shape)


def gather_full(megatron_name: str, local: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The full tensor of one parameter on every rank of `tp_group` (a collective on that group)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1 or hf_mapping.tp_split(megatron_name).dim is None:
        return local.detach()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, local.detach().contiguous(), group=tp_group)
    return hf_mapping.unshard(megatron_name, shards)


def export_param(megatron_name: str, local: torch.Tensor, arch: ModelArchitecture,
                 tp_group: dist.ProcessGroup | None) -> list[tuple[str, torch.Tensor]]:
    """HF (name, full tensor) pairs of one Megatron parameter."""
    return hf_mapping.to_hf(megatron_name, gather_full(megatron_name, local, tp_group), arch)


def export_hf_state_dict(model: torch.nn.Module, arch: ModelArchitecture,
                         tp_group: dist.ProcessGroup | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor this pipeline stage holds (all of them at PP=1), in `hf_mapping.name_map`
    order; all TP ranks of the stage must iterate it together."""
    params = named_megatron_params(model)
    for megatron_name, _ in stage_name_map(arch, stage_layout(model)):
        yield from export_param(megatron_name, params[megatron_name], arch, tp_group)
