"""Multi-latent attention layers from Megatron-core's own MLA spec (DeepSeek-V3, Kimi-K2, Moonlight, GLM-4.7-Flash).

The trainer's side of the deepseek_v3 / glm4_moe_lite families (their `layer_spec` hook, loaded by import path;
tier 2 in tests/unit/test_layers.py, so it may import `hpc_rl.training`).
Owns: the decoder layer spec of an MLA architecture: Megatron's `MLASelfAttention` inside its GPT layer
(`get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)` on GPU,
`get_gpt_layer_local_spec(multi_latent_attention=True)` on CPU) with Megatron's MoE or dense MLP, and the CPU
twins that make the local spec run as the TE one does:

* `DuplicatedLinear`: the q/kv down projections replicated on every TP rank, as Transformer Engine's
  `TELinear(parallel_mode="duplicated")` builds them on GPU (Megatron's local spec would TP-split them as
  ColumnParallelLinear and gather the latent; the math is the same, but the TE layout is the checkpoint's).
  Under sequence parallelism its weight is flagged `sequence_parallel`, so its per-rank partial gradient is
  summed over TP by `finalize_model_grads`, as TE's duplicated weights are.
* `MLACoreAttention`: Megatron's local core attention with MLA's key width (qk_head_dim + qk_pos_emb_head_dim)
  differing from its value width (v_head_dim), which Megatron's local `DotProductAttention` does not accept
  (it takes no k_channels / v_channels), plus packed rows (THD) and CP through `PackedSequenceAttention`.
* the q latent norm's gradient under TP without sequence parallel: Megatron's `finalize_model_grads` sums the
  grads of every parameter named `q_layernorm` over TP (right for GQA's per-head q norm, whose TP ranks hold
  different heads); MLA's q latent is whole on every TP rank, so each holds the full gradient already and
  the sum would multiply it by TP. The twin marks it `average_gradients_across_tp_domain` (averaging equal
  gradients changes nothing). On GPU the TE spec fuses that norm into `linear_q_up_proj` under another name.

Checkpoint keys: the local layer's norms are saved under TE's names (`self_attention.linear_q_up_proj.
layer_norm_weight`, `..._kv_up_proj.layer_norm_weight`, a dense layer's `mlp.linear_fc1.layer_norm_weight`),
so torch_dist checkpoints move between CPU and GPU. YaRN rotary is Megatron's own (`MLATransformerConfig`:
rope_type yarn when rotary_scaling_factor > 1). Does not own the TransformerConfig (`model_provider`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.training.layer_specs import (
    PackedSequenceAttention, SequenceParallelRMSNorm, parameter_device, replace_norms,
)

MLA_LOCAL_TO_TE_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}
"""The local MLA layer's checkpoint keys under the TE spec's names (norms fused into the up projections)."""


class DuplicatedLinear(torch.nn.Module):
    """y = x W^T on every TP rank with the whole W (the CPU twin of TE's duplicated linear); returns
    (output, None) as Megatron's linears do."""

    def __init__(self, input_size: int, output_size: int, config: TransformerConfig) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype,
                                                   device=parameter_device(config)))
        config.init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(hidden, self.weight), None


class MLACoreAttention(PackedSequenceAttention):
    """Megatron's local core attention for MLA: keys of k_channels, values and output of v_channels per head."""

    def __init__(self, config: TransformerConfig, *args: Any, k_channels: int | None = None,
                 v_channels: int | None = None, **kwargs: Any) -> None:
        config = copy.copy(config)
        if v_channels is not None:  # the output width [s, b, heads * v_channels / TP]
            config.kv_channels = v_channels
        config.num_query_groups = config.num_attention_heads  # MLA expands one key/value per head
        super().__init__(config, *args, **kwargs)


class CpuMLASelfAttention(MLASelfAttention):
    """Megatron's MLASelfAttention with TE's layout of the down projections (see the module docstring)."""

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if config.q_lora_rank is not None:
            self.linear_q_down_proj = DuplicatedLinear(config.hidden_size, config.q_lora_rank, config)
            if not config.sequence_parallel:
                self.q_layernorm.weight.average_gradients_across_tp_domain = True
        self.linear_kv_down_proj = DuplicatedLinear(config.hidden_size,
                                                    config.kv_lora_rank + config.qk_pos_emb_head_dim, config)


def mla_layer_spec(arch: ModelArchitecture, *, use_te: bool, num_experts: int | None,
                   moe_grouped_gemm: bool) -> ModuleSpec:
    """One MLA decoder layer: a dense MLP (`num_experts` None) or Megatron's MoE layer."""
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                                          qk_layernorm=True, multi_latent_attention=True)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    layer = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                     multi_latent_attention=True, normalization="RMSNorm")
    replace_norms(layer, SequenceParallelRMSNorm)
    attention = layer.submodules.self_attention
    attention.module = CpuMLASelfAttention
    attention.submodules.core_attention = MLACoreAttention
    for field in ("q_layernorm", "kv_layernorm"):
        setattr(attention.submodules, field, SequenceParallelRMSNorm)
    keys = dict(MLA_LOCAL_TO_TE_KEYS)
    if num_experts is None:  # TE fuses a dense layer's pre-MLP norm into linear_fc1 (a MoE layer keeps its own)
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    layer.submodules.sharded_state_dict_keys_map = keys
    return layer


def layer_spec(arch: ModelArchitecture, layer: int, *, use_te: bool, moe: bool, moe_grouped_gemm: bool) -> ModuleSpec:
    """The family hook: decoder layer `layer`'s MLA spec (`moe`: Megatron's MoE layer, else a dense MLP)."""
    return mla_layer_spec(arch, use_te=use_te, num_experts=arch.num_moe_experts if moe else None,
                          moe_grouped_gemm=moe_grouped_gemm)
