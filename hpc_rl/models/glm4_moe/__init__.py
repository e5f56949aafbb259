"""GLM-4.5 MoE (Glm4MoeForCausalLM): sigmoid router with an expert bias, a shared expert, the first layers dense
(first_k_dense_replace), half rotary, q/k/v bias, no sandwich norms.

Layers: Megatron's GPT layer with its MoE MLP (`hpc_rl.training.layer_specs.gpt_layer_spec`); names: the shared
GQA and MoE rows (`hpc_rl.models.name_rows`).
"""

from hpc_rl.models.registry import ModelFamily, lazy_hook

FAMILY = ModelFamily(
    name="glm4_moe",
    hf_model_types=("glm4_moe",),
    hf_architectures=("Glm4MoeForCausalLM",),
    moe=True,
    description="GLM-4.5 / GLM-4.6 MoE",
    hf_defaults={"partial_rotary_factor": 0.5, "scoring_func": "sigmoid", "e_score_correction_bias": True,
                 "norm_topk_prob": True, "n_shared_experts": 1, "first_k_dense_replace": 1},
    make_tiny=lazy_hook("hpc_rl.models.glm4_moe.tiny:make_tiny"),
)
