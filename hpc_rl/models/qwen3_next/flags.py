"""slime's / Megatron's model flags for the hybrid families, read into ModelArchitecture fields: pure, no torch.

Owns: slime's specs (`--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec`, `... qwen3_next get_qwen3_next_spec`,
the families' `slime_spec`) -> the family (qwen3_5 with --num-experts is qwen3_5_moe, Qwen3.5-MoE and Qwen3.6),
the flags
`--attention-output-gate` (slime's `--use-gated-attention`, the same gate), `--moe-shared-expert-gate`,
`--apply-layernorm-1p` (zero-centred norms), Megatron-LM's `--experimental-attention-variant gated_delta_net`,
`--linear-attention-freq` and `--linear-{conv-kernel-dim,key-head-dim,value-head-dim,num-key-heads,num-value-heads}`.
slime's specs pass none of the linear-attention ones: they read config.json (`layer_types`, `linear_*`), and so does
this (`hf_hybrid_fields`), flags winning; without a config.json (a dry run before the download) the transformers
config classes' defaults stand in (`TRANSFORMERS_DEFAULTS`: every 4th layer full attention, the shapes of the
released 35B-A3B / 80B-A3B), and the config.json check compares them once the checkpoint is there (a model whose
shapes differ never loads). What cannot be built is a problem naming the flag and what to do.
"""

from __future__ import annotations

from typing import Any

from hpc_rl.models.qwen3_next.config_rules import HYBRID_FAMILIES, LINEAR_SHAPE_FIELDS, hf_hybrid_fields
from hpc_rl.models.registry import family_for_slime_spec
SWITCH_FIELDS = {"attention_output_gate": "attention_output_gate", "use_gated_attention": "attention_output_gate",
                 "moe_shared_expert_gate": "moe_shared_expert_gate",
                 "apply_layernorm_1p": "layernorm_zero_centered_gamma"}
"""Megatron / slime switches -> ModelArchitecture fields."""
VALUE_FLAGS: dict[str, type] = {"linear_attention_freq": object, "experimental_attention_variant": str,
                                **{name: int for name in LINEAR_SHAPE_FIELDS}}
"""Megatron-LM's value flags of linear attention (the field names are the flag names)."""
TRANSFORMERS_DEFAULTS = {"full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                         "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32}
"""What Qwen3NextConfig, Qwen3_5TextConfig and Qwen3_5MoeTextConfig (transformers 5.24) assume when config.json
leaves a key out: the same for the three."""


def hybrid_spec_family(spec: Any, *, moe: bool) -> str | None:
    """The hybrid family slime's `--spec MODULE FUNCTION` builds (the families' `slime_spec`; Qwen3.5's spec with
    --num-experts builds Qwen3.5-MoE); None: not a hybrid spec."""
    found = family_for_slime_spec(spec) if spec is not None else None
    if found is None or found.name not in HYBRID_FAMILIES:
        return None
    return "qwen3_5_moe" if found.name == "qwen3_5" and moe else found.name


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def apply_hybrid_flags(flags: dict[str, Any], fields: dict[str, Any], problems: list[str],
                       hf_config: dict[str, Any] | None) -> None:
    """The hybrid flags (and, for a hybrid family, config.json's linear-attention fields) on top of `fields`."""
    hybrid = fields.get("family") in HYBRID_FAMILIES
    variant = flags.get("experimental_attention_variant")
    if variant is not None and variant not in ("gated_delta_net", "dsa"):  # dsa: megatron_model._apply_dsa_flags
        problems.append(f"--experimental-attention-variant {variant}: hpc_rl builds gated_delta_net (Qwen3-Next / "
                        f"Qwen3.5 linear attention) or dsa (DeepSeek-V3.2 sparse attention) only")
    given = [name for name in (*SWITCH_FIELDS, *VALUE_FLAGS) if flags.get(name) not in (None, False)
             and not (name == "experimental_attention_variant" and flags[name] == "dsa")]
    if given and not hybrid:
        problems.append(" ".join(_flag(name) for name in given) + ": gated attention, the gated shared expert, "
                        "zero-centred norms and linear attention are built for the hybrid families "
                        f"({', '.join(HYBRID_FAMILIES)}); add slime's --spec slime_plugins.models.qwen3_5 "
                        f"get_qwen3_5_spec (or ... qwen3_next get_qwen3_next_spec)")
        return
    if not hybrid:
        return
    from_config = hf_hybrid_fields(hf_config if hf_config is not None else {
        **TRANSFORMERS_DEFAULTS, "num_hidden_layers": fields["num_layers"]})
    pattern = from_config.get("linear_attention_freq")
    if pattern is not None and len(pattern) != fields["num_layers"] and flags.get("linear_attention_freq") is None:
        problems.append(f"config.json's layer_types has {len(pattern)} layers, --num-layers says "
                        f"{fields['num_layers']}")
        return
    fields.update({name: value for name, value in from_config.items()
                   if name in ("linear_attention_freq", *LINEAR_SHAPE_FIELDS) and value is not None})
    fields.update({SWITCH_FIELDS[name]: True for name in SWITCH_FIELDS if flags.get(name)})
    fields.update({name: flags[name] for name in LINEAR_SHAPE_FIELDS if flags.get(name) is not None})
    if flags.get("linear_attention_freq") is not None:
        fields["linear_attention_freq"] = flags["linear_attention_freq"]
    for name, field in (("attention_output_gate", "attention_output_gate"),
                        ("apply_layernorm_1p", "layernorm_zero_centered_gamma"),
                        *((("moe_shared_expert_gate", "moe_shared_expert_gate"),)
                          if fields.get("moe_shared_expert_intermediate_size") else ())):
        if not fields.get(field):
            problems.append(f"{fields['family']} without {_flag(name)}: every release of this family has it "
                            f"(slime's scripts pass it); add {_flag(name)}")
