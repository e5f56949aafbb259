"""The glm4_moe family's tiny checkpoint (`make_tiny` hook): a random Glm4MoeForCausalLM (GLM-4.5) with decisive
routers, a shared expert, q/k/v bias and half rotary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_rl.models.tiny_checkpoint import TinyMoeSpec, build_tokenizer, config_fields, save_random_moe, spec_of


def make_tiny(output_dir: str | Path, spec: TinyMoeSpec | None = None, **spec_fields: Any) -> Path:
    """Write a randomly initialised tiny GLM-4.5 MoE checkpoint + the tiny tokenizer; return it."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    spec = spec_of(TinyMoeSpec, spec, {"family": "glm4_moe", **spec_fields} if spec is None else {})
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Glm4MoeConfig(**config_fields(spec, tokenizer), moe_intermediate_size=spec.moe_intermediate_size,
                           num_experts_per_tok=spec.num_experts_per_tok, norm_topk_prob=True,
                           n_routed_experts=spec.num_experts, n_shared_experts=spec.n_shared_experts,
                           first_k_dense_replace=spec.dense_layers, routed_scaling_factor=spec.routed_scaling_factor,
                           n_group=1, topk_group=1, attention_bias=True, use_qk_norm=False, partial_rotary_factor=0.5,
                           rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta,
                                            "partial_rotary_factor": 0.5})
    save_random_moe(Glm4MoeForCausalLM, config, spec, tokenizer, output_dir)
    return output_dir
