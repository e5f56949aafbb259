"""The Megatron layer specs of the hybrid families: Megatron's own layers, chosen per layer.

Owns: `layer_spec` (one decoder layer: Megatron's GatedDeltaNet where `linear_attention_freq` says 1, Megatron's
SelfAttention with `attention_output_gate` elsewhere, the dense MLP or Megatron's MoE layer with its gated shared
expert per `moe_layer_freq`), `block_spec` (all of a stage's layers and the final norm), and the two local-spec
modules a CPU build needs where Transformer Engine has its own: `ZeroCenteredRMSNorm` (TE's RMSNorm with
`zero_centered_gamma`: scales by 1 + weight, Megatron's --apply-layernorm-1p) and `NormedColumnParallelLinear` (TE's
LayerNormColumnParallelLinear: the input norm fused into GatedDeltaNet's in_proj, so the parameter names,
`self_attention.in_proj.layer_norm_weight`, are TE's on both devices, as Megatron's own GDN spec builds it).
The GDN output norm scales by its weight as stored (HF's gated RMSNorm), whatever the layer norms do
(`PlainGammaTENorm` on GPU, the local plain norm on CPU).
Does not own the kernels (`layers_gdn`, `gdn_kernels`) or the TransformerConfig (`config_fields`).
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
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.qwen3_next.layers_gdn import PackedGatedDeltaNet
from hpc_rl.models.qwen3_next.names import is_linear_layer
from hpc_rl.training import layer_specs
from hpc_rl.training.layer_specs import SequenceParallelRMSNorm, parameter_device


class ZeroCenteredRMSNorm(SequenceParallelRMSNorm):
    """The local RMSNorm scaling by 1 + weight when the config says `layernorm_zero_centered_gamma` (the weight
    starts at 0), as TE's RMSNorm with zero_centered_gamma and HF's Qwen3NextRMSNorm; else the plain one."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(config, hidden_size, eps=eps, **kwargs)
        self.zero_centered = bool(config.layernorm_zero_centered_gamma)
        if self.zero_centered:
            torch.nn.init.zeros_(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.zero_centered:
            return super().forward(hidden_states)
        return F.rms_norm(hidden_states, self.normalized_shape, 1 + self.weight, self.eps)


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
        in_proj, out_norm, out_proj = NormedColumnParallelLinear, SequenceParallelRMSNorm, RowParallelLinear
    return ModuleSpec(module=PackedGatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=in_proj, out_norm=out_norm, out_proj=out_proj))


def layer_spec(arch: ModelArchitecture, layer: int, *, use_te: bool, moe: bool, moe_grouped_gemm: bool) -> ModuleSpec:
    """Decoder layer `layer`'s spec (the registry's layer_spec hook)."""
    spec = layer_specs._layer_spec(arch, use_te=use_te, num_experts=arch.num_moe_experts if moe else None,
                                   moe_grouped_gemm=moe_grouped_gemm)
    spec = copy.deepcopy(spec)
    if not use_te:
        layer_specs.replace_norms(spec, ZeroCenteredRMSNorm)
    if is_linear_layer(arch, layer):
        spec.submodules.self_attention = gated_delta_net_spec(use_te=use_te)
        spec.submodules.input_layernorm = IdentityOp
    return spec


def block_spec(arch: ModelArchitecture, *, use_te: bool = False, num_layers: int | None = None,
               layer_offset: int = 0, moe_grouped_gemm: bool = False) -> TransformerBlockSubmodules:
    """This stage's layers (`num_layers` from global layer `layer_offset`) and the final norm."""
    count = arch.num_layers if num_layers is None else num_layers
    moe_layers = arch.moe_layers()
    specs = [layer_spec(arch, layer, use_te=use_te, moe=moe_layers[layer], moe_grouped_gemm=moe_grouped_gemm)
             for layer in range(layer_offset, layer_offset + count)]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm: type = TENorm
    else:
        final_norm = ZeroCenteredRMSNorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)


def config_fields(arch: ModelArchitecture, *, context_parallel_size: int = 1) -> dict[str, Any]:
    """TransformerConfig's hybrid fields for `arch` (empty for other architectures). Context parallelism over a
    linear-attention layer is refused: its state runs along the whole sequence, and a CP rank holds chunks of it
    (Megatron 0.16.1 asserts CP 1 for GatedDeltaNet: no CP exchange of the recurrent state is built)."""
    fields: dict[str, Any] = {}
    if arch.layernorm_zero_centered_gamma:
        fields["layernorm_zero_centered_gamma"] = True
    if arch.attention_output_gate:
        fields["attention_output_gate"] = True
    if arch.moe_shared_expert_gate:
        fields["moe_shared_expert_gate"] = True
    if arch.linear_attention_freq is None:
        return fields
    if context_parallel_size > 1:
        raise ValueError(f"training.context_parallel_size={context_parallel_size} with Gated DeltaNet linear-attention "
                         f"layers ({arch.family}): a linear-attention layer carries its state along the whole "
                         f"sequence, and context parallelism splits the sequence over ranks; no CP exchange of that "
                         f"state is built (megatron-core 0.16.1 refuses it too). Use context_parallel_size 1")
    fields.update(experimental_attention_variant="gated_delta_net", linear_attention_freq=list(arch.linear_attention_freq),
                  linear_conv_kernel_dim=arch.linear_conv_kernel_dim, linear_key_head_dim=arch.linear_key_head_dim,
                  linear_value_head_dim=arch.linear_value_head_dim, linear_num_key_heads=arch.linear_num_key_heads,
                  linear_num_value_heads=arch.linear_num_value_heads)
    return fields
