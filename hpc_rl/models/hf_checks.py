"""The shared HF `config.json` check: a decoder's shape, attention details and every mixture-of-experts key.

Owns: `architecture_mismatches` (the one check of a model file against config.json: shape fields here, MLA /
YaRN / MTP in `hpc_rl.models.mla`, then the family's own `check_config` hook) and what transformers' configs
say about partial rotary, q/k norms, attention biases and routing, in `ModelArchitecture` terms:
`num_experts`/`n_routed_experts` -> num_moe_experts, `moe_intermediate_size` -> moe_ffn_hidden_size,
`num_experts_per_tok` -> moe_router_topk, `mlp_only_layers`/`decoder_sparse_step`/`first_k_dense_replace`
-> moe_layer_freq, `n_shared_experts` x `moe_intermediate_size` -> moe_shared_expert_intermediate_size,
`norm_topk_prob` -> moe_router_pre_softmax (softmax routers), `routed_scaling_factor`, `n_group`/`topk_group`,
the scoring function and `e_score_correction_bias` (GLM-4.5 always has one). A key the file leaves out takes
the default of its model type's config class: the `hf_defaults` of the family reading that model_type
(`hpc_rl.models.registry`). Pure: no torch; `arch` is a `hpc_rl.config.model.ModelArchitecture` (not
imported: config imports this module).
"""

from __future__ import annotations

import math
from typing import Any

from hpc_rl.models.mla import fields_unused_by, mla_mismatches
from hpc_rl.models.registry import family, family_for_hf_model_type


def _defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """The config class defaults of config.json's model_type ({} for a model type no family reads)."""
    found = family_for_hf_model_type(hf.get("model_type"))
    return dict(found.hf_defaults) if found is not None else {}


