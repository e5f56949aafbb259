"""HF <-> Megatron names and layouts of the hybrid layers (Qwen3-Next, Qwen3.5, Qwen3.5-MoE): pure, no Megatron.

Owns: each layer's rows (`hybrid_layer_rows`) and the layouts that differ from the shared GPT ones (`to_megatron`,
`to_hf`, `tp_parts`). Facts, from transformers 5.24's modeling files and megatron-core 0.16.1's GatedDeltaNet:
  * A Gated DeltaNet layer: `linear_attn.{A_log, dt_bias, conv1d.weight, norm.weight, out_proj.weight}` <->
    `self_attention.{A_log, dt_bias, conv1d.weight, out_norm.weight, out_proj.weight}`; its input norm
    `input_layernorm` <-> `self_attention.in_proj.layer_norm_weight` (fused into the projection, as Megatron's GDN
    spec and Transformer Engine name it).
  * Megatron's `in_proj` rows are [q | k | v | z | beta | alpha], each over all heads in head order (v, z, beta and
    alpha over the value heads). Qwen3.5 has them apart: `in_proj_qkv` ([q | k | v], the same order),
    `in_proj_z`, `in_proj_b`, `in_proj_a`. Qwen3-Next fuses them per key head: `in_proj_qkvz` rows are, for each key
    head h, [q_h | k_h | v and z of h's value heads], `in_proj_ba` rows [b | a of h's value heads].
  * `conv1d.weight` [q | k | v channels, 1, width] is the same in both (the convolution runs on the flat q/k/v).
  * The gated norm `linear_attn.norm` scales by its weight as stored (not 1 + w): Megatron's `out_norm` is built
    with plain gamma whatever the layer norms do; every other norm is zero-centred (1 + w) in both, so no value moves.
  * Full attention with its output gate: HF `q_proj` rows are, per head, [q_h | gate_h]; Megatron's `linear_qkv`
    rows per query group [q heads | gate heads | k | v].
  * The MoE layer's shared expert is singular in HF (`mlp.shared_expert.*`), its gate `mlp.shared_expert_gate.weight`
    [1, hidden] <-> `mlp.shared_experts.gate_weight`.
  * Under TP each rank holds its heads' share of every part of `in_proj` and `conv1d` ([q_r | k_r | v_r | ...]), so
    these shard part by part (`tp_parts`), as linear_fc1's [gate_r; up_r].
"""

from __future__ import annotations

from typing import Any

ModelArchitecture = Any
"""A `hpc_rl.config.model.ModelArchitecture` (not imported: config imports this package)."""

NameRow = tuple[str, list[str]]
SEPARATE_PROJECTIONS = ("qwen3_5", "qwen3_5_moe")
"""Families whose Gated DeltaNet input projections are four HF tensors (in_proj_qkv, _z, _b, _a)."""
IN_PROJ = "self_attention.in_proj.weight"
CONV = "self_attention.conv1d.weight"


def is_linear_layer(arch: ModelArchitecture, layer: int) -> bool:
    """True when decoder layer `layer` is Gated DeltaNet linear attention."""
    return bool(arch.linear_attention_freq) and bool(arch.linear_attention_freq[layer])


def _gdn_rows(arch: ModelArchitecture) -> list[NameRow]:
    projections = (["linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
                    "linear_attn.in_proj_a.weight"] if arch.family in SEPARATE_PROJECTIONS
                   else ["linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"])
    return [("self_attention.in_proj.layer_norm_weight", ["input_layernorm.weight"]),
            (IN_PROJ, projections),
            (CONV, ["linear_attn.conv1d.weight"]),
            ("self_attention.dt_bias", ["linear_attn.dt_bias"]),
            ("self_attention.A_log", ["linear_attn.A_log"]),
            ("self_attention.out_norm.weight", ["linear_attn.norm.weight"]),
            ("self_attention.out_proj.weight", ["linear_attn.out_proj.weight"])]


def hybrid_layer_rows(arch: ModelArchitecture, layer: int, gpt_rows: list[NameRow]) -> list[NameRow]:
    """Decoder layer `layer`'s rows from the shared GPT layer's (`gpt_rows`, dense or MoE MLP as the layer is):
    its attention rows replaced by Gated DeltaNet's on a linear layer, the shared expert under HF's singular name
    with its gate."""
    rows = [row for row in gpt_rows if not (is_linear_layer(arch, layer) and row[0].startswith("self_attention."))]
    if is_linear_layer(arch, layer):
        rows = _gdn_rows(arch) + rows
    renamed = [(mine, [hf.replace("mlp.shared_experts.", "mlp.shared_expert.") for hf in hfs]) for mine, hfs in rows]
    if arch.moe_shared_expert_gate and any(mine.startswith("mlp.shared_experts.") for mine, _ in renamed):
        renamed.append(("mlp.shared_experts.gate_weight", ["mlp.shared_expert_gate.weight"]))
    return renamed


def layer_rows(arch: ModelArchitecture, layer: int) -> list[NameRow]:
    """The family's `hf_layer_rows` hook: the shared GQA rows (hpc_rl.models.name_rows) made hybrid."""
    from hpc_rl.models.name_rows import layer_rows as gqa_layer_rows

    return hybrid_layer_rows(arch, layer, gqa_layer_rows(arch, layer))


