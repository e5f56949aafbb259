"""What a hybrid Gated DeltaNet architecture must satisfy, and its config.json check: pure, no torch.

Owns: the families (`HYBRID_FAMILIES`: qwen3_next, qwen3_5 dense, qwen3_5_moe; Qwen3.6 is qwen3_5_moe's model type),
`architecture_problem` (why a ModelArchitecture cannot be built as one), `expand_linear_attention_freq` (Megatron's
int N -> per-layer list), `hf_hybrid_fields` (the ModelArchitecture fields config.json fixes: the layer pattern
from `layer_types`, the linear-attention shapes, and what every release of these families has: zero-centred norms,
attention output gates, a gated shared expert) and `check_config` (config.json against a model file, one readable
line per mismatch). A VLM config.json (Qwen3.5's release) is read through its `text_config`.
"""

from __future__ import annotations

from typing import Any

ModelArchitecture = Any
"""A `hpc_rl.config.model.ModelArchitecture` (not imported: config imports this package)."""

HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
HYBRID_MOE_FAMILIES = ("qwen3_next", "qwen3_5_moe")
HF_MODEL_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
                  "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe"}
"""config.json model_type (the VLM release's or its text model's) -> family."""
LINEAR_SHAPE_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                       "linear_num_key_heads", "linear_num_value_heads")
"""ModelArchitecture fields with the same name as config.json's keys (and Megatron's TransformerConfig's)."""


def expand_linear_attention_freq(value: int | list[int], num_layers: int) -> list[int]:
    """Megatron's `linear_attention_freq`: an int N -> [1]*(N-1)+[0] repeated (every N-th layer full attention);
    a list is per layer (1 = linear attention, 0 = full)."""
    if isinstance(value, bool) or not isinstance(value, (int, list)):
        raise ValueError(f"linear_attention_freq {value!r}: give an int N (every N-th layer full attention) or a "
                         f"list of 0/1 per layer")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"linear_attention_freq {value}: must be >= 1")
        return [0 if (layer + 1) % value == 0 else 1 for layer in range(num_layers)]
    if len(value) != num_layers or any(flag not in (0, 1) for flag in value):
        raise ValueError(f"linear_attention_freq {value}: needs one 0 (full) or 1 (linear) per layer "
                         f"({num_layers} layers)")
    return list(value)


def architecture_problem(arch: ModelArchitecture) -> str | None:
    """The hybrid families' `architecture_problem` hook: linear attention must be described."""
    if arch.linear_attention_freq is None:
        return (f"family {arch.family!r} is a hybrid linear-attention family: set linear_attention_freq (config.json's "
                f"layer_types) and the linear_* shapes")
    return None


def hybrid_field_problem(arch: ModelArchitecture) -> str | None:
    """Why the linear-attention fields of any architecture cannot be built (None: they can, or are unset)."""
    if arch.linear_attention_freq is None:
        return None
    if arch.family not in HYBRID_FAMILIES:
        return (f"linear_attention_freq with family {arch.family!r}: Gated DeltaNet layers are built for the "
                f"families {', '.join(HYBRID_FAMILIES)}")
    missing = [name for name in LINEAR_SHAPE_FIELDS if getattr(arch, name) is None]
    if missing:
        return f"linear_attention_freq is set: set {', '.join(missing)} too (config.json's keys of the same names)"
    if arch.linear_num_value_heads % arch.linear_num_key_heads:
        return (f"linear_num_value_heads ({arch.linear_num_value_heads}) must be a multiple of linear_num_key_heads "
                f"({arch.linear_num_key_heads})")
    if arch.multi_latent_attention:
        return "linear attention with multi_latent_attention: no such hybrid is built"
    return None


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json keys (a VLM release keeps them under text_config)."""
    inner = hf.get("text_config")
    return inner if isinstance(inner, dict) else hf


def hf_layer_pattern(hf: dict[str, Any]) -> list[int] | None:
    """Per layer 1 (linear attention) / 0 (full) from config.json (layer_types, else full_attention_interval)."""
    text = text_config(hf)
    if isinstance(text.get("layer_types"), list):
        return [1 if kind == "linear_attention" else 0 for kind in text["layer_types"]]
    if text.get("num_hidden_layers") is None:
        return None
    return expand_linear_attention_freq(int(text.get("full_attention_interval", 4)), int(text["num_hidden_layers"]))


def hf_hybrid_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelArchitecture fields config.json fixes for these families."""
    text = text_config(hf)
    fields: dict[str, Any] = {name: text[name] for name in LINEAR_SHAPE_FIELDS if text.get(name) is not None}
    fields.update(linear_attention_freq=hf_layer_pattern(hf), layernorm_zero_centered_gamma=True,
                  attention_output_gate=True)
    if text.get("shared_expert_intermediate_size"):
        fields["moe_shared_expert_gate"] = True
    return fields


def check_config(arch: ModelArchitecture, hf: dict[str, Any]) -> list[str]:
    """The hybrid fields of `arch` against config.json, one readable line per mismatch."""
    if arch.family not in HYBRID_FAMILIES:
        return []
    problems = []
    for name, theirs in hf_hybrid_fields(hf).items():
        ours = getattr(arch, name)
        if name == "moe_shared_expert_gate" and not arch.is_moe:
            continue
        if theirs is not None and ours != theirs:
            problems.append(f"{name}: model file says {ours!r}, config.json ({hf.get('model_type')}) says {theirs!r}")
    return problems


def transformer_config_fields(arch: ModelArchitecture, *, context_parallel_size: int = 1) -> dict[str, Any]:
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
                         f"layers ({arch.family}): {CP_REFUSAL}. Use context_parallel_size 1")
    fields.update(experimental_attention_variant="gated_delta_net",
                  linear_attention_freq=list(arch.linear_attention_freq),
                  linear_conv_kernel_dim=arch.linear_conv_kernel_dim, linear_key_head_dim=arch.linear_key_head_dim,
                  linear_value_head_dim=arch.linear_value_head_dim, linear_num_key_heads=arch.linear_num_key_heads,
                  linear_num_value_heads=arch.linear_num_value_heads)
    return fields


CP_REFUSAL = ("a linear-attention layer carries its state along the whole sequence, and context parallelism splits "
              "the sequence over ranks; no CP exchange of that state is built (megatron-core 0.16.1 refuses it too)")


def layout_problems(arch: ModelArchitecture, *, tp: int, cp: int) -> list[tuple[str, str]]:
    """(config field, message) for parallel sizes the linear-attention layers cannot take."""
    if arch.linear_attention_freq is None:
        return []
    problems = []
    if cp > 1:
        problems.append(("training.context_parallel_size", f"context parallelism {cp} over Gated DeltaNet layers "
                                                           f"({arch.family}): {CP_REFUSAL}; use 1"))
    for name in ("linear_num_key_heads", "linear_num_value_heads"):
        if getattr(arch, name) % tp:
            problems.append(("training.tensor_model_parallel_size", f"TP {tp} does not divide the model's "
                                                                    f"{getattr(arch, name)} {name}"))
    return problems
