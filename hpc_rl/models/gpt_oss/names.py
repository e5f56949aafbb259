"""gpt-oss's HF <-> Megatron parameter names: the family's `hf_layer_rows` hook (`layer_rows`). Pure: no torch.

Owns the rows that differ from the other MoE families (every other row, attention q/k/v/o with their biases and
the norms, is the shared GQA rows of `hpc_rl.models.name_rows`; embedding and output the common map's):

  Megatron (canonical)                                      HF (per expert K: slime's bf16 layout, SGLang's
                                                            per-expert names)
  self_attention.core_attention.softmax_offset [heads]      self_attn.sinks (TP: split by heads)
  mlp.router.weight / .bias                                 mlp.router.weight / .bias
  mlp.experts.local_experts.K.linear_fc1.weight [2I, H]     mlp.experts.K.gate_proj.weight, up_proj.weight
  mlp.experts.local_experts.K.linear_fc1.bias [2I]          mlp.experts.K.gate_proj.bias, up_proj.bias
  mlp.experts.local_experts.K.linear_fc2.weight [H, I]      mlp.experts.K.down_proj.weight
  mlp.experts.local_experts.K.linear_fc2.bias [H]           mlp.experts.K.down_proj.bias

The released checkpoints (and transformers' save_pretrained) keep each layer's experts fused and interleaved:
`gate_up_proj` [E, H, 2I] with gate in the even columns and up in the odd ones, `gate_up_proj_bias` [E, 2I] the
same, `down_proj` [E, I, H], `down_proj_bias` [E, H]; or MXFP4 blocks and scales. `hpc_rl.models.gpt_oss.checkpoint`
reads those under the per-expert names above and writes them back (`fuse_experts`).
"""

from __future__ import annotations

from typing import Any

from hpc_rl.models.name_rows import gqa_attention_rows
from hpc_rl.models.registry import NameRow

ModelArchitecture = Any
"""`arch` is a `hpc_rl.config.model.ModelArchitecture` (not imported: config imports the registry's modules)."""

SINKS = ("self_attention.core_attention.softmax_offset", "self_attn.sinks")
ROUTER_ROWS = [("mlp.router.weight", ["mlp.router.weight"]), ("mlp.router.bias", ["mlp.router.bias"])]
SOFTMAX_OFFSET_SUFFIX = ".core_attention.softmax_offset"
"""Split by heads over TP, as the q rows are."""


def attention_extra_rows(arch: ModelArchitecture) -> list[NameRow]:
    """The attention's rows beyond q/k/v/o: the sinks (softmax_type learnable)."""
    return [(SINKS[0], [SINKS[1]])] if arch.softmax_type == "learnable" else []


def expert_hf_suffixes(expert: int, megatron_suffix: str) -> list[str] | None:
    """The HF suffixes (under model.layers.L.) of routed expert `expert`'s parameter; None if not an expert's."""
    prefix = f"mlp.experts.{expert}."
    kind = megatron_suffix.rsplit(".", 1)[-1]  # weight | bias
    if megatron_suffix.endswith(f"linear_fc1.{kind}"):
        return [f"{prefix}gate_proj.{kind}", f"{prefix}up_proj.{kind}"]
    if megatron_suffix.endswith(f"linear_fc2.{kind}"):
        return [f"{prefix}down_proj.{kind}"]
    return None


def moe_mlp_rows(arch: ModelArchitecture) -> list[NameRow]:
    """A gpt-oss MoE layer's MLP rows: its pre-MLP norm, the router with its bias, each expert with its biases."""
    rows = [("pre_mlp_layernorm.weight", ["post_attention_layernorm.weight"]), *ROUTER_ROWS]
    for expert in range(arch.num_moe_experts or 0):
        for part in ("linear_fc1", "linear_fc2"):
            for kind in ("weight", "bias"):
                suffix = f"mlp.experts.local_experts.{expert}.{part}.{kind}"
                rows.append((suffix, expert_hf_suffixes(expert, suffix) or []))
    return rows


def layer_rows(arch: ModelArchitecture, layer: int) -> list[NameRow]:
    """Decoder layer `layer` (every gpt-oss layer is MoE): GQA attention with its sinks, then the MoE MLP."""
    return gqa_attention_rows(arch) + attention_extra_rows(arch) + moe_mlp_rows(arch)
