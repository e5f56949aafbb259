"""HF <-> Megatron parameter names and layouts: pure functions on names and tensors.

Owns: the canonical Megatron name of every parameter (Transformer-Engine style, as in torch_dist
checkpoints: `self_attention.linear_qkv.layer_norm_weight` for the input norm), its HF names, the
layout conversions, and tensor-parallel sharding of full tensors. Used by the converters, the HF
loader and the weight exporter alike. No Megatron import, no processes.

Layout facts (notes/megatron-cpu.md):
  * `linear_qkv` rows are grouped per KV head: for each query group, its q heads, then its k head,
    then its v head. Chunking the grouped tensor along rows gives correct TP shards.
  * `linear_fc1` is [gate; up]; under TP each rank holds [gate_r; up_r], so shard gate and up apart.
  * Row-parallel (`linear_proj`, `linear_fc2`) shard on columns; embedding/output on (padded) rows.
  * Norms (input, pre-MLP, q/k, final, GLM4 post norms) are replicated.
  * Tied embeddings: Megatron has no `output_layer.weight`; HF may still list `lm_head.weight`.

MoE layers (Qwen3-MoE, GLM-4.5; HF's on-disk names, which SGLang and `save_pretrained` use, not
transformers 5's fused in-memory `experts.gate_up_proj`):
  * `mlp.gate.weight` <-> `mlp.router.weight`; `mlp.gate.e_score_correction_bias` <->
    `mlp.router.expert_bias` (a buffer in Megatron); `post_attention_layernorm` <-> the layer's own
    `pre_mlp_layernorm` (no fused dense fc1 in a MoE layer).
  * `mlp.experts.G.{gate,up,down}_proj` <-> `mlp.experts.local_experts.G.linear_fc{1,2}`, with G the
    GLOBAL expert index in canonical names (an EP rank's local expert K is G = ep_rank * E / EP + K;
    `stage.global_named_params` renames). Each expert's fc1 is [gate; up] and TP-shards as a dense
    fc1 does, over the expert-TP group.
  * `mlp.shared_experts.{gate,up,down}_proj` <-> `mlp.shared_experts.linear_fc{1,2}` (dense layout).

Which rows a decoder layer has is its family's (`hpc_rl.models`: the `hf_layer_rows` / `hf_extra_rows` hooks;
the shared GQA, dense and MoE rows are `hpc_rl.models.name_rows`); multi-latent attention and MTP layers
(DeepSeek-V3, GLM-4.7-Flash): `hpc_rl.models.deepseek_v3.hf_names`. A family with its own tensor layout
answers `to_megatron` / `to_hf` first (its hooks); the shared layouts below are the rest.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.deepseek_v3.hf_names import (
    MTP_LAYER,
    MTP_OWN_ROWS,
    ROW_SPLIT_SUFFIXES,
    TE_LATENT_NORMS,
    TRANSFORMER_LAYER,
    mtp_hf_layer,
)
from hpc_rl.models.name_rows import gated_hf
from hpc_rl.models.registry import NameRow, family

GDN_ROW_SPLIT_SUFFIXES = ("self_attention.in_proj.weight", "self_attention.conv1d.weight", "self_attention.A_log",
                          "self_attention.dt_bias")
"""A Gated DeltaNet layer's tensors split over TP by heads (rows); in_proj and conv1d part by part (`shard`)."""

# Megatron local-spec names -> canonical (TE-style) names.
_LOCAL_TO_CANONICAL = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}
_MOE_PRE_MLP_NORM = ".pre_mlp_layernorm.weight"
"""A MoE layer's pre-MLP norm: its own module in both specs (no dense linear_fc1 to fuse it into)."""
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp\.experts\.local_experts\.)"
                     r"(\d+)(\..+)$")
