"""Test helpers over `hpc_rl.weights`: whole state dicts converted HF <-> Megatron, local-spec names, even
pipeline splits. Production converts tensor by tensor (`hf_mapping.to_megatron`/`to_hf` over `name_map`,
per stage); these whole-model forms exist for the round-trip tests only (moved here from hf_mapping and
stage, issue 30)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.weights import hf_mapping
from hpc_rl.models.deepseek_v3.hf_names import MTP_LAYER
from hpc_rl.weights.stage import StageLayout

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def local_spec_name(name: str) -> str:
    """The inverse of `hf_mapping.canonical_name` for models built with Megatron's local spec."""
    for local, canonical in hf_mapping._LOCAL_TO_CANONICAL.items():
        if name.endswith(canonical):
            return name[: -len(canonical)] + local
    return name


def hf_to_megatron_state(hf_state: Mapping[str, torch.Tensor], arch: ModelArchitecture,
                         *, padded_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """Every full Megatron tensor (canonical names) from an HF state dict; missing names raise."""
    out: dict[str, torch.Tensor] = {}
    for megatron_name, hf_names in hf_mapping.name_map(arch):
        missing = [n for n in hf_names if n not in hf_state]
        if missing:
            raise KeyError(f"HF checkpoint lacks {', '.join(missing)} (needed for {megatron_name})")
        out[megatron_name] = hf_mapping.to_megatron(megatron_name, [hf_state[n] for n in hf_names], arch,
                                                    padded_vocab=padded_vocab)
    return out


def megatron_to_hf_state(megatron_state: Mapping[str, torch.Tensor], arch: ModelArchitecture) -> dict[str, torch.Tensor]:
    """An HF state dict from full Megatron tensors (canonical or local-spec names)."""
    canonical_name = hf_mapping.canonical_name
    moe = arch.moe_layers()
    by_canonical = {}
    for key, value in megatron_state.items():
        match = _LAYER.match(canonical_name(key))
        in_moe = (bool(match) and moe[int(match.group(1))]) or (bool(MTP_LAYER.match(canonical_name(key))) and moe[-1])
        by_canonical[canonical_name(key, moe_layer=in_moe)] = value
    out: dict[str, torch.Tensor] = {}
    for megatron_name, _ in hf_mapping.name_map(arch):
        if megatron_name not in by_canonical:
            raise KeyError(f"Megatron state lacks {megatron_name}")
        out.update(hf_mapping.to_hf(megatron_name, by_canonical[megatron_name], arch))
    return out


def even_stage_layout(num_layers: int, pp_size: int, pp_rank: int) -> StageLayout:
    """Megatron's default split: `num_layers / pp_size` consecutive layers per stage."""
    if num_layers % pp_size:
        raise ValueError(f"pipeline_model_parallel_size={pp_size} does not divide num_layers={num_layers}")
    per_stage = num_layers // pp_size
    return StageLayout(layer_offset=pp_rank * per_stage, num_layers=per_stage, first=pp_rank == 0,
                       last=pp_rank == pp_size - 1)
