"""Multi-latent attention on MoE: DeepseekV3ForCausalLM (DeepSeek-V3/R1, Kimi-K2, Moonlight) and
Glm4MoeLiteForCausalLM (GLM-4.7-Flash): the same layers and names, different HF model_type, so one folder.

Config rules: `hpc_rl.models.mla` (shared MLA/YaRN/MTP rules) and the routing defaults below; names:
`hf_names` (MLA attention rows, MTP layers); layers: `layers` (Megatron's MLA spec and its CPU twins); tiny
checkpoints: `tiny`.
"""

from hpc_rl.models.deepseek_v3.hf_names import layer_rows, mtp_rows
from hpc_rl.models.registry import ModelFamily, lazy_hook

_ROUTING = {"scoring_func": "sigmoid", "e_score_correction_bias": True, "norm_topk_prob": True,
            "n_shared_experts": 1}
_LAYERS = lazy_hook("hpc_rl.models.deepseek_v3.layers:layer_spec")

FAMILIES = (
    ModelFamily(
        name="deepseek_v3",
        hf_model_types=("deepseek_v3",),
        hf_architectures=("DeepseekV3ForCausalLM",),
        moe=True,
        mla=True,
        description="DeepSeek-V3/R1, Kimi-K2, Moonlight",
        hf_defaults={**_ROUTING, "first_k_dense_replace": 3},
        hf_layer_rows=layer_rows,
        hf_extra_rows=mtp_rows,
        layer_spec=_LAYERS,
        make_tiny=lazy_hook("hpc_rl.models.deepseek_v3.tiny:make_tiny_deepseek_v3"),
    ),
    ModelFamily(
        name="glm4_moe_lite",
        hf_model_types=("glm4_moe_lite",),
        hf_architectures=("Glm4MoeLiteForCausalLM",),
        moe=True,
        mla=True,
        description="GLM-4.7-Flash",
        hf_defaults={**_ROUTING, "first_k_dense_replace": 1},
        hf_layer_rows=layer_rows,
        hf_extra_rows=mtp_rows,
        layer_spec=_LAYERS,
        make_tiny=lazy_hook("hpc_rl.models.deepseek_v3.tiny:make_tiny_glm4_moe_lite"),
    ),
)
