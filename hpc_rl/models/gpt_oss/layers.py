"""gpt-oss's Megatron TransformerConfig fields and rotary choice (the trainer's tier: imports Megatron when called).

Owns: the fields `model_provider.transformer_config` adds for an architecture with attention sinks, sliding
windows, the clamped quick-GELU GLU or YaRN on GQA attention (`transformer_config_fields`), the YaRN attributes
GPTModel's `yarn` rotary reads off the config (`yarn_config_attributes`: Megatron reads them with getattr, they are
not TransformerConfig fields), and the position embedding type (`position_embedding_type`). Every value is a
ModelArchitecture field under Megatron's name; nothing here is a second implementation of a layer.
"""

from __future__ import annotations

from typing import Any

from hpc_rl.config.model import ModelArchitecture


def transformer_config_fields(arch: ModelArchitecture) -> dict[str, Any]:
    """TransformerConfig fields for sinks, windows and the clamped GLU (empty when the architecture has none)."""
    fields: dict[str, Any] = {}
    if arch.softmax_type != "vanilla":
        fields["softmax_type"] = arch.softmax_type
    if arch.window_size:
        fields["window_size"] = tuple(arch.window_size)
        skip = arch.window_attn_skip_freq
        fields["window_attn_skip_freq"] = list(skip) if isinstance(skip, list) else skip
    if arch.quick_geglu:
        from megatron.core.activations import quick_gelu

        fields["activation_func"] = quick_gelu
    if arch.glu_linear_offset:
        fields["glu_linear_offset"] = arch.glu_linear_offset
    if arch.activation_func_clamp_value is not None:
        fields["activation_func_clamp_value"] = arch.activation_func_clamp_value
    return fields


def uses_gqa_yarn(arch: ModelArchitecture) -> bool:
    """YaRN on grouped-query attention (GPTModel's yarn rotary); MLA applies its own YaRN."""
    return arch.yarn and not arch.multi_latent_attention


def position_embedding_type(arch: ModelArchitecture) -> str:
    """GPTModel's position_embedding_type: yarn for YaRN on GQA attention, else rope."""
    return "yarn" if uses_gqa_yarn(arch) else "rope"


def yarn_config_attributes(arch: ModelArchitecture) -> dict[str, Any]:
    """The `yarn_*` attributes GPTModel's yarn rotary and the attention's cos/sin factor read from the config.
    mscale and mscale_all_dim None: the factor is 0.1 ln(f) + 1 (transformers' default attention_factor)."""
    if not uses_gqa_yarn(arch):
        return {}
    return {"yarn_rotary_scaling_factor": arch.rotary_scaling_factor,
            "yarn_original_max_position_embeddings": arch.original_max_position_embeddings,
            "yarn_beta_fast": arch.beta_fast, "yarn_beta_slow": arch.beta_slow,
            "yarn_mscale": None if arch.mscale_all_dim == 0.0 and arch.mscale == 1.0 else arch.mscale,
            "yarn_mscale_all_dim": None if arch.mscale_all_dim == 0.0 and arch.mscale == 1.0 else arch.mscale_all_dim,
            "yarn_correction_range_round_to_int": arch.yarn_correction_range_round_to_int}
