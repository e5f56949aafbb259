"""Which part of the global model a pipeline stage holds, under global parameter names.

Owns: `StageLayout` (first global layer, layer count, whether the stage holds the embedding and
the output side), reading it off a built Megatron model (Megatron numbers a stage's layers
globally in `layer_number` while its module names count from 0), renaming a stage's parameters to
global canonical names (`decoder.layers.<local>.` -> `decoder.layers.<offset + local>.`), and the
slice of `hf_mapping.name_map` a stage holds. With PP=1 the layout is the whole model and every
layer index is unchanged. Under expert parallelism a rank's local experts are renamed to their global
expert index the same way (`local_experts.K` -> `local_experts.<first local + K>`, also from TE's
grouped `linear_fc1.weightK`). Pure, except `stage_layout`, which only reads attributes (no Megatron import).

Tied embeddings under PP: the last stage's `output_layer.weight` is a copy of the first stage's
embedding (Megatron keeps them equal). It is loaded from the HF embedding (`with_tied_output`) but
never exported: the engines get the embedding once, from the first stage. MTP layers sit on the last
stage with their own copy of the embedding under PP (Megatron keeps it equal to the first stage's through
the embedding group): loaded likewise, never exported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.weights import hf_mapping

_LOCAL_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"


@dataclass(frozen=True)
class StageLayout:
    """The global layers [layer_offset, layer_offset + num_layers) and the ends a stage holds."""

    layer_offset: int
    num_layers: int
    first: bool
    """Holds the embedding."""
    last: bool
    """Holds the final norm and the output layer."""

    @classmethod
    def whole(cls, num_layers: int) -> StageLayout:
        return cls(layer_offset=0, num_layers=num_layers, first=True, last=True)

    def holds_layer(self, layer: int) -> bool:
        return self.layer_offset <= layer < self.layer_offset + self.num_layers


def _unwrap(model: torch.nn.Module) -> Any:
    inner: Any = model
    while hasattr(inner, "module"):
        inner = inner.module
    return inner


def stage_layout(model: torch.nn.Module) -> StageLayout:
    """The layout of a built (possibly DDP-wrapped) Megatron GPTModel stage."""
    inner = _unwrap(model)
    layers = list(inner.decoder.layers)
    offset = int(layers[0].layer_number) - 1 if layers else 0
    return StageLayout(layer_offset=offset, num_layers=len(layers), first=bool(inner.pre_process),
                       last=bool(inner.post_process))


def global_name(local_name: str, layer_offset: int) -> str:
    """A stage's parameter name with its layer index made global (other names unchanged)."""
    match = _LOCAL_LAYER.match(local_name)
    if not match or layer_offset == 0:
        return local_name
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}"


_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
"""Transformer Engine's grouped-GEMM experts (TEGroupedMLP): local expert K's weight is `weightK`."""


def _moe_layers(model: torch.nn.Module) -> dict[str, list[int]]:
    """Local module prefix of each MoE MLP (`decoder.layers.N.mlp.`) -> its experts' global indices."""
    out = {}
    for prefix, module in model.named_modules():
        indices = getattr(module, "local_expert_indices", None)
        if indices is not None and hasattr(module, "router"):
            out[hf_mapping.canonical_name(prefix) + "."] = [int(i) for i in indices]
    return out


def _expert_global_name(name: str, moe: dict[str, list[int]]) -> str:
    """A local expert's parameter under its global expert index (SequentialMLP's naming)."""
    for prefix, indices in moe.items():
        if not name.startswith(prefix + "experts."):
            continue
        grouped = _GROUPED_EXPERT.match(name)
        if grouped is not None:
            head, linear, kind, local = grouped.groups()
            return f"{head}local_experts.{indices[int(local)]}.{linear}.{kind}"
        if name.startswith(prefix + "experts.local_experts."):
            tail = name[len(prefix + "experts.local_experts."):]
            local, rest = tail.split(".", 1)
            return f"{prefix}experts.local_experts.{indices[int(local)]}.{rest}"
    return name


def global_named_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's parameters under global canonical names (DDP/`module.` prefixes stripped; routed
    experts under their global expert index), plus the routers' `expert_bias` buffers (Megatron updates
    them itself; they are weights for the engines and checkpoints)."""
    named: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    moe = _moe_layers(model)
    if moe:
        named += [(name, buffer) for name, buffer in model.named_buffers()
                  if name.endswith(hf_mapping.EXPERT_BIAS_SUFFIX)]
    renamed = []
    for name, tensor in named:
        stripped = hf_mapping.canonical_name(name, moe_layer=True)  # prefixes only, for the MoE lookup
        in_moe_layer = any(stripped.startswith(prefix.removesuffix("mlp.")) for prefix in moe)
        renamed.append((_expert_global_name(hf_mapping.canonical_name(name, moe_layer=in_moe_layer), moe), tensor))
    if not any(_LOCAL_LAYER.match(name) for name, _ in renamed):
        return dict(renamed)
    offset = stage_layout(model).layer_offset
    return {global_name(name, offset): tensor for name, tensor in renamed}


def stage_name_map(arch: ModelArchitecture, layout: StageLayout, *,
                   with_tied_output: bool = False) -> list[tuple[str, list[str]]]:
    """The `hf_mapping.name_map` rows this stage holds, in export order.

    `with_tied_output`: also the last stage's copy of a tied embedding (for loading; PP > 1 only,
    since with one stage Megatron uses the embedding itself as the output layer).
    """
    rows = []
    for name, hf_names in hf_mapping.name_map(arch):
        match = _LOCAL_LAYER.match(name)
        if match:
            keep = layout.holds_layer(int(match.group(1)))
        elif name == EMBEDDING:
            keep = layout.first
        else:  # final norm, untied output layer, MTP layers
            keep = layout.last
        if keep:
            rows.append((name, hf_names))
    if with_tied_output and arch.tie_word_embeddings and layout.last and not layout.first:
        rows.append((OUTPUT_LAYER, hf_mapping.hf_names_of(EMBEDDING, arch)))
    if with_tied_output and arch.mtp_num_layers and layout.last and not layout.first:
        rows.append((EMBEDDING, hf_mapping.hf_names_of(EMBEDDING, arch)))  # the MTP layers' embedding copy
    return rows
