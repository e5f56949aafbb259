"""HF <-> Megatron names of multi-latent attention and MTP layers (DeepSeek-V3 and GLM-4.7-Flash families).

Owns: the name rows of an MLA family's decoder layers (its `hf_layer_rows` hook, `layer_rows`) and MTP layers
(its `hf_extra_rows` hook, `mtp_rows`), read by `hpc_rl.weights.hf_mapping` (pure, no Megatron import):

  Megatron (canonical)                               HF (DeepseekV3 / Glm4MoeLite checkpoints)
  self_attention.linear_q_down_proj.weight           self_attn.q_a_proj.weight       (replicated over TP)
  self_attention.q_layernorm.weight                  self_attn.q_a_layernorm.weight
  self_attention.linear_q_up_proj.weight             self_attn.q_b_proj.weight       (rows: heads x (nope + rope))
  self_attention.linear_q_proj.weight                self_attn.q_proj.weight         (q_lora_rank null: Moonlight)
  self_attention.linear_kv_down_proj.weight          self_attn.kv_a_proj_with_mqa.weight (rows: latent, then rope)
  self_attention.kv_layernorm.weight                 self_attn.kv_a_layernorm.weight
  self_attention.linear_kv_up_proj.weight            self_attn.kv_b_proj.weight      (rows: heads x (nope + v))
  self_attention.linear_proj.weight                  self_attn.o_proj.weight

No layout change: Megatron's MLA splits q and kv per head in HF's order and de-interleaves the rotary pairs
itself (HF rope_interleave true). Transformer Engine fuses the two latent norms into the up projections
(`linear_q_up_proj.layer_norm_weight`, `linear_kv_up_proj.layer_norm_weight`); `canonical_name` maps those to
the names above, so both specs share one map. The input norm is TE's separate `input_layernorm` in MLA
layers; it keeps the canonical name GQA layers use (`self_attention.linear_qkv.layer_norm_weight`).

MTP layer k (Megatron's `mtp.layers.k.`) is HF's `model.layers.<num_layers + k>.` (the names SGLang's NextN
draft loads, DeepseekV3ForCausalLMNextN / Glm4MoeLiteForCausalLMNextN): `enorm`, `hnorm`, `eh_proj` ([h, 2h],
input [embedding, hidden], TP-split on rows), `final_layernorm` <-> `shared_head.norm`, and its
`transformer_layer.*` <-> the layer's usual suffixes (attention, router, experts, shared experts). DeepSeek's
checkpoints also hold copies of the embedding and the output layer there (`embed_tokens`,
`shared_head.head`): Megatron and SGLang's draft use the model's own, so they are written by the converter
(`mtp_copies`) and never loaded or synced.
"""

from __future__ import annotations

import re
from typing import Any

from hpc_rl.models.name_rows import mlp_rows
from hpc_rl.models.registry import NameRow

MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
TRANSFORMER_LAYER = "transformer_layer."
TE_LATENT_NORMS = {
    ".self_attention.linear_q_up_proj.layer_norm_weight": ".self_attention.q_layernorm.weight",
    ".self_attention.linear_kv_up_proj.layer_norm_weight": ".self_attention.kv_layernorm.weight",
}
"""Transformer Engine's fused latent norms -> their canonical (local-spec) names."""
MTP_OWN_ROWS = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                ("eh_proj.weight", "eh_proj.weight"), ("final_layernorm.weight", "shared_head.norm.weight"))
"""(Megatron suffix under mtp.layers.k., HF suffix under model.layers.<L + k>.) of an MTP layer's own modules."""
ROW_SPLIT_SUFFIXES = ("linear_q_up_proj.weight", "linear_q_proj.weight", "linear_kv_up_proj.weight",
                      "eh_proj.weight")
"""MLA / MTP weights split on rows over TP (column-parallel); the down projections are replicated."""


def mla_attention_rows(arch: Any) -> list[tuple[str, list[str]]]:
    """(Megatron suffix, HF suffixes) of one MLA attention block, input norm first."""
    rows = [("self_attention.linear_qkv.layer_norm_weight", ["input_layernorm.weight"])]
    if arch.q_lora_rank:
        rows += [("self_attention.linear_q_down_proj.weight", ["self_attn.q_a_proj.weight"]),
                 ("self_attention.q_layernorm.weight", ["self_attn.q_a_layernorm.weight"]),
                 ("self_attention.linear_q_up_proj.weight", ["self_attn.q_b_proj.weight"])]
    else:
        rows.append(("self_attention.linear_q_proj.weight", ["self_attn.q_proj.weight"]))
    rows += [("self_attention.linear_kv_down_proj.weight", ["self_attn.kv_a_proj_with_mqa.weight"]),
             ("self_attention.kv_layernorm.weight", ["self_attn.kv_a_layernorm.weight"]),
             ("self_attention.linear_kv_up_proj.weight", ["self_attn.kv_b_proj.weight"]),
             ("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"])]
    return rows


def layer_rows(arch: Any, layer: int) -> list[NameRow]:
    """Decoder layer `layer` of an MLA family: MLA attention, then its MLP (dense or MoE)."""
    return mla_attention_rows(arch) + mlp_rows(arch, layer)


def mtp_hf_layer(arch: Any, depth: int) -> int:
    """The HF layer index of MTP depth `depth` (0-based)."""
    return arch.num_layers + depth


def mtp_rows(arch: Any, layer_rows: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """Every MTP layer's (Megatron name, HF names); `layer_rows`: a decoder layer's (suffix, HF suffixes) of
    the layer kind the MTP layers copy (the last decoder layer's)."""
    rows: list[tuple[str, list[str]]] = []
    for depth in range(arch.mtp_num_layers or 0):
        hf = f"model.layers.{mtp_hf_layer(arch, depth)}."
        mine = f"mtp.layers.{depth}."
        rows += [(mine + ours, [hf + theirs]) for ours, theirs in MTP_OWN_ROWS[:3]]
        rows += [(mine + TRANSFORMER_LAYER + suffix, [hf + s for s in hf_suffixes]) for suffix, hf_suffixes in layer_rows]
        rows.append((mine + MTP_OWN_ROWS[3][0], [hf + MTP_OWN_ROWS[3][1]]))
    return rows


def mtp_copies(arch: Any) -> list[tuple[str, str]]:
    """(HF name of a copy in an MTP layer, HF name it copies): DeepSeek's per-MTP-layer embedding and head."""
    copies = []
    for depth in range(arch.mtp_num_layers or 0):
        hf = f"model.layers.{mtp_hf_layer(arch, depth)}."
        copies.append((hf + "embed_tokens.weight", "model.embed_tokens.weight"))
        copies.append((hf + "shared_head.head.weight",
                       "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"))
    return copies


def is_mtp_copy(hf_name: str, arch: Any) -> bool:
    """An MTP layer's embedding / head copy (written by converters, never loaded or synced)."""
    return any(hf_name == copy for copy, _ in mtp_copies(arch))
