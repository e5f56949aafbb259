"""A `ModelArchitecture` from Megatron's model flags (slime's `MODEL_ARGS`), with Megatron's defaults.

Owns: reading `--num-layers 36 --hidden-size 2560 ... --spec slime_plugins.models.glm4 get_glm_spec`
the way Megatron does (a missing `--untie-embeddings-and-output-weights` means tied, a missing
`--disable-bias-linear` means biases, no `--group-query-attention` means one KV head per query head),
refusing what hpc_rl cannot build with the reason, and overriding a model file's fields when both are
given (as `MODEL_ARGS+=(--rotary-base 10000)` does in slime). The MoE flags (`--num-experts 128
--moe-ffn-hidden-size 768 --moe-layer-freq [0]*1+[1]*45 ...`) likewise, with Megatron's defaults
(moe_ffn_hidden_size = ffn_hidden_size, top-2, every layer MoE), and the MoE family: config.json's
model_type when it names one, else softmax + q/k norms -> qwen3_moe, sigmoid + shared expert -> glm4_moe,
multi-latent attention -> deepseek_v3. The MLA flags (`--multi-latent-attention --q-lora-rank ... --rotary-scaling-factor
--mscale --mscale-all-dim --mtp-num-layers`) likewise, with Megatron-LM's defaults (`_apply_mla_flags`).
The HF config.json check is
`hpc_rl.config.validation`'s (the same check model files get).
"""

from __future__ import annotations

from typing import Any

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.qwen3_vl.names import apply_vl_fields, is_vl_config, text_view
from hpc_rl.models.mla import hf_yarn_fields, mla_family_names
from hpc_rl.models.qwen3_next.flags import apply_hybrid_flags, hybrid_spec_family
from hpc_rl.models.registry import all_families, family, family_for_hf_model_type, family_for_slime_spec

DEFAULT_MAX_POSITION_EMBEDDINGS = 4096
MOE_FIELD_OF_FLAG = {"num_experts": "num_moe_experts", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
                     "moe_router_topk": "moe_router_topk", "moe_layer_freq": "moe_layer_freq",
                     "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
                     "moe_router_score_function": "moe_router_score_function",
                     "moe_router_topk_scaling_factor": "moe_router_topk_scaling_factor",
                     "moe_router_num_groups": "moe_router_num_groups", "moe_router_group_topk": "moe_router_group_topk",
                     "moe_router_pre_softmax": "moe_router_pre_softmax",
                     "moe_router_enable_expert_bias": "moe_router_enable_expert_bias"}
