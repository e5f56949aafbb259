"""One LoRA adapter on one of Megatron's tensor-parallel linear layers: its parameters, its TP math, its forward.

Owns: `LoraAdapter` (the A and B matrices of each adapted HF projection of one Megatron layer, sharded over TP the
way the base weight is), the forward that adds `scaling * B(A(dropout(x)))` to the base layer's output (a forward
hook on the base layer, so the base's parameter names, loaders, converters and checkpoints stay as they are), and
`LoraAdapters`, the container beside the base layers (`self_attention.lora`, `mlp.lora`) whose torch_dist
`sharded_state_dict` shards each matrix as it is sharded in memory. Does not own which layers get adapters or their
initial values (`hpc_rl.training.lora.attach`) nor PEFT's files (`peft_files`).

TP layout (A: [r, in], B: [out, r], as PEFT's lora_A / lora_B weights):
  * column-parallel base (linear_qkv, linear_fc1: output rows split): A whole on every rank, B split on rows as the
    base's output is. Forward: x (all-gathered first under sequence parallel, its gradient split back without a
    reduction) -> h = x A^T -> `copy_to_tensor_model_parallel_region` (the backward sums dh over TP, so A's gradient
    and x's are whole and equal on every rank) -> B_r h.
  * row-parallel base (linear_proj, linear_fc2: input columns split): A split on columns as the base's input is,
    B whole. Forward: h_r = x_r A_r^T -> `reduce_from_tensor_model_parallel_region` (sum over TP) -> B h
    (scattered over the sequence under sequence parallel, as the base's output is).
Fused layers are adapted per slice, as PEFT adapts the HF model's separate projections: linear_qkv's output is laid
out per query group [q heads, k, v] (hf_mapping's layout), linear_fc1's as [gate_r; up_r]; each slice has its own B
(and, with lora_type canonical_lora, its own A; with lora_type lora one A is shared by the layer's slices).
Replicated matrices carry no TP attribute, so Megatron's gradient norm counts them once; split ones carry
`tensor_model_parallel` and their `partition_dim`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SHARED_A = "shared"
"""Key of the one A of a layer whose slices share it (lora_type lora)."""


@dataclass(frozen=True)
class SliceShape:
    """One HF projection inside a Megatron layer: its name and its rows of the layer's output on this rank."""

    name: str
    out_local: int