def _hf_names(megatron_name: str, arch: ModelArchitecture) -> list[str]:
    _, _, layer, suffix = megatron_name.split(".", 3)
    for mine, hf_suffixes in layer_rows(arch, int(layer)):
        if mine == suffix:
            return [f"model.layers.{layer}.{hf}" for hf in hf_suffixes]
    raise KeyError(f"{megatron_name!r} has no HF counterpart for family {arch.family!r}")


def _gdn_sizes(arch: ModelArchitecture) -> dict[str, int]:
    qk = arch.linear_num_key_heads * arch.linear_key_head_dim
    v = arch.linear_num_value_heads * arch.linear_value_head_dim
    return {"qk": qk, "v": v, "heads": arch.linear_num_value_heads}


def tp_parts(megatron_name: str, arch: ModelArchitecture) -> list[int] | None:
    """Row counts of the parts a TP rank holds a share of each of (None: the shared layout applies)."""
    if arch.linear_attention_freq is None:
        return None
    size = _gdn_sizes(arch)
    if megatron_name.endswith(IN_PROJ):
        return [size["qk"], size["qk"], size["v"], size["v"], size["heads"], size["heads"]]
    if megatron_name.endswith(CONV):
        return [size["qk"], size["qk"], size["v"]]
    return None


def _qwen3_next_in_proj(qkvz: Any, ba: Any, arch: ModelArchitecture) -> Any:
    import torch

    groups, k_dim = arch.linear_num_key_heads, arch.linear_key_head_dim
    per_group_v = arch.linear_num_value_heads // groups * arch.linear_value_head_dim
    q, k, v, z = qkvz.reshape(groups, -1, qkvz.shape[-1]).split([k_dim, k_dim, per_group_v, per_group_v], dim=1)
    b, a = ba.reshape(groups, -1, ba.shape[-1]).chunk(2, dim=1)
    return torch.cat([part.reshape(-1, qkvz.shape[-1]) for part in (q, k, v, z, b, a)], dim=0)


def _qwen3_next_in_proj_to_hf(full: Any, arch: ModelArchitecture) -> list[Any]:
    import torch

    size = _gdn_sizes(arch)
    groups = arch.linear_num_key_heads
    q, k, v, z, b, a = (part.reshape(groups, -1, full.shape[-1]) for part in full.split(
        [size["qk"], size["qk"], size["v"], size["v"], size["heads"], size["heads"]], dim=0))
    qkvz = torch.cat([q, k, v, z], dim=1).reshape(-1, full.shape[-1])
    ba = torch.cat([b, a], dim=1).reshape(-1, full.shape[-1])
    return [qkvz, ba]


def _gated_qkv(q_and_gate: Any, k: Any, v: Any, arch: ModelArchitecture) -> Any:
    import torch

    groups, dim = arch.num_query_groups, arch.kv_channels
    per_group = arch.num_attention_heads // groups
    tail = k.shape[1:]
    heads = q_and_gate.reshape(groups, per_group, 2, dim, *tail)
    return torch.cat([heads[:, :, 0].reshape(groups, per_group * dim, *tail),
                      heads[:, :, 1].reshape(groups, per_group * dim, *tail),
                      k.reshape(groups, dim, *tail), v.reshape(groups, dim, *tail)], dim=1).reshape(-1, *tail)


def _gated_qkv_to_hf(full: Any, arch: ModelArchitecture) -> list[Any]:
    import torch

    groups, dim = arch.num_query_groups, arch.kv_channels
    per_group = arch.num_attention_heads // groups
    tail = full.shape[1:]
    q, gate, k, v = full.reshape(groups, (2 * per_group + 2) * dim, *tail).split(
        [per_group * dim, per_group * dim, dim, dim], dim=1)
    q_and_gate = torch.stack([q.reshape(groups, per_group, dim, *tail), gate.reshape(groups, per_group, dim, *tail)],
                             dim=2)
    return [q_and_gate.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]


def to_megatron(megatron_name: str, hf_tensors: list[Any], arch: ModelArchitecture) -> Any:
    """The full Megatron tensor from its HF tensors where the hybrid layout differs (None: the shared layout)."""
    import torch

    if megatron_name.endswith(IN_PROJ):
        if arch.family in SEPARATE_PROJECTIONS:
            return torch.cat(list(hf_tensors), dim=0)
        return _qwen3_next_in_proj(*hf_tensors, arch)
    if megatron_name.endswith("self_attention.linear_qkv.weight") and arch.attention_output_gate:
        return _gated_qkv(*hf_tensors, arch)
    return None


def to_hf(megatron_name: str, full: Any, arch: ModelArchitecture) -> list[tuple[str, Any]] | None:
    """(HF name, tensor) pairs of one full Megatron tensor where the hybrid layout differs (None: the shared one)."""
    if not megatron_name.endswith((IN_PROJ, "self_attention.linear_qkv.weight")):
        return None
    names = _hf_names(megatron_name, arch)
    if megatron_name.endswith(IN_PROJ):
        if arch.family in SEPARATE_PROJECTIONS:
            size = _gdn_sizes(arch)
            return list(zip(names, full.split([2 * size["qk"] + size["v"], size["v"], size["heads"], size["heads"]])))
        return list(zip(names, _qwen3_next_in_proj_to_hf(full, arch)))
    if megatron_name.endswith("self_attention.linear_qkv.weight") and arch.attention_output_gate:
        return list(zip(names, _gated_qkv_to_hf(full, arch)))
    return None
