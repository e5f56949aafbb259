"""gpt-oss's architecture rules and its config.json check, in `ModelArchitecture` terms. Pure: no torch.

Owns: what a gpt-oss architecture must hold (`field_problem`: the family's `architecture_problem` hook) and its
comparison with a GptOssConfig config.json (`gpt_oss_mismatches`: the `check_config` hook, added to the shape,
attention and MoE checks every family gets), and the fields a config.json states (`architecture_fields_from_hf`):

  ModelArchitecture (Megatron's names)     config.json (transformers' GptOssConfig)
  softmax_type learnable                   always (self_attn.sinks)
  window_size [W - 1, 0]                   sliding_window W (a query sees itself and the W - 1 keys before it;
                                           Megatron's window (l, r) sees i-l..i+r, so slime's `--window-size 128,0`
                                           is 129 keys where transformers and SGLang see 128)
  window_attn_skip_freq (int or list)      layer_types: sliding_attention / full_attention per layer
  quick_geglu, glu_linear_offset 1.0       the experts' (up + 1) * gate * sigmoid(1.702 gate) (swiglu_alpha 1.702)
  activation_func_clamp_value              swiglu_limit (gate clamped above, up on both sides)
  add_bias_linear                          attention_bias, and always the router's and experts' biases
  moe_ffn_hidden_size                      intermediate_size (every layer is MoE)
  moe_router_score_function softmax,       router: top-k of the logits, softmax over the chosen
  moe_router_pre_softmax false
  rotary_scaling_factor, beta_fast/slow,   rope_parameters (rope_type yarn): factor, beta_fast, beta_slow,
  original_max_position_embeddings,        original_max_position_embeddings, truncate
  yarn_correction_range_round_to_int
"""

from __future__ import annotations

import math
from typing import Any

from hpc_rl.models.mla import hf_rope_scaling, hf_rotary_numbers, megatron_rotary_numbers

ModelArchitecture = Any
"""`arch` is a `hpc_rl.config.model.ModelArchitecture` (not imported: config imports the registry's modules)."""

QUICK_GELU_ALPHA = 1.702
"""Megatron's quick GELU is x * sigmoid(1.702 x): gpt-oss's swiglu_alpha must be this."""
SOFTMAX_TYPES = ("vanilla", "learnable")


def window_layers(arch: ModelArchitecture) -> list[bool]:
    """Per layer: True where Megatron builds a sliding-window attention (its is_layer_window_attention rule)."""
    if not arch.window_size:
        return [False] * arch.num_layers
    skip = arch.window_attn_skip_freq
    if skip is None:
        return [True] * arch.num_layers
    if isinstance(skip, int):
        return [(layer + 1) % skip != 0 for layer in range(arch.num_layers)]
    return [bool(flag) for flag in skip]


def field_problem(arch: ModelArchitecture) -> str | None:
    """Why these gpt-oss fields cannot be built (None: they can)."""
    if arch.softmax_type not in SOFTMAX_TYPES:
        return f"softmax_type: {arch.softmax_type!r} is not one of {', '.join(SOFTMAX_TYPES)}"
    if arch.window_size is not None:
        if len(arch.window_size) != 2 or min(arch.window_size) < 0:
            return f"window_size: {arch.window_size!r} is not Megatron's [left, right] (two non-negative ints)"
        if arch.window_size[1] != 0:
            return f"window_size: {arch.window_size!r} looks ahead ({arch.window_size[1]} keys); a causal model has 0"
    skip = arch.window_attn_skip_freq
    if isinstance(skip, list) and len(skip) != arch.num_layers:
        return f"window_attn_skip_freq: {len(skip)} entries for {arch.num_layers} layers"
    if isinstance(skip, int) and skip < 1:
        return f"window_attn_skip_freq: {skip} must be >= 1"
    if arch.glu_linear_offset and not arch.quick_geglu:
        return "glu_linear_offset without quick_geglu: Megatron applies the offset with quick GELU only (--quick-geglu)"
    if any(not moe for moe in arch.moe_layers()):
        return "moe_layer_freq: every gpt-oss layer is a MoE layer"
    return None


def _hf_window_layers(hf: dict[str, Any]) -> list[bool] | None:
    layers = int(hf.get("num_hidden_layers", 0))
    kinds = hf.get("layer_types")
    if kinds is None:  # GptOssConfig's default: even layers sliding, odd full
        kinds = ["sliding_attention" if (layer + 1) % 2 else "full_attention" for layer in range(layers)]
    if not hf.get("sliding_window"):
        return [False] * len(kinds)
    return [kind == "sliding_attention" for kind in kinds]


