"""Multi-latent attention, YaRN and MTP fields of a `ModelArchitecture`: their rules and their HF config.json keys.

Owns: what an MLA architecture must hold (`mla_field_problem`, called by `ModelArchitecture.__post_init__`)
and its comparison with a DeepseekV3 / Glm4MoeLite config.json (`mla_mismatches`, part of
`hpc_rl.models.hf_checks.architecture_mismatches`). Shared by every family with `mla` set in the registry
(deepseek_v3, glm4_moe_lite); config's modules import it (it imports no `hpc_rl.config`):

  Megatron (MLATransformerConfig)     HF config.json
  q_lora_rank                         q_lora_rank (null: one q_proj, Moonlight)
  kv_lora_rank                        kv_lora_rank
  qk_head_dim                         qk_nope_head_dim
  qk_pos_emb_head_dim                 qk_rope_head_dim
  v_head_dim                          v_head_dim
  qk_layernorm (q/kv latent norms)    always (q_a_layernorm, kv_a_layernorm)
  rotary_scaling_factor, mscale,      rope_scaling / rope_parameters: factor, mscale, mscale_all_dim,
  mscale_all_dim, original_max_       original_max_position_embeddings, beta_fast, beta_slow (rope_type
  position_embeddings, beta_fast/slow yarn); none: plain RoPE (factor 1)
  mtp_num_layers                      num_nextn_predict_layers (at most as many as the checkpoint has)

YaRN is compared by what it computes, not key by key: Megatron's cos/sin factor is
mscale(f, mscale) / mscale(f, mscale_all_dim) and its softmax scale mscale(f, mscale_all_dim)^2 / sqrt(d)
(MLASelfAttention, YarnRotaryEmbedding); transformers uses that ratio only when both keys are non-zero and
0.1 ln f + 1 otherwise (or `attention_factor` when given), and scales the softmax only for a non-default
rope_type. Both need the rotary pairs interleaved (HF rope_interleave true: Megatron's MLA always
de-interleaves) and the correction range rounded (HF truncate true). Group-limited routing: Megatron scores
a group by its top (topk / group_topk) experts, DeepSeek-V3 (transformers and SGLang) by its top 2, so with
more than one group the two agree only when topk / group_topk == 2 (DeepSeek-V3: 8 / 4).
Pure: no torch; `arch` is a `hpc_rl.config.model.ModelArchitecture` (not imported: config imports this module).
"""

from __future__ import annotations

import math
from typing import Any

from hpc_rl.models.registry import all_families, family

MLA_SHAPE_FIELDS = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
HF_KEY_OF_FIELD = {"q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_head_dim": "qk_nope_head_dim",
                   "qk_pos_emb_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim"}
OTHER_MLA_MODEL_TYPES = ("deepseek_v2", "kimi_k2")
"""MLA model types no family reads (a config.json of theirs is still recognised as MLA)."""
GQA_ONLY_FIELDS = ("kv_channels", "num_query_groups")
"""Fields MLA does not read (Megatron's MLASelfAttention sizes its heads by num_attention_heads and the MLA
widths): a model file that inherits or states them is not checked against config.json's num_key_value_heads /
head_dim (which an MLA config.json sets to other things: head_dim is the rotary width there)."""
GROUP_SCORE_TOP = 2
"""DeepSeek-V3 scores an expert group by the sum of its best two experts' scores (transformers, SGLang)."""


def mla_family_names() -> tuple[str, ...]:
    """The registered families with multi-latent attention."""
    return tuple(f.name for f in all_families() if f.mla)


def mla_model_types() -> tuple[str, ...]:
    """config.json model types with multi-latent attention (the MLA families' and a few others')."""
    return tuple(t for f in all_families() if f.mla for t in f.hf_model_types) + OTHER_MLA_MODEL_TYPES


def fields_unused_by(arch: Any) -> tuple[str, ...]:
    """The shape fields this architecture's attention does not use (not compared with config.json)."""
    return GQA_ONLY_FIELDS if arch.multi_latent_attention else ()


