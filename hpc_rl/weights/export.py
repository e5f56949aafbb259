"""Full HF-named tensors from a (TP-, EP-sharded) Megatron model, for engines and HF checkpoints.

Owns: gathering one parameter's TP shards (all-gather on the TP group), undoing the TP layout
(`hf_mapping.unshard`) and mapping to HF names/layouts (`hf_mapping.to_hf`), one Megatron parameter
at a time so at most one full tensor per parameter is alive. Routed experts (`ExpertLayout`): the EP
rank that holds an expert gathers its shards over the expert-TP group, then broadcasts the full
tensor over its EP group, one expert parameter at a time (every rank of an expert replica takes part;
never the whole model on one rank). Also the shapes a parameter will have after the gather, without
gathering (for planning buckets). Names are global: under pipeline parallelism a stage's layers carry
their global index (`stage`), under expert parallelism experts their global index. Does not
broadcast to engines, nor move tensors between pipeline stages (`sender`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.weights import hf_mapping
from hpc_rl.weights.stage import global_named_params, stage_layout, stage_name_map


@dataclass(frozen=True)
class ExpertLayout:
    """Where this rank's routed experts live. The default (EP 1, expert TP 1): every expert is here, whole."""

    num_experts: int = 0
    ep_group: dist.ProcessGroup | None = None
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    """The expert-TP group (Megatron's default: the TP group)."""
    tp_size: int = 1
    dp_rank: int = 0
    """Expert-data-parallel rank: ranks with 0 hold one whole replica of the experts between them."""

    @classmethod
    def current(cls, arch: ModelArchitecture) -> ExpertLayout:
        """This rank's layout from Megatron's initialised groups (the default for a dense model)."""
        if not arch.is_moe:
            return cls()
        from megatron.core import parallel_state as ps

        ep_size = ps.get_expert_model_parallel_world_size()
        tp_size = ps.get_expert_tensor_parallel_world_size()
        return cls(num_experts=int(arch.num_moe_experts or 0),
                   ep_group=ps.get_expert_model_parallel_group() if ep_size > 1 else None,
                   ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep_size,
                   tp_group=ps.get_expert_tensor_parallel_group() if tp_size > 1 else None, tp_size=tp_size,
                   dp_rank=ps.get_expert_data_parallel_rank())

    @property
    def first_local(self) -> int:
        """Global index of this rank's first expert."""
        return self.ep_rank * (self.num_experts // self.ep_size) if self.num_experts else 0

    def owner(self, megatron_name: str) -> int:
        """The EP rank holding this expert parameter."""
        return hf_mapping.expert_owner(hf_mapping.expert_index(megatron_name), self.num_experts, self.ep_size)

    def template(self, megatron_name: str) -> str:
        """The same parameter of this rank's first expert (every expert of a layer has one shape)."""
        return hf_mapping.with_expert_index(megatron_name, self.first_local)


NO_EXPERTS = ExpertLayout()


def named_megatron_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters (and expert-bias buffers) under global canonical names."""
    return global_named_params(model)


def full_shape(megatron_name: str, local_shape: torch.Size | tuple[int, ...], tp_size: int) -> tuple[int, ...]:
    """Shape of the gathered tensor (`tp_size`: of the group it is sharded over)."""
    split = hf_mapping.tp_split(megatron_name)
    shape = list(local_shape)
    if split.dim is not None:
        shape[split.dim] *= tp_size
    return tuple(shape)


def full_shape_and_dtype(megatron_name: str, params: Mapping[str, torch.Tensor], tp_size: int,
                         experts: ExpertLayout = NO_EXPERTS) -> tuple[tuple[int, ...], torch.dtype]:
    """Gathered shape and dtype of any parameter of this stage, another EP rank's experts included."""
    if hf_mapping.is_expert_param(megatron_name):
        local = params[megatron_name if megatron_name in params else experts.template(megatron_name)]
        return full_shape(megatron_name, local.shape, experts.tp_size), local.dtype
    local = params[megatron_name]
    return full_shape(megatron_name, local.shape, tp_size), local.dtype


def gather_full(megatron_name: str, local: torch.Tensor, tp_group: dist.ProcessGroup | None,
                arch: ModelArchitecture | None = None) -> torch.Tensor:
    """The full tensor of one parameter on every rank of `tp_group` (a collective on that group)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1 or hf_mapping.tp_split(megatron_name).dim is None:
        return local.detach()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, local.detach().contiguous(), group=tp_group)
    return hf_mapping.unshard(megatron_name, shards, arch)


def gather_expert(megatron_name: str, params: Mapping[str, torch.Tensor], experts: ExpertLayout) -> torch.Tensor:
    """One routed expert's full tensor on every rank of this expert replica (expert-TP x EP): its EP
    rank gathers it over the expert-TP group, then broadcasts it over the EP group."""
    if experts.ep_size == 1:
        return gather_full(megatron_name, params[megatron_name], experts.tp_group)
    owner = experts.owner(megatron_name)
    if owner == experts.ep_rank:
        full = gather_full(megatron_name, params[megatron_name], experts.tp_group).contiguous()
    else:
        template = params[experts.template(megatron_name)]
        full = torch.empty(full_shape(megatron_name, template.shape, experts.tp_size), dtype=template.dtype,
                           device=template.device)
    assert experts.ep_group is not None
    dist.broadcast(full, src=dist.get_global_rank(experts.ep_group, owner), group=experts.ep_group)
    return full


def full_tensor(megatron_name: str, params: Mapping[str, torch.Tensor], tp_group: dist.ProcessGroup | None,
                experts: ExpertLayout, arch: ModelArchitecture | None = None) -> torch.Tensor:
    """The full tensor of one parameter: a collective on the TP group (dense), on the expert replica
    (routed experts)."""
    if hf_mapping.is_expert_param(megatron_name):
        return gather_expert(megatron_name, params, experts)
    return gather_full(megatron_name, params[megatron_name], tp_group, arch)


def export_param(megatron_name: str, params: Mapping[str, torch.Tensor], arch: ModelArchitecture,
                 tp_group: dist.ProcessGroup | None, experts: ExpertLayout | None = None,
                 ) -> list[tuple[str, torch.Tensor]]:
    """HF (name, full tensor) pairs of one Megatron parameter (a collective: see `full_tensor`).
    `experts`: None reads the layout from Megatron's groups (a MoE model needs them initialised)."""
    if experts is None:
        experts = ExpertLayout.current(arch) if hf_mapping.is_expert_param(megatron_name) else NO_EXPERTS
    return hf_mapping.to_hf(megatron_name, full_tensor(megatron_name, params, tp_group, experts, arch), arch)


def export_hf_state_dict(model: torch.nn.Module, arch: ModelArchitecture, tp_group: dist.ProcessGroup | None = None,
                         experts: ExpertLayout | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every HF tensor this pipeline stage holds (all of them at PP=1), in `hf_mapping.name_map`
    order; all TP ranks of the stage (and, under EP, every rank of its expert replica) must iterate it
    together. `experts`: None reads the layout from Megatron's groups."""
    params = named_megatron_params(model)
    experts = experts if experts is not None else ExpertLayout.current(arch)
    for megatron_name, _ in stage_name_map(arch, stage_layout(model)):
        yield from export_param(megatron_name, params, arch, tp_group, experts)