def _differs(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return not math.isclose(float(ours), float(theirs), rel_tol=1e-9)
    return bool(ours != theirs)


def _window_mismatches(arch: ModelArchitecture, hf: dict[str, Any]) -> list[str]:
    problems = []
    window = hf.get("sliding_window", 128)
    if window and arch.window_size != [int(window) - 1, 0]:
        problems.append(f"window_size: model file says {arch.window_size!r}, config.json's sliding_window {window} is "
                        f"[{int(window) - 1}, 0] in Megatron's terms (a query sees itself and {int(window) - 1} keys "
                        f"before it; --window-size {int(window) - 1},0)")
    theirs = _hf_window_layers(hf)
    ours = window_layers(arch)
    if theirs is not None and arch.window_size and ours != theirs[: len(ours)]:
        problems.append(f"window_attn_skip_freq: the model file's windowed layers are "
                        f"{[i for i, w in enumerate(ours) if w]}, config.json's layer_types say "
                        f"{[i for i, w in enumerate(theirs) if w]}")
    return problems


def _yarn_mismatches(arch: ModelArchitecture, hf: dict[str, Any]) -> list[str]:
    scaling = hf_rope_scaling(hf)
    if scaling and scaling["rope_type"] != "yarn":
        return [f"rotary_scaling_factor: config.json's rope scaling is {scaling['rope_type']!r}; hpc_rl builds YaRN"]
    problems = []
    truncate = bool(scaling.get("truncate", True)) if scaling else True
    if arch.yarn and arch.yarn_correction_range_round_to_int != truncate:
        problems.append(f"yarn_correction_range_round_to_int: model file says "
                        f"{arch.yarn_correction_range_round_to_int!r}, config.json's rope_parameters truncate is "
                        f"{truncate!r}")
    ours, theirs = megatron_rotary_numbers(arch), hf_rotary_numbers(hf)
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key), theirs.get(key)
        if a is None or b is None or _differs(a, b):
            problems.append(f"YaRN {key}: the model file gives {a}, config.json's rope_parameters {scaling or 'none'} "
                            f"give {b}")
    return problems


def gpt_oss_mismatches(arch: ModelArchitecture, hf: dict[str, Any]) -> list[str]:
    """Every gpt-oss field against a config.json (either side may be gpt-oss: a mismatch of kind is named)."""
    if hf.get("model_type") != "gpt_oss" or arch.family != "gpt_oss":
        return [f"family: model file says {arch.family!r}, config.json's model_type is {hf.get('model_type')!r}"]
    problems = []
    if arch.softmax_type != "learnable":
        problems.append(f"softmax_type: model file says {arch.softmax_type!r}; gpt-oss has attention sinks "
                        f"(self_attn.sinks): learnable (--softmax-type learnable)")
    problems += _window_mismatches(arch, hf)
    alpha = hf.get("swiglu_alpha", QUICK_GELU_ALPHA)
    if not arch.quick_geglu or _differs(alpha, QUICK_GELU_ALPHA):
        problems.append(f"quick_geglu: model file says {arch.quick_geglu!r}, config.json's swiglu_alpha is {alpha} "
                        f"(Megatron's quick GELU is x * sigmoid({QUICK_GELU_ALPHA} x): --quick-geglu)")
    if _differs(arch.glu_linear_offset, 1.0):
        problems.append(f"glu_linear_offset: model file says {arch.glu_linear_offset}, gpt-oss's experts compute "
                        f"(up + 1) * glu: 1.0 (--glu-linear-offset 1.0)")
    limit = hf.get("swiglu_limit", 7.0)
    if arch.activation_func_clamp_value is None or _differs(arch.activation_func_clamp_value, limit):
        problems.append(f"activation_func_clamp_value: model file says {arch.activation_func_clamp_value!r}, "
                        f"config.json's swiglu_limit is {limit}")
    if not arch.add_bias_linear:
        problems.append("add_bias_linear: gpt-oss's router and experts have biases (mlp.router.bias, "
                        "gate_up_proj_bias, down_proj_bias): drop --disable-bias-linear")
    inner = hf.get("intermediate_size")
    if inner is not None and arch.moe_ffn_hidden_size != inner:
        problems.append(f"moe_ffn_hidden_size: model file says {arch.moe_ffn_hidden_size}, config.json's "
                        f"intermediate_size (each expert's width) is {inner}")
    if arch.moe_router_score_function != "softmax" or arch.moe_router_pre_softmax:
        problems.append("moe_router_score_function / moe_router_pre_softmax: gpt-oss takes the top-k router logits, "
                        "then a softmax over the chosen: softmax without --moe-router-pre-softmax")
    if arch.moe_router_enable_expert_bias:
        problems.append("moe_router_enable_expert_bias: gpt-oss's router bias is a trained bias on the logits "
                        "(add_bias_linear), not an aux-loss-free selection bias")
    return problems + _yarn_mismatches(arch, hf)


def architecture_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelArchitecture fields a gpt-oss config.json states (a model file for a checkpoint; the tests' files)."""
    scaling = hf_rope_scaling(hf)
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window")
    fields: dict[str, Any] = {
        "family": "gpt_oss", "num_layers": layers, "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"], "num_attention_heads": hf["num_attention_heads"],
        "num_query_groups": hf["num_key_value_heads"], "kv_channels": hf["head_dim"], "vocab_size": hf["vocab_size"],
        "rotary_base": float((hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 150000.0))),
        "norm_epsilon": hf.get("rms_norm_eps", 1e-5), "tie_word_embeddings": bool(hf.get("tie_word_embeddings")),
        "add_bias_linear": True, "add_qkv_bias": bool(hf.get("attention_bias", True)),
        "max_position_embeddings": hf.get("max_position_embeddings", 131072),
        "num_moe_experts": hf["num_local_experts"], "moe_ffn_hidden_size": hf["intermediate_size"],
        "moe_router_topk": hf["num_experts_per_tok"], "softmax_type": "learnable", "quick_geglu": True,
        "glu_linear_offset": 1.0, "activation_func_clamp_value": float(hf.get("swiglu_limit", 7.0)),
    }
    if window:
        fields["window_size"] = [int(window) - 1, 0]
        fields["window_attn_skip_freq"] = [int(w) for w in (_hf_window_layers(hf) or [])]
    if scaling.get("rope_type") == "yarn":
        fields.update(rotary_scaling_factor=float(scaling["factor"]),
                      original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 4096)),
                      beta_fast=float(scaling.get("beta_fast", 32.0)), beta_slow=float(scaling.get("beta_slow", 1.0)),
                      yarn_correction_range_round_to_int=bool(scaling.get("truncate", True)))
    return fields