"""A routed expert's parameter, canonically under its GLOBAL expert index (an EP=1 model's name)."""
EXPERT_BIAS_SUFFIX = ".mlp.router.expert_bias"
"""Megatron's aux-loss-free routing bias: a float32 buffer (not a parameter) that finalize_model_grads
updates; loaded, checkpointed, exported and synced like a weight (HF e_score_correction_bias)."""


VISION_PREFIX = "vision_model."
"""Megatron names of a vision-language model's tower (`hpc_rl.models.qwen3_vl.layers_model`): replicated over TP."""


FLOAT32_HF_SUFFIXES = (".mlp.gate.e_score_correction_bias",)
"""HF tensors sent in float32 whatever the export dtype: the expert bias moves in steps of
moe_router_bias_update_rate (1e-3), below bf16's resolution at 1.0; HF and SGLang keep it in float32."""


def tensor_send_dtype(hf_name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype an HF tensor is sent in when the model is sent in `dtype`."""
    return torch.float32 if hf_name.endswith(FLOAT32_HF_SUFFIXES) else dtype


def canonical_name(name: str, *, moe_layer: bool = False) -> str:
    """Strip DDP/`module.` prefixes and rename local-spec norms to the TE-style checkpoint names.
    `moe_layer`: the name belongs to a MoE layer, whose pre-MLP norm keeps its own name."""
    while name.startswith("module."):
        name = name[len("module.") :]
    for fused, canonical in TE_LATENT_NORMS.items():  # MLA under Transformer Engine (deepseek_v3.hf_names)
        if name.endswith(fused):
            return name[: -len(fused)] + canonical
    for local, canonical in _LOCAL_TO_CANONICAL.items():
        if name.endswith(local) and not (moe_layer and local == _MOE_PRE_MLP_NORM):
            return name[: -len(local)] + canonical
    return name


def is_expert_param(name: str) -> bool:
    """True for a routed expert's weight (`...mlp.experts.local_experts.G.linear_fc{1,2}.weight`)."""
    return _EXPERT.match(name) is not None


def expert_index(name: str) -> int:
    """The expert index in a routed expert's name."""
    match = _EXPERT.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a routed expert's parameter")
    return int(match.group(2))


def with_expert_index(name: str, index: int) -> str:
    """The same parameter of expert `index` in the same layer."""
    match = _EXPERT.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a routed expert's parameter")
    return f"{match.group(1)}{index}{match.group(3)}"


def expert_owner(global_index: int, num_experts: int, ep_size: int) -> int:
    """The EP rank holding expert `global_index` (Megatron gives each EP rank a contiguous block)."""
    return global_index // (num_experts // ep_size)


def _layer_rows(arch: ModelArchitecture, layer: int) -> list[NameRow]:
    """(Megatron suffix, HF suffixes) of decoder layer `layer`, in export order (its family's rows)."""
    return family(arch.family).hf_layer_rows(arch, layer)


def name_map(arch: ModelArchitecture) -> list[tuple[str, list[str]]]:
    """Every Megatron parameter (canonical name; experts under global indices) with its HF names, in a
    stable export order."""
    text = family(arch.family).hf_text_prefix
    rows: list[tuple[str, list[str]]] = [("embedding.word_embeddings.weight", [f"{text}embed_tokens.weight"])]
    last: list[NameRow] = []
    for layer in range(arch.num_layers):
        last = _layer_rows(arch, layer)
        for suffix, hf_suffixes in last:
            rows.append((f"decoder.layers.{layer}.{suffix}", [f"{text}layers.{layer}.{s}" for s in hf_suffixes]))
    rows.append(("decoder.final_layernorm.weight", [f"{text}norm.weight"]))
    if not arch.tie_word_embeddings:
        rows.append(("output_layer.weight", ["lm_head.weight"]))
    rows += family(arch.family).hf_extra_rows(arch, last)
    return rows


def hf_names_of(megatron_name: str, arch: ModelArchitecture) -> list[str]:
    """HF names produced by one canonical Megatron parameter."""
    mtp = MTP_LAYER.match(megatron_name)
    if mtp and int(mtp.group(1)) < (arch.mtp_num_layers or 0):
        depth, rest = int(mtp.group(1)), mtp.group(2)
        prefix = f"model.layers.{mtp_hf_layer(arch, depth)}."
        own = dict(MTP_OWN_ROWS)
        if rest in own:
            return [prefix + own[rest]]
        if rest.startswith(TRANSFORMER_LAYER):  # the layer's usual names, at the MTP layer's HF index
            inner = hf_names_of(f"decoder.layers.{arch.num_layers - 1}.{rest[len(TRANSFORMER_LAYER):]}", arch)
            return [prefix + name.split(".", 3)[3] for name in inner]
    match = _LAYER.match(megatron_name)
    text = family(arch.family).hf_text_prefix
    if match:
        layer, suffix = int(match.group(1)), match.group(2)
        moe = 0 <= layer < arch.num_layers and arch.moe_layers()[layer]
        expert = _EXPERT.match(megatron_name)
        if moe and expert is not None and int(expert.group(2)) < (arch.num_moe_experts or 0):
            own_suffixes = family(arch.family).expert_hf_suffixes  # gpt-oss: experts with biases
            if own_suffixes is not None:
                found = own_suffixes(int(expert.group(2)), suffix)
                if found is not None:
                    return [f"{text}layers.{layer}.{s}" for s in found]
            hf = (gated_hf(f"mlp.experts.{expert.group(2)}.", fused=False) if suffix.endswith("linear_fc1.weight")
                  else [f"mlp.experts.{expert.group(2)}.down_proj.weight"] if suffix.endswith("linear_fc2.weight")
                  else None)
            if hf is not None:
                return [f"{text}layers.{layer}.{s}" for s in hf]
        for mine, hf_suffixes in _layer_rows(arch, layer):
            if mine == suffix and ".local_experts." not in mine:
                return [f"{text}layers.{layer}.{s}" for s in hf_suffixes]
    else:
        top = {"embedding.word_embeddings.weight": [f"{text}embed_tokens.weight"],
               "decoder.final_layernorm.weight": [f"{text}norm.weight"]}
        if not arch.tie_word_embeddings:
            top["output_layer.weight"] = ["lm_head.weight"]
        if megatron_name in top:
            return top[megatron_name]
    raise KeyError(f"{megatron_name!r} has no HF counterpart for family {arch.family!r}")


# ----------------------------------------------------------------------------- layouts (full tensors)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        raise ValueError(f"cannot pad {tuple(tensor.shape)} down to {rows} rows")
    pad = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArchitecture) -> torch.Tensor:
    groups, dim = arch.num_query_groups, arch.kv_channels
    per_group = arch.num_attention_heads // groups
    tail = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(groups, per_group * dim, *tail), k.reshape(groups, dim, *tail), v.reshape(groups, dim, *tail)],
        dim=1,
    )
    return grouped.reshape(-1, *tail)