def mla_field_problem(arch: Any) -> str | None:
    """Why these MLA/YaRN/MTP fields cannot be built (None: they can)."""
    mla_families = mla_family_names()
    if family(arch.family).mla and not arch.multi_latent_attention:
        return f"family {arch.family!r} uses multi-latent attention: set multi_latent_attention (--multi-latent-attention)"
    if arch.multi_latent_attention:
        if arch.family not in mla_families:
            architectures = ", ".join(a for name in mla_families for a in family(name).hf_architectures)
            return (f"multi_latent_attention with family {arch.family!r}: hpc_rl builds MLA for "
                    f"{', '.join(mla_families)} ({architectures})")
        missing = [name for name in MLA_SHAPE_FIELDS if not getattr(arch, name)]
        if missing:
            return f"multi_latent_attention needs {', '.join(missing)} (--{' --'.join(m.replace('_', '-') for m in missing)})"
        if not arch.qk_layernorm:
            return ("multi_latent_attention without qk_layernorm: DeepSeek-style checkpoints normalise the q and kv "
                    "latents (q_a_layernorm, kv_a_layernorm); add --qk-layernorm")
        if arch.qk_pos_emb_head_dim % 2:
            return f"qk_pos_emb_head_dim ({arch.qk_pos_emb_head_dim}) must be even (rotary pairs)"
    elif arch.yarn and not family(arch.family).yarn_on_gqa:  # gpt-oss: YaRN on GQA (GPTModel's yarn rotary)
        return ("rotary_scaling_factor > 1 (YaRN) on a model without multi-latent attention: hpc_rl applies YaRN "
                "inside MLA only; a GQA model with scaled RoPE would train silently wrong")
    if arch.rotary_scaling_factor < 1.0:
        return f"rotary_scaling_factor ({arch.rotary_scaling_factor}) must be >= 1 (1: plain RoPE)"
    if arch.mtp_num_layers is not None and arch.mtp_num_layers < 1:
        return f"mtp_num_layers ({arch.mtp_num_layers}) must be >= 1 (leave it out for no MTP layers)"
    if arch.mtp_num_layers and not arch.multi_latent_attention:
        return "mtp_num_layers: hpc_rl maps MTP layers for the DeepSeek-V3 and GLM-4.7-Flash families (MLA) only"
    return group_routing_problem(arch)


def group_routing_problem(arch: Any) -> str | None:
    """Megatron's group score (top topk/group_topk) must be DeepSeek-V3's (top 2) when there are groups."""
    groups, group_topk = arch.moe_router_num_groups or 1, arch.moe_router_group_topk
    if not arch.multi_latent_attention or groups <= 1 or not group_topk:
        return None
    if arch.moe_router_topk // group_topk != GROUP_SCORE_TOP:
        return (f"group-limited routing with {groups} groups: Megatron scores a group by its top "
                f"moe_router_topk / moe_router_group_topk = {arch.moe_router_topk} / {group_topk} experts, "
                f"DeepSeek-V3 checkpoints (and SGLang) by their top {GROUP_SCORE_TOP}: the routing would differ")
    return None


# ----------------------------------------------------------------------------- YaRN, as computed


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def megatron_rotary_numbers(arch: Any) -> dict[str, float]:
    """What Megatron's MLA computes from the fields: the rotary frequencies' inputs, the cos/sin factor and
    the softmax's extra factor."""
    if not arch.yarn:
        return {"factor": 1.0, "cos_sin_factor": 1.0, "softmax_factor": 1.0}
    factor = arch.rotary_scaling_factor
    return {"factor": factor, "original_max_position_embeddings": float(arch.original_max_position_embeddings),
            "beta_fast": arch.beta_fast, "beta_slow": arch.beta_slow,
            "cos_sin_factor": yarn_mscale(factor, arch.mscale) / yarn_mscale(factor, arch.mscale_all_dim),
            "softmax_factor": yarn_mscale(factor, arch.mscale_all_dim) ** 2}