def _differs(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return not math.isclose(float(ours), float(theirs), rel_tol=1e-9)
    return bool(ours != theirs)


def _partial_rotary(hf: dict[str, Any]) -> float:
    value = hf.get("partial_rotary_factor")
    if value is None and isinstance(hf.get("rope_parameters"), dict):
        value = hf["rope_parameters"].get("partial_rotary_factor")
    if value is None:
        value = _defaults(hf).get("partial_rotary_factor", 1.0)
    return float(value)


def attention_mismatches(arch: Any, hf: dict[str, Any]) -> list[str]:
    """Partial rotary, q/k norms and the q/k/v bias (Megatron adds it with add_qkv_bias or add_bias_linear)."""
    problems = []
    rotary = _partial_rotary(hf)
    if _differs(arch.rotary_percent, rotary):
        problems.append(f"rotary_percent: model file says {arch.rotary_percent!r}, config.json's "
                        f"partial_rotary_factor is {rotary!r}")
    qk_norm = hf.get("use_qk_norm", _defaults(hf).get("use_qk_norm"))
    if qk_norm is not None and arch.qk_layernorm != bool(qk_norm):
        problems.append(f"qk_layernorm: model file says {arch.qk_layernorm!r}, config.json ({hf.get('model_type')}, "
                        f"use_qk_norm) says {bool(qk_norm)!r}")
    if "attention_bias" in hf and (arch.add_qkv_bias or arch.add_bias_linear) != bool(hf["attention_bias"]):
        problems.append(f"add_qkv_bias: the model file's q/k/v projections {'have' if arch.add_qkv_bias else 'lack'} "
                        f"a bias, config.json says attention_bias {hf['attention_bias']!r}")
    return problems


def hf_dense_layers(hf: dict[str, Any], num_layers: int) -> list[int] | None:
    """Indices of the layers with a dense MLP in an HF MoE config (None: the config does not say)."""
    defaults = _defaults(hf)
    if isinstance(hf.get("mlp_layer_types"), list):  # Glm4MoeLite: "dense" | "sparse" per layer
        return [layer for layer, kind in enumerate(hf["mlp_layer_types"][:num_layers]) if kind == "dense"]
    if "first_k_dense_replace" in hf or "first_k_dense_replace" in defaults:
        first = hf.get("first_k_dense_replace", defaults.get("first_k_dense_replace", 0)) or 0
        return list(range(min(first, num_layers)))
    if "mlp_only_layers" in hf or "decoder_sparse_step" in hf or defaults.get("sparse_step_layers"):
        only = set(hf.get("mlp_only_layers") or [])
        step = hf.get("decoder_sparse_step") or 1
        return [layer for layer in range(num_layers) if layer in only or (layer + 1) % step != 0]
    return None


def _hf_num_experts(hf: dict[str, Any]) -> int | None:
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        if hf.get(key):
            return int(hf[key])
    return None


def _hf_shared_size(hf: dict[str, Any]) -> tuple[bool, int | None]:
    """(known, all shared experts' inner width fused; None: no shared expert)."""
    if hf.get("shared_expert_intermediate_size"):
        return True, int(hf["shared_expert_intermediate_size"])
    shared = hf.get("n_shared_experts", _defaults(hf).get("n_shared_experts"))
    if shared is None or not hf.get("moe_intermediate_size"):
        return False, None
    return True, (int(shared) * int(hf["moe_intermediate_size"]) if shared else None)


def _routing_mismatches(arch: Any, hf: dict[str, Any]) -> list[str]:
    model_type = hf.get("model_type", "")
    defaults = _defaults(hf)
    problems = []
    score = hf.get("scoring_func", defaults.get("scoring_func"))
    if score is not None and score != arch.moe_router_score_function:
        problems.append(f"moe_router_score_function: model file says {arch.moe_router_score_function!r}, "
                        f"config.json ({model_type}) routes with {score!r}")
    norm = hf.get("norm_topk_prob", defaults.get("norm_topk_prob"))
    if norm is not None and arch.moe_router_score_function == "softmax" and arch.moe_router_pre_softmax == bool(norm):
        problems.append(f"moe_router_pre_softmax: model file says {arch.moe_router_pre_softmax!r}, but config.json's "
                        f"norm_topk_prob {bool(norm)!r} needs {not norm!r} (true: softmax over all experts, no "
                        f"renormalising; false: softmax over the chosen top-k)")
    if norm is not None and arch.moe_router_score_function == "sigmoid" and arch.moe_router_topk > 1 and not norm:
        problems.append("moe_router_score_function: config.json's norm_topk_prob false with a sigmoid router: "
                        "Megatron always renormalises the chosen sigmoid scores (top-k > 1), so this checkpoint's "
                        "routing cannot be built")
    bias = defaults.get("e_score_correction_bias", True if hf.get("topk_method") == "noaux_tc" else None)
    if bias is not None and bias != arch.moe_router_enable_expert_bias:
        problems.append(f"moe_router_enable_expert_bias: model file says {arch.moe_router_enable_expert_bias!r}, "
                        f"config.json ({model_type}) {'has' if bias else 'has no'} e_score_correction_bias")
    scaling = hf.get("routed_scaling_factor")
    if scaling is not None and _differs(arch.moe_router_topk_scaling_factor or 1.0, scaling):
        problems.append(f"moe_router_topk_scaling_factor: model file says {arch.moe_router_topk_scaling_factor!r}, "
                        f"config.json's routed_scaling_factor is {scaling!r}")
    groups = hf.get("n_group") or 1
    hf_grouping = (groups, hf.get("topk_group")) if groups > 1 else None
    ours = ((arch.moe_router_num_groups, arch.moe_router_group_topk)  # one group (Moonlight's flags): no grouping
            if arch.moe_router_group_topk and (arch.moe_router_num_groups or 1) > 1 else None)
    if hf_grouping != ours:
        problems.append(f"moe_router_num_groups/moe_router_group_topk: model file says {ours}, config.json's "
                        f"n_group/topk_group say {hf_grouping}")
    return problems


def moe_mismatches(arch: Any, hf: dict[str, Any]) -> list[str]:
    """Every MoE field against config.json, as readable lines (a dense file against an MoE checkpoint, too)."""
    experts = _hf_num_experts(hf)
    model_type = hf.get("model_type")
    if not arch.is_moe:
        return [f"num_moe_experts: the model file is dense, config.json ({model_type}) has {experts} experts"] \
            if experts else []
    if experts is None:
        return [f"num_moe_experts: model file says {arch.num_moe_experts}, config.json ({model_type}) has no experts"]
    problems = [f"{name}: model file says {ours!r}, config.json's {key} is {theirs!r}"
                for name, ours, key, theirs in (
                    ("num_moe_experts", arch.num_moe_experts, "num_experts/n_routed_experts", experts),
                    ("moe_ffn_hidden_size", arch.moe_ffn_hidden_size, "moe_intermediate_size",
                     hf.get("moe_intermediate_size")),
                    ("moe_router_topk", arch.moe_router_topk, "num_experts_per_tok", hf.get("num_experts_per_tok")))
                if theirs is not None and ours != theirs]
    known, shared = _hf_shared_size(hf)
    if known and shared != arch.moe_shared_expert_intermediate_size:
        problems.append(f"moe_shared_expert_intermediate_size: model file says "
                        f"{arch.moe_shared_expert_intermediate_size!r}, config.json says {shared!r} "
                        f"(n_shared_experts x moe_intermediate_size)")
    dense = hf_dense_layers(hf, arch.num_layers)
    ours_dense = [layer for layer, moe in enumerate(arch.moe_layers()) if not moe]
    if dense is not None and dense != ours_dense:
        problems.append(f"moe_layer_freq: the model file's dense-MLP layers are {ours_dense}, config.json's "
                        f"(first_k_dense_replace / mlp_only_layers / decoder_sparse_step) are {dense}")
    return problems + _routing_mismatches(arch, hf)


def _hf_value(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    return default


def _hf_rope_theta(config: dict[str, Any]) -> float | None:
    theta = _hf_value(config, "rope_theta")
    if theta is None and isinstance(config.get("rope_parameters"), dict):
        theta = config["rope_parameters"].get("rope_theta")
    return theta


def shape_mismatches(arch: Any, hf_config: dict[str, Any]) -> list[str]:
    """A decoder's shape fields against config.json (MLA reads neither GQA field: `mla.fields_unused_by`)."""
    heads = _hf_value(hf_config, "num_attention_heads")
    hidden = _hf_value(hf_config, "hidden_size")
    head_dim = _hf_value(hf_config, "head_dim", default=(hidden // heads if hidden and heads else None))
    expected: dict[str, Any] = {
        "num_layers": _hf_value(hf_config, "num_hidden_layers", "num_layers"),
        "hidden_size": hidden,
        "ffn_hidden_size": _hf_value(hf_config, "intermediate_size", "ffn_hidden_size"),
        "num_attention_heads": heads,
        "num_query_groups": _hf_value(hf_config, "num_key_value_heads", "multi_query_group_num", default=heads),
        "kv_channels": head_dim,
        "rotary_base": _hf_rope_theta(hf_config),
        "norm_epsilon": _hf_value(hf_config, "rms_norm_eps", "layernorm_epsilon"),
        "vocab_size": _hf_value(hf_config, "vocab_size", "padded_vocab_size"),
        "tie_word_embeddings": _hf_value(hf_config, "tie_word_embeddings", default=False),
    }
    for unused in fields_unused_by(arch):
        del expected[unused]
    problems = []
    for name, hf_value in expected.items():
        if hf_value is None:
            continue
        ours = getattr(arch, name)
        same = math.isclose(float(ours), float(hf_value), rel_tol=1e-9) if isinstance(ours, float) else ours == hf_value
        if not same:
            problems.append(f"{name}: model file says {ours!r}, config.json says {hf_value!r}")
    return problems


def architecture_mismatches(arch: Any, hf_config: dict[str, Any]) -> list[str]:
    """Fields where the architecture file disagrees with an HF config.json, as readable lines: the shape, the
    attention details and mixture-of-experts keys (here), MLA / YaRN / MTP (`hpc_rl.models.mla`), then the
    family's own rules (its `check_config` hook)."""
    attention = [] if arch.multi_latent_attention else attention_mismatches(arch, hf_config)
    return (shape_mismatches(arch, hf_config) + attention + mla_mismatches(arch, hf_config)
            + moe_mismatches(arch, hf_config) + list(family(arch.family).check_config(arch, hf_config)))