"""Megatron's MoE architecture flag -> ModelArchitecture field (one rename: --num-experts)."""
MLA_FLAG_DEFAULTS = {"q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
                     "v_head_dim": 128, "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
"""Megatron-LM's defaults of the MLA flags (megatron/training/arguments.py, _add_mla_args); the flag names are
the ModelArchitecture fields."""


def _family(flags: dict[str, Any], problems: list[str]) -> str:
    spec = flags.get("spec")
    hybrid = hybrid_spec_family(spec, moe=bool(flags.get("num_experts")))
    if hybrid is not None:  # slime's Qwen3.5 spec with --num-experts is Qwen3.5-MoE: hpc_rl.models.qwen3_next.flags
        return hybrid
    if spec is not None:
        found = family_for_slime_spec(spec)
        if found is not None:
            return found.name
        known = " and ".join(f"slime's {f.name.upper()} spec ({' '.join(f.slime_spec)})"
                             for f in all_families() if f.slime_spec is not None)
        problems.append(f"--spec {' '.join(map(str, spec))}: hpc_rl builds Megatron's GPT layer spec and {known} only")
        return "llama"
    return "qwen3" if flags.get("qk_layernorm") else "llama"


def _required_behaviour_problems(flags: dict[str, Any], from_scratch: bool) -> list[str]:
    problems = []
    normalization = flags.get("normalization")
    if normalization is not None and normalization != "RMSNorm":
        problems.append(f"--normalization {normalization}: hpc_rl builds RMSNorm models only")
    elif normalization is None and from_scratch:
        problems.append("--normalization: Megatron's default is LayerNorm, which hpc_rl does not build; add --normalization RMSNorm")
    position = flags.get("position_embedding_type")
    if position == "yarn" and not _yarn_on_gqa(flags):
        specs = [f"--spec {' '.join(f.slime_spec)}" for f in all_families() if f.yarn_on_gqa and f.slime_spec]
        problems.append("--position-embedding-type yarn: hpc_rl builds YaRN on grouped-query attention for "
                        f"{', '.join(_shown(f) for f in all_families() if f.yarn_on_gqa)} ({', '.join(specs)}) only")
    elif position is not None and position not in ("rope", "yarn"):
        problems.append(f"--position-embedding-type {position}: hpc_rl builds rotary (rope) models only")
    elif position is None and from_scratch and not flags.get("use_rotary_position_embeddings"):
        problems.append("Megatron's default position embedding is learned_absolute, which hpc_rl does not build; "
                        "add --use-rotary-position-embeddings")
    if from_scratch and not flags.get("swiglu") and not flags.get("quick_geglu"):
        problems.append("Megatron's default MLP is GeLU, which hpc_rl does not build; add --swiglu")
    if bool(flags.get("post_self_attn_layernorm")) != bool(flags.get("post_mlp_layernorm")):
        problems.append("--post-self-attn-layernorm and --post-mlp-layernorm come together (GLM4's sandwich norms); "
                        "hpc_rl does not build one without the other")
    if "num_query_groups" in flags and not flags.get("group_query_attention") and from_scratch:
        problems.append("--num-query-groups without --group-query-attention: Megatron ignores it and builds one KV head "
                        "per query head; add --group-query-attention")
    return problems


def _apply_family_flags(flags: dict[str, Any], fields: dict[str, Any], problems: list[str],
                        hf_config: dict[str, Any] | None, hf_type: str | None) -> None:
    """Each family's own model flags (the registry's `megatron_flags`: gpt-oss's) on its own line; named as a
    problem on another family's line."""
    for owner in all_families():
        if owner.megatron_flags is None:
            continue
        if fields.get("family") == owner.name or hf_type in owner.hf_model_types:
            owner.megatron_flags.apply(flags, fields, problems, hf_config)
        elif owner.megatron_flags.given(flags):
            spec = f" (--spec {' '.join(owner.slime_spec)})" if owner.slime_spec else ""
            problems.append(" ".join("--" + f.replace("_", "-") for f in owner.megatron_flags.given(flags))
                            + f": hpc_rl builds these for {_shown(owner)} only{spec}")


def _shown(owner: Any) -> str:
    """A family as a line names it: its description's name (gpt-oss), else its registry name."""
    return owner.description.split(" (")[0] if owner.description else owner.name


def _yarn_on_gqa(flags: dict[str, Any]) -> bool:
    """The line's --spec is a family's whose YaRN applies to grouped-query attention (gpt-oss)."""
    found = family_for_slime_spec(flags.get("spec"))
    return found is not None and found.yarn_on_gqa


def _scratch_fields(flags: dict[str, Any], hf_config: dict[str, Any] | None, problems: list[str]) -> dict[str, Any]:
    """Megatron's defaults for every field the flags leave out."""
    missing = [name for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
               if name not in flags]
    vocab = flags.get("vocab_size", (hf_config or {}).get("vocab_size"))
    if vocab is None:
        missing.append("vocab_size")
    if missing:
        problems.append("model flags without " + ", ".join("--" + m.replace("_", "-") for m in missing)
                        + " (slime's scripts/models/*.sh give them all)")
        return {}
    heads = flags["num_attention_heads"]
    position_limit = flags.get("max_position_embeddings", flags.get("seq_length"))
    if position_limit is None:
        position_limit = (hf_config or {}).get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS)
    return {
        "family": _family(flags, problems),
        "num_layers": flags["num_layers"],
        "hidden_size": flags["hidden_size"],
        "ffn_hidden_size": flags["ffn_hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": flags.get("num_query_groups", heads) if flags.get("group_query_attention") else heads,
        "kv_channels": flags.get("kv_channels", flags["hidden_size"] // heads),
        "vocab_size": vocab,
        "make_vocab_size_divisible_by": flags.get("make_vocab_size_divisible_by", 128),
        "rotary_base": flags.get("rotary_base", 10000.0),
        "rotary_percent": flags.get("rotary_percent", 1.0),
        "rotary_interleaved": bool(flags.get("rotary_interleaved")),
        "norm_epsilon": flags.get("norm_epsilon", 1e-5),
        "tie_word_embeddings": not flags.get("untie_embeddings_and_output_weights"),
        "qk_layernorm": bool(flags.get("qk_layernorm")),
        "add_qkv_bias": bool(flags.get("add_qkv_bias")),
        "add_bias_linear": not flags.get("disable_bias_linear"),
        "post_sublayer_norms": bool(flags.get("post_self_attn_layernorm")),
        "max_position_embeddings": position_limit,
    }


_DIRECT = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
           "vocab_size", "make_vocab_size_divisible_by", "norm_epsilon", "rotary_base", "rotary_percent",
           "max_position_embeddings")


def _overridden_fields(flags: dict[str, Any], base: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """A model file's fields with the given flags applied on top."""
    fields = dict(base)
    fields.update({name: flags[name] for name in _DIRECT if name in flags})
    if "seq_length" in flags and "max_position_embeddings" not in flags:
        fields["max_position_embeddings"] = flags["seq_length"]
    switches = {"rotary_interleaved": "rotary_interleaved", "qk_layernorm": "qk_layernorm",
                "add_qkv_bias": "add_qkv_bias", "post_self_attn_layernorm": "post_sublayer_norms"}
    fields.update({field: True for flag, field in switches.items() if flags.get(flag)})
    if flags.get("untie_embeddings_and_output_weights"):
        fields["tie_word_embeddings"] = False
    if flags.get("disable_bias_linear"):
        fields["add_bias_linear"] = False
    if "spec" in flags:
        fields["family"] = _family(flags, problems)
    return fields


def _apply_moe_flags(flags: dict[str, Any], fields: dict[str, Any], problems: list[str], hf_type: str | None) -> None:
    """The MoE flags on top of `fields`, with Megatron's defaults (moe_ffn_hidden_size: ffn_hidden_size)."""
    given = [flag for flag in MOE_FIELD_OF_FLAG if flag in flags and flags[flag] is not False]
    if not given:
        return
    if "num_experts" not in flags and not fields.get("num_moe_experts"):
        problems.append(" ".join("--" + f.replace("_", "-") for f in given) + " without --num-experts: Megatron "
                        "builds a dense model and ignores them; add --num-experts")
        return
    fields.update({MOE_FIELD_OF_FLAG[flag]: flags[flag] for flag in given})
    if fields.get("moe_ffn_hidden_size") is None:
        fields["moe_ffn_hidden_size"] = fields.get("ffn_hidden_size")
    spec_family = family_for_slime_spec(flags.get("spec"))
    hybrid = hybrid_spec_family(flags.get("spec"), moe=True)
    if hybrid is not None:
        spec_family = family(hybrid)
    if "spec" in flags and not (spec_family is not None and spec_family.moe):
        problems.append("--spec with --num-experts: GLM-4.5 MoE models are built from Megatron's own GPT layer spec "
                        "(slime's glm4.5 scripts pass no --spec); drop --spec")
    fields["family"] = _moe_family(fields, problems, hf_type, spec_family)


def _moe_family(fields: dict[str, Any], problems: list[str], hf_type: str | None, spec_family: Any = None) -> str:
    """config.json's model_type when it is an MoE family (the HF check then compares every field), else from
    the flags: qwen3_moe (softmax router, q/k norms, no shared expert), glm4_moe (sigmoid router, shared expert)."""
    hf_family = family_for_hf_model_type(hf_type)
    if hf_family is not None and hf_family.moe:
        return hf_family.name
    if spec_family is not None and spec_family.moe:  # a MoE family with its own slime --spec
        return spec_family.name
    sigmoid = fields.get("moe_router_score_function", "softmax") == "sigmoid"
    shared = bool(fields.get("moe_shared_expert_intermediate_size"))
    if fields.get("multi_latent_attention"):
        if fields.get("dsa_indexer_n_heads") is not None:
            return "deepseek_v32"
        return "deepseek_v3"  # Glm4MoeLite has the same layers and names; config.json's model_type says which
    if sigmoid and shared:
        return "glm4_moe"
    if not sigmoid and not shared and fields.get("qk_layernorm"):
        return "qwen3_moe"
    problems.append("the MoE flags describe neither Qwen3-MoE (--moe-router-score-function softmax, --qk-layernorm, no "
                    "shared expert) nor GLM-4.5 (--moe-router-score-function sigmoid with "
                    "--moe-shared-expert-intermediate-size), the MoE families hpc_rl builds")
    return "qwen3_moe"


def _apply_mla_flags(flags: dict[str, Any], fields: dict[str, Any], problems: list[str],
                     hf_config: dict[str, Any] | None) -> None:
    """The MLA / YaRN / MTP flags on top of `fields`, with Megatron-LM's defaults. What Megatron has no flag
    for (YaRN's original_max_position_embeddings, beta_fast, beta_slow) comes from config.json when given.
    Megatron's MLA layers take no q/k/v bias, so --add-qkv-bias (GLM-4.7-Flash's line) changes nothing there."""
    if "mtp_num_layers" in flags:
        fields["mtp_num_layers"] = flags["mtp_num_layers"] or None
    mla_flags = [name for name in (*MLA_FLAG_DEFAULTS, "rope_type") if name in flags
                 and not (name == "rotary_scaling_factor" and flags.get("position_embedding_type") == "yarn")]
    if not flags.get("multi_latent_attention") and not fields.get("multi_latent_attention"):
        if mla_flags:
            problems.append(" ".join("--" + f.replace("_", "-") for f in mla_flags) + " without "
                            "--multi-latent-attention: Megatron ignores them; add --multi-latent-attention")
        return
    if not fields.get("multi_latent_attention"):
        fields.update(MLA_FLAG_DEFAULTS)
        fields["multi_latent_attention"] = True
    fields.update({name: flags[name] for name in MLA_FLAG_DEFAULTS if name in flags})
    if flags.get("rope_type") not in (None, "yarn", "rope"):
        problems.append(f"--rope-type {flags['rope_type']}: Megatron's MLA takes yarn or rope")
    elif flags.get("rope_type") == "rope" and fields["rotary_scaling_factor"] != 1.0:
        problems.append(f"--rope-type rope with --rotary-scaling-factor {fields['rotary_scaling_factor']}: Megatron's "
                        f"MLA then rotates without YaRN but still scales the softmax by YaRN's mscale; drop "
                        f"--rope-type (YaRN, Megatron's MLA default) or the factor")
    if hf_config is not None and fields["rotary_scaling_factor"] > 1.0:
        fields.update(hf_yarn_fields(hf_config))
    fields["add_qkv_bias"] = False


DSA_FIELDS = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")


def _apply_dsa_flags(flags: dict[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
    """Megatron's DeepSeek Sparse Attention flags on top of `fields` (the indexer's shape; its KL loss is off)."""
    variant = flags.get("experimental_attention_variant")
    given = [name for name in (*DSA_FIELDS, "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss")
             if flags.get(name) not in (None, False)]
    if variant != "dsa":  # another variant (gated_delta_net) is the hybrid families' (models.qwen3_next.flags)
        if given:
            problems.append(" ".join("--" + f.replace("_", "-") for f in given) + " without "
                            "--experimental-attention-variant dsa: Megatron ignores them; add it")
        return
    missing = [name for name in DSA_FIELDS if flags.get(name) is None]
    if missing:
        problems.append("--experimental-attention-variant dsa needs " + " ".join(
            "--" + f.replace("_", "-") for f in missing))
        return
    if flags.get("dsa_indexer_loss_coeff") or flags.get("dsa_indexer_use_sparse_loss"):
        problems.append("--dsa-indexer-loss-coeff / --dsa-indexer-use-sparse-loss: hpc_rl trains the policy with the "
                        "indexer's KL loss off (coefficient 0; --freeze-indexer freezes it); drop them")
    fields.update({name: flags[name] for name in DSA_FIELDS})


def architecture_from_flags(
    flags: dict[str, Any],
    *,
    base: dict[str, Any] | None = None,
    hf_config: dict[str, Any] | None = None,
) -> tuple[ModelArchitecture | None, list[str]]:
    """The architecture the Megatron flags describe (on top of `base`, a model file's fields, if any).

    Returns (architecture, []) or (None, problems); each problem names the flag and what to do.
    """
    problems = _required_behaviour_problems(flags, from_scratch=base is None)
    hf_type = (hf_config or {}).get("model_type")
    vl_config = hf_config if is_vl_config(hf_config) else None  # Qwen3-VL: the flags describe its text model
    if vl_config is not None:
        hf_config = text_view(vl_config)
    fields = _scratch_fields(flags, hf_config, problems) if base is None else _overridden_fields(flags, base, problems)
    if fields:
        _apply_mla_flags(flags, fields, problems, hf_config)
        _apply_dsa_flags(flags, fields, problems)
        _apply_moe_flags(flags, fields, problems, hf_type)
        _apply_family_flags(flags, fields, problems, hf_config, hf_type)
        apply_hybrid_flags(flags, fields, problems, hf_config)
        if fields.get("multi_latent_attention") and not fields.get("num_moe_experts"):
            problems.append("--multi-latent-attention without --num-experts: hpc_rl builds MLA for the MoE families "
                            f"{', '.join(mla_family_names())} (DeepSeek-V3, Kimi-K2, Moonlight, GLM-4.7-Flash)")
    if fields and vl_config is not None and not fields.get("vision_config"):
        apply_vl_fields(fields, vl_config, problems)
    hf_family = family_for_hf_model_type(hf_type)
    if fields and hf_family is not None and hf_family.name != fields["family"]:
        hint = f" (add --spec {' '.join(hf_family.slime_spec)})" if hf_family.slime_spec is not None else ""
        problems.append(f"the flags describe a {fields['family']} model but config.json says model_type {hf_type!r}{hint}")
    if problems or not fields:
        return None, problems
    try:
        return ModelArchitecture(**fields), []
    except (TypeError, ValueError) as error:
        return None, [f"model flags: {error}"]


def architecture_from_argv(argv: list[str], *, hf_dir: str | None = None,
                           base_file: str | None = None) -> tuple[ModelArchitecture, list[str]]:
    """The architecture in a converter's command line (slime's `${MODEL_ARGS[@]}`), on top of
    `base_file` if given. Returns it and the flags that are not about the model (callers say they are
    not used). Raises ValueError listing every problem."""
    import json
    from pathlib import Path

    from hpc_rl.config.settings_sources import MEGATRON_PREFIX, cli_settings_and_problems

    settings, problems = cli_settings_and_problems(argv)
    flags = {s.path[len(MEGATRON_PREFIX):]: s.value for s in settings if s.path.startswith(MEGATRON_PREFIX)}
    other = [s.where for s in settings if not s.path.startswith(MEGATRON_PREFIX)]
    config_path = Path(hf_dir) / "config.json" if hf_dir else None
    hf_config = json.loads(config_path.read_text()) if config_path is not None and config_path.is_file() else None
    base = ModelArchitecture.from_yaml(base_file).to_dict() if base_file else None
    if not flags and base is None:
        problems.append("no architecture: give Megatron's model flags (slime's ${MODEL_ARGS[@]}) or --model FILE")
    arch = ModelArchitecture(**base) if base is not None and not flags else None
    if flags:
        arch, arch_problems = architecture_from_flags(flags, base=base, hf_config=hf_config)
        problems += arch_problems
    if problems or arch is None:
        raise ValueError("\n".join(f"  - {p}" for p in problems))
    return arch, other
