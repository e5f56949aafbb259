"""The Megatron layer spec of the hybrid families (their `layer_spec` hook): Megatron's own layers, chosen per layer.

Owns: `layer_spec` (one decoder layer: Megatron's GatedDeltaNet where `linear_attention_freq` says 1, else Megatron's
SelfAttention, with `attention_output_gate` from the config; the dense MLP or Megatron's MoE layer with its gated
shared expert per `moe_layer_freq`: the shared `gpt_layer_spec`) and the local-spec modules a CPU build needs where
Transformer Engine has its own: `NormedColumnParallelLinear` (TE's LayerNormColumnParallelLinear: the input norm
fused into GatedDeltaNet's in_proj, so the parameter names, `self_attention.in_proj.layer_norm_weight`, are TE's on
both devices, as Megatron's own GDN spec builds it). Zero-centred norms (--apply-layernorm-1p) come from the config:
TE's norms and `SequenceParallelRMSNorm` read `layernorm_zero_centered_gamma`. The GDN output norm scales by its
weight as stored (HF's gated RMSNorm), whatever the layer norms do (`PlainGammaTENorm` on GPU, `PlainGammaRMSNorm`
on CPU). Does not own the kernels (`layers_gdn`, `gdn_kernels`) or the TransformerConfig fields
(`config_rules.transformer_config_fields`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.qwen3_next.layers_gdn import PackedGatedDeltaNet
from hpc_rl.models.qwen3_next.names import is_linear_layer
from hpc_rl.training.layer_specs import SequenceParallelRMSNorm, gpt_layer_spec, parameter_device


class PlainGammaRMSNorm(SequenceParallelRMSNorm):
    """GatedDeltaNet's `out_norm` on CPU: the local RMSNorm with plain gamma (weight as stored) whatever the layer
    norms do (HF's gated RMSNorm)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        plain = copy.copy(config)
        plain.layernorm_zero_centered_gamma = False
        super().__init__(plain, hidden_size, eps=eps, **kwargs)


class PlainGammaTENorm:
    """GatedDeltaNet's `out_norm` on GPU: TE's RMSNorm with plain gamma (weight as stored) whatever the layer norms
    do. On CPU the local `SequenceParallelRMSNorm` is plain already."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> Any:
        from megatron.core.extensions.transformer_engine import TENorm

        plain = copy.copy(config)
        plain.layernorm_zero_centered_gamma = False
        return TENorm(plain, hidden_size, eps=eps)


class NormedColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear after an RMSNorm of its input (zero-centred per the config): the local twin of TE's
    LayerNormColumnParallelLinear, with its parameter name `layer_norm_weight`."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        initial = torch.zeros if self.zero_centered else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(initial(input_size, device=parameter_device(config),
                                                            dtype=config.params_dtype))
        self.layer_norm_weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        self.norm_eps = config.layernorm_epsilon

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        weight = 1 + self.layer_norm_weight if self.zero_centered else self.layer_norm_weight
        return super().forward(F.rms_norm(input_, (input_.shape[-1],), weight, self.norm_eps), *args, **kwargs)


def gated_delta_net_spec(*, use_te: bool) -> ModuleSpec:
    """Megatron's GatedDeltaNet (packed-sample aware) with its projections: TE's on GPU, the local twins on CPU."""
    if use_te:
        from megatron.core.extensions.transformer_engine import (
            TELayerNormColumnParallelLinear,
            TERowParallelLinear,
        )

        in_proj, out_norm, out_proj = TELayerNormColumnParallelLinear, PlainGammaTENorm, TERowParallelLinear
    else:
        in_proj, out_norm, out_proj = NormedColumnParallelLinear, PlainGammaRMSNorm, RowParallelLinear
    return ModuleSpec(module=PackedGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=in_proj, out_norm=out_norm, out_proj=out_proj))


def layer_spec(arch: ModelArchitecture, layer: int, *, use_te: bool, moe: bool, moe_grouped_gemm: bool) -> ModuleSpec:
    """Decoder layer `layer`'s spec (the registry's layer_spec hook)."""
    spec = gpt_layer_spec(arch, layer, use_te=use_te, moe=moe, moe_grouped_gemm=moe_grouped_gemm)
    if is_linear_layer(arch, layer):
        spec.submodules.self_attention = gated_delta_net_spec(use_te=use_te)
        spec.submodules.input_layernorm = IdentityOp
    return spec
