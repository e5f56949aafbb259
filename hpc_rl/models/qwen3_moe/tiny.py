"""The qwen3_moe family's tiny checkpoint (`make_tiny` hook): a random Qwen3MoeForCausalLM with decisive routers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_rl.models.tiny_checkpoint import (
    TinyMoeSpec, build_tokenizer, config_fields, save_random_moe, spec_of, update_config_json,
)


def make_tiny(output_dir: str | Path, spec: TinyMoeSpec | None = None, **spec_fields: Any) -> Path:
    """Write a randomly initialised tiny Qwen3-MoE checkpoint + the tiny tokenizer; return it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    spec = spec_of(TinyMoeSpec, spec, {"family": "qwen3_moe", **spec_fields} if spec is None else {})
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(**config_fields(spec, tokenizer), moe_intermediate_size=spec.moe_intermediate_size,
                            num_experts_per_tok=spec.num_experts_per_tok, norm_topk_prob=True,
                            num_experts=spec.num_experts, mlp_only_layers=list(range(spec.dense_layers)),
                            decoder_sparse_step=1,
                            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta})
    save_random_moe(Qwen3MoeForCausalLM, config, spec, tokenizer, output_dir)
    # the Hub's key (Qwen3-30B-A3B), which transformers 4.x readers (SGLang) know
    saved = json.loads((output_dir / "config.json").read_text())
    update_config_json(output_dir, {"num_experts": saved.get("num_local_experts", spec.num_experts)},
                       drop=("num_local_experts",))
    return output_dir