def hf_rope_scaling(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's rope scaling block (transformers 5's rope_parameters or 4's rope_scaling); {} if none."""
    for key in ("rope_parameters", "rope_scaling"):
        block = hf.get(key)
        if isinstance(block, dict):
            kind = block.get("rope_type", block.get("type", "default"))
            return {**block, "rope_type": kind} if kind != "default" else {}
    return {}


def hf_rotary_numbers(hf: dict[str, Any]) -> dict[str, float]:
    """What transformers computes from config.json (modeling_rope_utils._compute_yarn_parameters and
    DeepseekV3Attention's softmax scale)."""
    scaling = hf_rope_scaling(hf)
    if not scaling:
        return {"factor": 1.0, "cos_sin_factor": 1.0, "softmax_factor": 1.0}
    original = scaling.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    factor = scaling.get("factor") or (hf["max_position_embeddings"] / original)
    if factor <= 1.0:
        return {"factor": 1.0, "cos_sin_factor": 1.0, "softmax_factor": 1.0}
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    return {"factor": float(factor), "original_max_position_embeddings": float(original),
            "beta_fast": float(scaling.get("beta_fast") or 32.0), "beta_slow": float(scaling.get("beta_slow") or 1.0),
            "cos_sin_factor": float(attention_factor),
            "softmax_factor": yarn_mscale(factor, mscale_all_dim) ** 2 if mscale_all_dim else 1.0}


def hf_yarn_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelArchitecture YaRN fields a config.json states (for flags that leave them out: Megatron has
    no flag for original_max_position_embeddings, beta_fast or beta_slow)."""
    scaling = hf_rope_scaling(hf)
    if scaling.get("rope_type") != "yarn":
        return {}
    out: dict[str, Any] = {}
    if scaling.get("original_max_position_embeddings"):
        out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    for key in ("beta_fast", "beta_slow"):
        if scaling.get(key):
            out[key] = float(scaling[key])
    return out


def _rotary_mismatches(arch: Any, hf: dict[str, Any]) -> list[str]:
    scaling = hf_rope_scaling(hf)
    problems = []
    if scaling and scaling["rope_type"] != "yarn":
        return [f"rotary_scaling_factor: config.json's rope scaling is {scaling['rope_type']!r}; hpc_rl builds "
                f"YaRN (Megatron's MLA) only"]
    if scaling and scaling.get("truncate") is False:
        problems.append("config.json's YaRN has truncate false; Megatron's MLA always rounds the correction range")
    ours, theirs = megatron_rotary_numbers(arch), hf_rotary_numbers(hf)
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if a is None or b is None or not math.isclose(a, b, rel_tol=1e-9):
            problems.append(f"YaRN {key}: the model's rotary_scaling_factor {arch.rotary_scaling_factor}, mscale "
                            f"{arch.mscale}, mscale_all_dim {arch.mscale_all_dim}, original_max_position_embeddings "
                            f"{arch.original_max_position_embeddings}, beta_fast {arch.beta_fast}, beta_slow "
                            f"{arch.beta_slow} give {a}, config.json's rope scaling {scaling or 'none'} gives {b}")
    return problems


def mla_mismatches(arch: Any, hf: dict[str, Any]) -> list[str]:
    """Every MLA, YaRN and MTP field against config.json (a GQA file against an MLA checkpoint, too)."""
    hf_is_mla = hf.get("kv_lora_rank") is not None or hf.get("model_type") in mla_model_types()
    if not arch.multi_latent_attention:
        return [f"multi_latent_attention: the model file has GQA attention, config.json ({hf.get('model_type')}) "
                f"multi-latent attention (kv_lora_rank {hf.get('kv_lora_rank')})"] if hf_is_mla else []
    if not hf_is_mla:
        return [f"multi_latent_attention: the model file has it, config.json ({hf.get('model_type')}) does not"]
    problems = [f"{field}: model file says {getattr(arch, field)!r}, config.json's {key} is {hf.get(key)!r}"
                for field, key in HF_KEY_OF_FIELD.items() if getattr(arch, field) != hf.get(key)]
    if hf.get("rope_interleave") is False:
        problems.append("config.json's rope_interleave is false; Megatron's MLA rotates interleaved pairs "
                        "(DeepSeek's layout) only")
    problems += _rotary_mismatches(arch, hf)
    theirs = int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0)
    if (arch.mtp_num_layers or 0) > theirs:
        problems.append(f"mtp_num_layers: model file says {arch.mtp_num_layers}, the checkpoint has {theirs} "
                        f"MTP layer(s) (config.json's num_nextn_predict_layers)")
    return problems
