"""Qwen3-MoE: Qwen3's attention with Megatron's MoE layer (softmax router, no shared expert, no expert bias;
dense layers from mlp_only_layers / decoder_sparse_step).

Layers: Megatron's GPT layer with its MoE MLP (`hpc_rl.training.layer_specs.gpt_layer_spec`); names: the shared
GQA and MoE rows (`hpc_rl.models.name_rows`).
"""

from hpc_rl.models.registry import ModelFamily, lazy_hook

FAMILY = ModelFamily(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    hf_architectures=("Qwen3MoeForCausalLM",),
    moe=True,
    description="Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B)",
    hf_defaults={"use_qk_norm": True, "scoring_func": "softmax", "e_score_correction_bias": False,
                 "norm_topk_prob": False, "n_shared_experts": 0, "sparse_step_layers": True},
    make_tiny=lazy_hook("hpc_rl.models.qwen3_moe.tiny:make_tiny"),
)
