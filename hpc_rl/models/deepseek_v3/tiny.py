"""Tiny DeepSeek-V3 / GLM-4.7-Flash (Glm4MoeLite) checkpoints: multi-latent attention, MoE, MTP layers.

Owns: `TinyMlaSpec` and the deepseek_v3 / glm4_moe_lite families' `make_tiny` hooks: transformers' own model
classes with routers decisive enough that top-k choices are not near-ties, MTP layers in DeepSeek's on-disk
layout, and the config.json keys the published checkpoints have that transformers 5 drops.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_rl.models.tiny_checkpoint import (
    TINY_VOCAB, TinyMoeSpec, build_tokenizer, save_random_moe, spec_of,
)


@dataclass(kw_only=True)
class TinyMlaSpec(TinyMoeSpec):
    """Shape of a tiny multi-latent-attention MoE model (DeepSeek-V3 family by default; GLM-4.7-Flash's
    Glm4MoeLite with family glm4_moe_lite): 2 layers (the first dense), 4 experts in 2 groups, one MTP layer."""

    family: str = "deepseek_v3"
    """deepseek_v3 (DeepseekV3ForCausalLM) | glm4_moe_lite (Glm4MoeLiteForCausalLM)."""
    num_key_value_heads: int = 4
    q_lora_rank: int | None = 32
    """None: one full q projection (Moonlight)."""
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    dense_layers: int = 1
    n_group: int = 2
    """Expert groups; top-k 2 of 1 group keeps DeepSeek's top-2 group score equal to Megatron's (topk / group_topk)."""
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    tie_word_embeddings: bool = False
    rope_theta: float = 10_000.0
    yarn: dict | None = None
    """YaRN keys of rope_parameters (factor, original_max_position_embeddings, mscale, mscale_all_dim,
    beta_fast, beta_slow); None: plain RoPE."""
    mtp_layers: int = 1
    """MTP layers written after the decoder (model.layers.<L + k>.*, DeepSeek's on-disk layout)."""


def _mtp_tensors(model, spec: TinyMlaSpec, num_layers: int) -> dict:  # noqa: ANN001 - a transformers model
    """Random MTP layers shaped like the model's last (MoE) layer, under the checkpoint's on-disk names
    (per-expert gate/up/down, enorm, hnorm, eh_proj, shared_head.norm, and DeepSeek's embedding/head copies)."""
    import torch

    generator = torch.Generator().manual_seed(spec.seed + 2)
    saved = {}
    for name, tensor in model.state_dict().items():
        prefix = f"model.layers.{num_layers - 1}."
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if rest.endswith("mlp.experts.gate_up_proj"):
            inner = tensor.shape[1] // 2
            for expert in range(tensor.shape[0]):
                saved[f"mlp.experts.{expert}.gate_proj.weight"] = tensor.new_empty(tensor[expert, :inner].shape)
                saved[f"mlp.experts.{expert}.up_proj.weight"] = tensor.new_empty(tensor[expert, inner:].shape)
        elif rest.endswith("mlp.experts.down_proj"):
            for expert in range(tensor.shape[0]):
                saved[f"mlp.experts.{expert}.down_proj.weight"] = tensor.new_empty(tensor[expert].shape)
        else:
            saved[rest] = tensor.new_empty(tensor.shape)
    hidden = spec.hidden_size
    saved.update({"enorm.weight": torch.empty(hidden), "hnorm.weight": torch.empty(hidden),
                  "eh_proj.weight": torch.empty(hidden, 2 * hidden), "shared_head.norm.weight": torch.empty(hidden)})
    out = {}
    for depth in range(spec.mtp_layers):
        for rest, template in saved.items():
            if rest.endswith("norm.weight"):
                value = 1.0 + 0.1 * torch.randn(template.shape, generator=generator)
            elif rest.endswith("mlp.gate.weight"):
                value = torch.randn(template.shape, generator=generator) * spec.router_std
            elif rest.endswith("e_score_correction_bias"):
                value = torch.randn(template.shape, generator=generator) * 0.1
            else:
                value = torch.randn(template.shape, generator=generator) * 0.02
            out[f"model.layers.{num_layers + depth}.{rest}"] = value.to(torch.float32).contiguous()
        out[f"model.layers.{num_layers + depth}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
        out[f"model.layers.{num_layers + depth}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return out


def mla_config_fields(spec: TinyMlaSpec, tokenizer: Any) -> dict[str, Any]:
    """The transformers config fields a tiny MLA MoE checkpoint's shape gives (DeepSeek-V3, GLM-4.7-Flash and
    DeepSeek-V3.2 alike), with the tiny tokenizer's special tokens, float32."""
    rope = {"rope_type": "default", "rope_theta": spec.rope_theta}
    if spec.yarn:
        rope = {"rope_type": "yarn", "rope_theta": spec.rope_theta, **spec.yarn}
    return dict(
        vocab_size=len(TINY_VOCAB), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        n_shared_experts=spec.n_shared_experts, n_routed_experts=spec.num_experts,
        routed_scaling_factor=spec.routed_scaling_factor, kv_lora_rank=spec.kv_lora_rank, q_lora_rank=spec.q_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, qk_nope_head_dim=spec.qk_nope_head_dim,
        n_group=spec.n_group, topk_group=spec.topk_group, num_experts_per_tok=spec.num_experts_per_tok,
        norm_topk_prob=True, max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings, rope_parameters=rope, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"), torch_dtype="float32")


def make_tiny_mla_model(output_dir: str | Path, spec: TinyMlaSpec | None = None) -> Path:
    """Write a randomly initialised tiny MLA MoE checkpoint (spec.family) with its MTP layers + the tiny tokenizer."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    spec = spec or TinyMlaSpec()
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    common = dict(mla_config_fields(spec, tokenizer), rope_interleave=True)
    if spec.family == "deepseek_v3":
        config = DeepseekV3Config(**common, first_k_dense_replace=spec.dense_layers, num_mtp_layers=spec.mtp_layers)
        model_class = DeepseekV3ForCausalLM
    elif spec.family == "glm4_moe_lite":
        config = Glm4MoeLiteConfig(**common, mlp_layer_types=["dense"] * spec.dense_layers
                                   + ["sparse"] * (spec.num_hidden_layers - spec.dense_layers))
        model_class = Glm4MoeLiteForCausalLM
    else:
        raise ValueError(f"TinyMlaSpec.family {spec.family!r}: use deepseek_v3 or glm4_moe_lite")
    model = save_random_moe(model_class, config, spec, tokenizer, output_dir)
    if spec.mtp_layers:
        weights_file = output_dir / "model.safetensors"
        weights = load_file(str(weights_file))
        weights.update(_mtp_tensors(model, spec, spec.num_hidden_layers))
        save_file(weights, str(weights_file), metadata={"format": "pt"})
        weights_file.chmod(0o644)
    config_file = output_dir / "config.json"
    fields = json.loads(config_file.read_text())
    fields["num_nextn_predict_layers"] = spec.mtp_layers  # GLM-4.7-Flash's key too (Glm4MoeLiteConfig has no MTP field)
    # keys of the published DeepSeek-V3 / GLM-4.7-Flash config.json that transformers 5 drops and SGLang reads
    fields.update({"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"})
    config_file.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    return output_dir




def make_tiny_deepseek_v3(output_dir: str | Path, spec: TinyMlaSpec | None = None, **spec_fields: Any) -> Path:
    """The deepseek_v3 family's `make_tiny` hook."""
    return make_tiny_mla_model(output_dir, spec_of(TinyMlaSpec, spec, {"family": "deepseek_v3", **spec_fields})
                               if spec is None else spec)


def make_tiny_glm4_moe_lite(output_dir: str | Path, spec: TinyMlaSpec | None = None, **spec_fields: Any) -> Path:
    """The glm4_moe_lite family's `make_tiny` hook."""
    return make_tiny_mla_model(output_dir, spec_of(TinyMlaSpec, spec, {"family": "glm4_moe_lite", **spec_fields})
                               if spec is None else spec)