def _qkv_to_hf(qkv: torch.Tensor, arch: ModelArchitecture) -> list[torch.Tensor]:
    groups, dim = arch.num_query_groups, arch.kv_channels
    per_group = arch.num_attention_heads // groups
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * dim, *tail)
    q, k, v = grouped.split([per_group * dim, dim, dim], dim=1)
    return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]


def to_megatron(megatron_name: str, hf_tensors: Sequence[torch.Tensor], arch: ModelArchitecture,
                *, padded_vocab: int | None = None) -> torch.Tensor:
    """The full (unsharded) Megatron tensor from its HF tensors (in `hf_names_of` order)."""
    own = family(arch.family).to_megatron(megatron_name, hf_tensors, arch)
    if own is not None:
        return own
    if megatron_name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return _qkv_to_megatron(*hf_tensors, arch)
    if megatron_name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return hf_tensors[0] if len(hf_tensors) == 1 else torch.cat(list(hf_tensors), dim=0)
    (tensor,) = hf_tensors
    if megatron_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return _pad_rows(tensor, padded_vocab or tensor.shape[0])
    return tensor


def to_hf(megatron_name: str, full: torch.Tensor, arch: ModelArchitecture) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs from one full Megatron tensor (views where possible, no copies)."""
    own = family(arch.family).to_hf(megatron_name, full, arch)
    if own is not None:
        return own
    names = hf_names_of(megatron_name, arch)
    if megatron_name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return list(zip(names, _qkv_to_hf(full, arch)))
    if (megatron_name.endswith(("linear_fc1.weight", "linear_fc1.bias"))) and len(names) == 2:
        return list(zip(names, full.chunk(2, dim=0)))
    if megatron_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return [(names[0], full[: arch.vocab_size])]
    return [(names[0], full)]


# ----------------------------------------------------------------------------- tensor parallelism


@dataclass(frozen=True)
class TPSplit:
    """How a parameter is split over TP ranks: `dim` (None = replicated), `gated` = [gate_r; up_r]."""

    dim: int | None
    gated: bool = False


def tp_split(megatron_name: str) -> TPSplit:
    """The TP layout of a canonical Megatron parameter."""
    name = canonical_name(megatron_name)
    if name.startswith(VISION_PREFIX):  # a vision tower (Qwen3-VL): transformers' module, replicated over TP
        return TPSplit(dim=None)
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return TPSplit(dim=0, gated=True)
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight",
                      *ROW_SPLIT_SUFFIXES, *GDN_ROW_SPLIT_SUFFIXES,
                      ".core_attention.softmax_offset")):  # sinks: one per head
        return TPSplit(dim=0)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight", "self_attention.out_proj.weight")):
        return TPSplit(dim=1)
    return TPSplit(dim=None)


def _parts(megatron_name: str, arch: ModelArchitecture | None) -> list[int] | None:
    """Row counts of the parts each TP rank holds a share of (a Gated DeltaNet layer's in_proj and conv1d)."""
    if arch is None or arch.linear_attention_freq is None:
        return None
    from hpc_rl.models.qwen3_next.names import tp_parts

    return tp_parts(canonical_name(megatron_name), arch)


def shard(megatron_name: str, full: torch.Tensor, tp_rank: int, tp_size: int,
          arch: ModelArchitecture | None = None) -> torch.Tensor:
    """This TP rank's shard of a full Megatron tensor (`arch`: needed for a Gated DeltaNet layer's parts)."""
    split = tp_split(megatron_name)
    if split.dim is None or tp_size == 1:
        return full
    parts = _parts(megatron_name, arch)
    if parts is not None:
        return torch.cat([part.chunk(tp_size, 0)[tp_rank] for part in full.split(parts, dim=0)], dim=0)
    if split.gated:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    if full.shape[split.dim] % tp_size:
        raise ValueError(f"{megatron_name}: dim {split.dim} of {tuple(full.shape)} does not divide by TP={tp_size}")
    return full.chunk(tp_size, dim=split.dim)[tp_rank]


def unshard(megatron_name: str, shards: Sequence[torch.Tensor],
            arch: ModelArchitecture | None = None) -> torch.Tensor:
    """The full tensor from all TP ranks' shards (in rank order; `arch`: as for `shard`)."""
    split = tp_split(megatron_name)
    if split.dim is None or len(shards) == 1:
        return shards[0]
    parts = _parts(megatron_name, arch)
    if parts is not None:
        pieces = [s.split([size // len(shards) for size in parts], dim=0) for s in shards]
        return torch.cat([piece[index] for index in range(len(parts)) for piece in pieces], dim=0)
    if split.gated:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=split.dim)


def hf_param_shapes(arch: ModelArchitecture, megatron_name: str, full_shape: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes that `to_hf` yields for a Megatron tensor of `full_shape` (no data touched)."""
    meta = torch.empty(tuple(full_shape), device="meta")
    return [(name, tuple(t.shape)) for name, t in to_hf(megatron_name, meta, arch)]
