"""Tiny GLM-5 checkpoints (GlmMoeDsaForCausalLM): the tiny DeepSeek-V3.2's shape (hpc_rl.models.deepseek_v32.tiny:
MLA, an indexer of 4 heads of 16 dims choosing 4 keys, 2 layers with the first dense) written by transformers' GLM-5
class, with rms_norm_eps 1e-5 (GLM-5's; its indexer's key norm and MLA's latent norms stay at 1e-6) and every
layer's indexer "full".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_rl.models.deepseek_v3.tiny import mla_config_fields
from hpc_rl.models.deepseek_v32.tiny import TinyDsaSpec, randomize_indexer
from hpc_rl.models.tiny_checkpoint import build_tokenizer, randomize_moe, spec_of


@dataclass(kw_only=True)
class TinyGlm5Spec(TinyDsaSpec):
    family: str = "glm_moe_dsa"
    rms_norm_eps: float = 1e-5


def make_tiny(output_dir: str | Path, spec: TinyGlm5Spec | None = None, **spec_fields: Any) -> Path:
    """The glm_moe_dsa family's `make_tiny` hook: a randomly initialised tiny GLM-5 + the tiny tokenizer."""
    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    spec = spec_of(TinyGlm5Spec, spec, spec_fields)
    if spec.mtp_layers:
        raise ValueError("TinyGlm5Spec.mtp_layers: hpc_rl has no MTP layers with sparse attention yet; use 0")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = GlmMoeDsaConfig(**mla_config_fields(spec, tokenizer), first_k_dense_replace=spec.dense_layers,
                             index_n_heads=spec.index_n_heads, index_head_dim=spec.index_head_dim,
                             index_topk=spec.index_topk, indexer_types=["full"] * spec.num_hidden_layers)
    torch.manual_seed(spec.seed)
    model = GlmMoeDsaForCausalLM(config).to(torch.float32)
    randomize_moe(model, spec)
    randomize_indexer(model, spec)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
