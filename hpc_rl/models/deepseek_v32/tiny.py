"""Tiny DeepSeek-V3.2 checkpoints (DeepseekV32ForCausalLM): multi-latent attention with a sparse-attention indexer.

Owns: `TinyDsaSpec` and the family's `make_tiny` hook: transformers' own model class, decisive routers (as the
DeepSeek-V3 tiny model), and indexer weights large enough that its top-k choices are not near-ties (transformers
initialises them near zero), its k_norm's weight and bias random so that every indexer tensor matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_rl.models.deepseek_v3.tiny import TinyMlaSpec, mla_config_fields
from hpc_rl.models.tiny_checkpoint import build_tokenizer, randomize_moe, spec_of


@dataclass(kw_only=True)
class TinyDsaSpec(TinyMlaSpec):
    """Shape of a tiny DeepSeek-V3.2: the tiny DeepSeek-V3's (2 layers, the first dense) with an indexer of 4
    heads of 16 dims choosing 4 keys per query, no MTP layer."""

    family: str = "deepseek_v32"
    index_n_heads: int = 4
    index_head_dim: int = 16
    index_topk: int = 4
    indexer_std: float = 0.3
    """Indexer projections ~ N(0, indexer_std): well-separated scores."""
    mtp_layers: int = 0


def randomize_indexer(model: Any, spec: TinyDsaSpec) -> None:
    """Indexer weights ~ N(0, indexer_std), its k_norm weight near 1 and bias near 0, all random."""
    import torch

    generator = torch.Generator().manual_seed(spec.seed + 3)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if ".indexer." not in name:
                continue
            if name.endswith("k_norm.weight"):
                value = 1.0 + 0.1 * torch.randn(tensor.shape, generator=generator)
            elif name.endswith("k_norm.bias"):
                value = 0.1 * torch.randn(tensor.shape, generator=generator)
            else:
                value = spec.indexer_std * torch.randn(tensor.shape, generator=generator)
            tensor.copy_(value)


def make_tiny_dsa_model(output_dir: str | Path, spec: TinyDsaSpec | None = None) -> Path:
    """Write a randomly initialised tiny DeepSeek-V3.2 checkpoint + the tiny tokenizer."""
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    spec = spec or TinyDsaSpec()
    if spec.mtp_layers:
        raise ValueError("TinyDsaSpec.mtp_layers: hpc_rl has no MTP layers with sparse attention yet; use 0")
    if spec.q_lora_rank is None:
        raise ValueError("TinyDsaSpec.q_lora_rank: DeepseekV32 needs a q latent (its indexer reads it)")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = DeepseekV32Config(
        **mla_config_fields(spec, tokenizer),
        first_k_dense_replace=spec.dense_layers, index_n_heads=spec.index_n_heads,
        index_head_dim=spec.index_head_dim, index_topk=spec.index_topk)
    torch.manual_seed(spec.seed)
    model = DeepseekV32ForCausalLM(config).to(torch.float32)
    randomize_moe(model, spec)
    randomize_indexer(model, spec)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def make_tiny(output_dir: str | Path, spec: TinyDsaSpec | None = None, **spec_fields: Any) -> Path:
    """The deepseek_v32 family's `make_tiny` hook."""
    return make_tiny_dsa_model(output_dir, spec_of(TinyDsaSpec, spec, spec_fields))
