"""GLM4 (dense, slime's `--spec slime_plugins.models.glm4 get_glm_spec`): sandwich norms (post_sublayer_norms),
half-split interleaved rotary, q/k/v bias, and one fused HF `mlp.gate_up_proj`.

Layers: Megatron's GPT layer with the post norms (`hpc_rl.training.layer_specs.gpt_layer_spec`); names: the
shared GQA rows, fc1 as one fused tensor (`fused_gate_up`).
"""

from hpc_rl.models.registry import ModelFamily, lazy_hook

FAMILY = ModelFamily(
    name="glm4",
    hf_model_types=("glm4",),
    hf_architectures=("Glm4ForCausalLM",),
    description="GLM-4 dense (GLM-4-9B-0414, GLM-Z1)",
    hf_defaults={"use_qk_norm": False, "partial_rotary_factor": 0.5},
    slime_spec=("slime_plugins.models.glm4", "get_glm_spec"),
    fused_gate_up=True,
    make_tiny=lazy_hook("hpc_rl.models.glm4.tiny:make_tiny"),
)
