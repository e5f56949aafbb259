"""GLM-5 (GlmMoeDsaForCausalLM, config.json model_type glm_moe_dsa): DeepSeek-V3.2's multi-latent attention with
DeepSeek Sparse Attention on a DeepSeek-V3-style MoE, differing from it (transformers 5.24's modeling_glm_moe_dsa
against modeling_deepseek_v32) in three places:
  * its indexer rotates interleaved pairs of its first rotary dims (DeepSeek-V3.2's: half-split), so the converters
    permute the indexer's head dims differently (`hf_names`);
  * its indexer's key LayerNorm and MLA's q/kv latent norms keep eps 1e-6 while the model's norms use
    rms_norm_eps (1e-5): built at 1e-6 here (`layers`), Megatron's own use norm_epsilon;
  * IndexShare: layers whose `indexer_types` entry is "shared" reuse the previous full layer's top-k; Megatron's
    DSAttention always runs its own indexer, so such a config.json is refused (`config_rules`).
Everything else is deepseek_v32's (hpc_rl.models.deepseek_v32: names, DSAttention with its CPU twins, packed
samples, --freeze-indexer). Modules: `config_rules`, `hf_names`, `layers`, `tiny`.
"""

from hpc_rl.models.registry import ModelFamily, lazy_hook

FAMILY = ModelFamily(
    name="glm_moe_dsa",
    hf_model_types=("glm_moe_dsa",),
    hf_architectures=("GlmMoeDsaForCausalLM",),
    moe=True,
    mla=True,
    description="GLM-5 (glm_moe_dsa): MLA with DeepSeek Sparse Attention",
    hf_defaults={"scoring_func": "sigmoid", "e_score_correction_bias": True, "norm_topk_prob": True,
                 "n_shared_experts": 1, "first_k_dense_replace": 3},
    check_config=lazy_hook("hpc_rl.models.glm_moe_dsa.config_rules:check_config"),
    architecture_problem=lazy_hook("hpc_rl.models.deepseek_v32.config_rules:architecture_problem"),
    hf_layer_rows=lazy_hook("hpc_rl.models.deepseek_v32.hf_names:layer_rows"),
    to_megatron=lazy_hook("hpc_rl.models.glm_moe_dsa.hf_names:to_megatron"),
    to_hf=lazy_hook("hpc_rl.models.glm_moe_dsa.hf_names:to_hf"),
    layer_spec=lazy_hook("hpc_rl.models.glm_moe_dsa.layers:layer_spec"),
    make_tiny=lazy_hook("hpc_rl.models.glm_moe_dsa.tiny:make_tiny"),
    cpu_engine_cache="batched_states",  # transformers' DSA layers keep the indexer's keys beside the latent cache
)
