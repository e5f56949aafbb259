"""The shared HF <-> Megatron name rows of one decoder layer: GQA attention, the dense MLP and the MoE MLP.

Owns: (Megatron suffix, [HF suffixes]) rows in export order, under `decoder.layers.<i>.` and `model.layers.<i>.`
(layout facts: `hpc_rl.weights.hf_mapping`'s docstring). A family's `hf_layer_rows` hook is `layer_rows` (GQA
families) or composes its own attention rows with `mlp_rows` (MLA: `hpc_rl.models.deepseek_v3.hf_names`).
Whether a dense MLP's gate and up are one HF tensor is the family's `fused_gate_up` (GLM4). Pure: no torch;
`arch` is a `hpc_rl.config.model.ModelArchitecture`.
"""

from __future__ import annotations

from typing import Any

from hpc_rl.models.registry import NameRow, family


def gated_hf(prefix: str, fused: bool) -> list[str]:
    """The HF names of a gated MLP's fc1: one fused gate_up_proj or gate_proj + up_proj."""
    return [f"{prefix}gate_up_proj.weight"] if fused else [f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"]


def dense_mlp_rows(arch: Any) -> list[NameRow]:
    """A dense layer's MLP rows (its pre-MLP norm fused into linear_fc1, TE's name)."""
    fc1_hf = gated_hf("mlp.", fused=family(arch.family).fused_gate_up)
    rows = [("mlp.linear_fc1.layer_norm_weight", ["post_attention_layernorm.weight"]),
            ("mlp.linear_fc1.weight", fc1_hf)]
    if arch.add_bias_linear:
        rows.append(("mlp.linear_fc1.bias", [s.replace(".weight", ".bias") for s in fc1_hf]))
    rows.append(("mlp.linear_fc2.weight", ["mlp.down_proj.weight"]))
    if arch.add_bias_linear:
        rows.append(("mlp.linear_fc2.bias", ["mlp.down_proj.bias"]))
    if arch.post_sublayer_norms:
        rows.append(("mlp.post_mlp_layernorm.weight", ["post_mlp_layernorm.weight"]))
    return rows


def moe_mlp_rows(arch: Any) -> list[NameRow]:
    """A MoE layer's MLP rows: HF `mlp.gate` is Megatron's router, `mlp.experts.G.*` its routed experts
    (G global), `mlp.shared_experts.*` its shared experts (all of them fused into one MLP in both)."""
    rows = [("pre_mlp_layernorm.weight", ["post_attention_layernorm.weight"]),
            ("mlp.router.weight", ["mlp.gate.weight"])]
    if arch.moe_router_enable_expert_bias:
        rows.append(("mlp.router.expert_bias", ["mlp.gate.e_score_correction_bias"]))
    for expert in range(arch.num_moe_experts or 0):
        rows.append((f"mlp.experts.local_experts.{expert}.linear_fc1.weight",
                     gated_hf(f"mlp.experts.{expert}.", fused=False)))
        rows.append((f"mlp.experts.local_experts.{expert}.linear_fc2.weight",
                     [f"mlp.experts.{expert}.down_proj.weight"]))
    if arch.moe_shared_expert_intermediate_size:
        rows.append(("mlp.shared_experts.linear_fc1.weight", gated_hf("mlp.shared_experts.", fused=False)))
        rows.append(("mlp.shared_experts.linear_fc2.weight", ["mlp.shared_experts.down_proj.weight"]))
    return rows


def mlp_rows(arch: Any, layer: int) -> list[NameRow]:
    """Layer `layer`'s MLP rows: MoE or dense as `arch.moe_layers()` says (dense past the last layer)."""
    pattern = arch.moe_layers()
    return moe_mlp_rows(arch) if 0 <= layer < len(pattern) and pattern[layer] else dense_mlp_rows(arch)


def gqa_attention_rows(arch: Any) -> list[NameRow]:
    """A GQA attention block's rows, input norm first (q, k, v fused into linear_qkv)."""
    rows: list[NameRow] = [
        ("self_attention.linear_qkv.layer_norm_weight", ["input_layernorm.weight"]),
        ("self_attention.linear_qkv.weight", ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.v_proj.weight"]),
    ]
    if arch.add_qkv_bias or arch.add_bias_linear:
        rows.append(("self_attention.linear_qkv.bias", ["self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                        "self_attn.v_proj.bias"]))
    if arch.qk_layernorm:
        rows.append(("self_attention.q_layernorm.weight", ["self_attn.q_norm.weight"]))
        rows.append(("self_attention.k_layernorm.weight", ["self_attn.k_norm.weight"]))
    rows.append(("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"]))
    if arch.add_bias_linear:
        rows.append(("self_attention.linear_proj.bias", ["self_attn.o_proj.bias"]))
    if arch.post_sublayer_norms:
        rows.append(("self_attention.post_self_attn_layernorm.weight", ["post_self_attn_layernorm.weight"]))
    return rows


def layer_rows(arch: Any, layer: int) -> list[NameRow]:
    """Decoder layer `layer` of a GQA family: attention, then its MLP (the default `hf_layer_rows` hook)."""
    return gqa_attention_rows(arch) + mlp_rows(arch, layer)
