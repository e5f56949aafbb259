"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): multi-latent attention with DeepSeek Sparse Attention (a lightning
indexer picks the top-k keys each query attends to), on DeepSeek-V3's MoE.

Modules: `config_rules` (config.json's index_* keys, architecture rules), `hf_names` (deepseek_v3's MLA rows plus
the indexer's, and the indexer's head layout between HF and Megatron), `tiny` (tiny random checkpoints), `layers`
(Megatron's DSAttention / DSAIndexer in the MLA layer), `layers_dsa` (their CPU twins: the Hadamard rotation and
packed samples).
"""

from hpc_rl.models.registry import ModelFamily, lazy_hook

FAMILY = ModelFamily(
    name="deepseek_v32",
    hf_model_types=("deepseek_v32",),
    hf_architectures=("DeepseekV32ForCausalLM",),
    moe=True,
    mla=True,
    description="DeepSeek-V3.2 (-Exp): MLA with DeepSeek Sparse Attention",
    hf_defaults={"scoring_func": "sigmoid", "e_score_correction_bias": True, "norm_topk_prob": True,
                 "n_shared_experts": 1, "first_k_dense_replace": 3},
    check_config=lazy_hook("hpc_rl.models.deepseek_v32.config_rules:check_config"),
    architecture_problem=lazy_hook("hpc_rl.models.deepseek_v32.config_rules:architecture_problem"),
    hf_layer_rows=lazy_hook("hpc_rl.models.deepseek_v32.hf_names:layer_rows"),
    to_megatron=lazy_hook("hpc_rl.models.deepseek_v32.hf_names:to_megatron"),
    to_hf=lazy_hook("hpc_rl.models.deepseek_v32.hf_names:to_hf"),
    layer_spec=lazy_hook("hpc_rl.models.deepseek_v32.layers:layer_spec"),
    make_tiny=lazy_hook("hpc_rl.models.deepseek_v32.tiny:make_tiny"),
    cpu_engine_cache="batched_states",  # transformers' DSA layers keep the indexer's keys beside the latent cache
)