@dataclass(frozen=True)
class LayerGeometry:
    """How the adapted Megatron layer sits under TP and how its output is laid out on this rank."""

    kind: str
    """column | row."""
    in_local: int
    """Input features on this rank (the whole input for column-parallel)."""
    out_local: int
    """Output features on this rank (the whole output for row-parallel)."""
    slices: tuple[SliceShape, ...]
    """The layer's HF projections in the order of its output (one, named after the HF module, when not fused)."""
    query_groups_local: int = 0
    """linear_qkv: the query groups on this rank (its output is [q heads, k, v] per group)."""


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron layer: lora_A[name] [r, in_local or in] and lora_B[name] [out_slice_local, r]."""

    def __init__(self, geometry: LayerGeometry, adapted: tuple[str, ...], *, rank: int, scaling: float,
                 dropout: float, shared_a: bool, dtype: torch.dtype, device: torch.device | str,
                 tp_group: Any, tp_size: int, sequence_parallel: bool, norm: Any = None) -> None:
        super().__init__()
        self.geometry, self.adapted, self.rank, self.scaling = geometry, adapted, rank, scaling
        self.shared_a, self.tp_group, self.tp_size, self.sequence_parallel = shared_a, tp_group, tp_size, sequence_parallel
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self._norm = norm
        """A Transformer Engine layer with a fused input norm (GPU): (weight, eps, kind) to norm the adapter's
        input as the base does; None for Megatron's local layers, whose norm is a module of its own."""
        in_a = geometry.in_local
        names = (SHARED_A,) if shared_a else adapted
        self.lora_A = torch.nn.ParameterDict({name: torch.nn.Parameter(torch.zeros(rank, in_a, dtype=dtype,
                                                                                   device=device)) for name in names})
        outs = {s.name: s.out_local for s in geometry.slices}
        self.lora_B = torch.nn.ParameterDict({name: torch.nn.Parameter(torch.zeros(outs[name], rank, dtype=dtype,
                                                                                   device=device)) for name in adapted})
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        if tp_size > 1:
            split = self.lora_B.values() if geometry.kind == "column" else self.lora_A.values()
            for param in split:
                set_tensor_model_parallel_attributes(param, True, 0 if geometry.kind == "column" else 1, 1)

    def a_of(self, name: str) -> torch.nn.Parameter:
        return self.lora_A[SHARED_A if self.shared_a else name]

    def split_axes(self) -> dict[str, int]:
        """Parameter name (as in this module's state dict) -> the axis it is split on over TP."""
        if self.geometry.kind == "column":
            return {f"lora_B.{name}": 0 for name in self.lora_B}
        return {f"lora_A.{name}": 1 for name in self.lora_A}

    # ------------------------------------------------------------------ forward

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        if self._norm is None:
            return x
        weight, eps, kind = self._norm  # GPU only: TE's LayerNormColumnParallelLinear
        if kind == "RMSNorm":
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, None, eps)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """What the adapters add to the base layer's output for its input `x` (same layout as that output)."""
        from megatron.core.tensor_parallel import mappings

        tp = self.tp_size > 1
        if self.geometry.kind == "column":
            x = self._normed(x)
            if self.sequence_parallel and tp:
                x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False,
                                                                  group=self.tp_group)
            x = self.dropout(x)
            hidden: dict[str, torch.Tensor] = {}
            for name in self.adapted:
                key = SHARED_A if self.shared_a else name
                if key not in hidden:
                    h = x @ self.lora_A[key].t()
                    hidden[key] = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group) if tp else h
            parts = {name: hidden[SHARED_A if self.shared_a else name] @ self.lora_B[name].t() for name in self.adapted}
            return self._assemble(parts, x.shape[:-1], x) * self.scaling
        h = self.dropout(x) @ self.lora_A[self.adapted[0]].t()
        if tp:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        out = (h @ self.lora_B[self.adapted[0]].t()) * self.scaling
        if self.sequence_parallel and tp:
            out = mappings.scatter_to_sequence_parallel_region(out, group=self.tp_group)
        return out

    def _assemble(self, parts: dict[str, torch.Tensor], lead: torch.Size, like: torch.Tensor) -> torch.Tensor:
        """The slices' outputs in the fused layer's output layout (zeros for slices without an adapter)."""
        slices = self.geometry.slices
        if len(slices) == 1:
            return parts[slices[0].name]
        full = [parts.get(s.name, like.new_zeros(*lead, s.out_local)) for s in slices]
        if self.geometry.query_groups_local:  # linear_qkv: per query group [its q heads, k, v]
            groups = self.geometry.query_groups_local
            full = [part.reshape(*lead, groups, -1) for part in full]
            return torch.cat(full, dim=-1).reshape(*lead, -1)
        return torch.cat(full, dim=-1)  # linear_fc1: [gate_r; up_r]

    def hook(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook on the base layer: its (output, bias) with the adapters' delta added to output."""
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + self.delta(x).to(out.dtype), bias


class LoraAdapters(torch.nn.ModuleDict):
    """The adapters of one attention or MLP module, by the Megatron layer they adapt (`linear_qkv`, ...); a module
    Megatron's torch_dist checkpointing walks like its own layers."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
                           ) -> dict[str, Any]:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out: dict[str, Any] = {}
        for name, adapter in self.items():
            state = adapter.state_dict(prefix="", keep_vars=True)
            axes = adapter.split_axes() if adapter.tp_size > 1 else {}
            out.update(make_sharded_tensors_for_checkpoint(state, f"{prefix}{name}.", axes, sharded_offsets))
        return out


def adapters_of(model: torch.nn.Module) -> list[LoraAdapter]:
    """Every adapter of `model` (any wrapper around it), in module order."""
    return [adapter for module in model.modules() if isinstance(module, LoraAdapters) for adapter in module.values()]
