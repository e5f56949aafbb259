"""The hybrid linear-attention families: Qwen3-Next, Qwen3.5 (dense) and Qwen3.5-MoE (also Qwen3.6's model type).

Three of every four layers are Gated DeltaNet linear attention (Megatron's GatedDeltaNet), the rest full attention
with an output gate; norms are zero-centred (1 + w), a quarter of each head is rotated, the MoE layer's shared
expert is gated. Modules: `config_rules` (config.json check, architecture rules), `names` (HF <-> Megatron rows and
layouts), `tiny` (tiny random checkpoints), `layers` (the Megatron layer specs), `layers_gdn` (Megatron's
GatedDeltaNet on CPU and over packed samples), `gdn_kernels` (the CPU twins of fla's and causal-conv1d's kernels),
`vlm_layout` (Qwen3.5's vision-language releases: the text tower read and written, the vision tower passed through).
"""

from hpc_rl.models.registry import ModelFamily, lazy_hook

_HOOKS = dict(
    check_config=lazy_hook("hpc_rl.models.qwen3_next.config_rules:check_config"),
    architecture_problem=lazy_hook("hpc_rl.models.qwen3_next.config_rules:architecture_problem"),
    hf_layer_rows=lazy_hook("hpc_rl.models.qwen3_next.names:layer_rows"),
    to_megatron=lazy_hook("hpc_rl.models.qwen3_next.names:to_megatron"),
    to_hf=lazy_hook("hpc_rl.models.qwen3_next.names:to_hf"),
    layer_spec=lazy_hook("hpc_rl.models.qwen3_next.layers:layer_spec"),
    hf_reader=lazy_hook("hpc_rl.models.qwen3_next.vlm_layout:text_tower_reader"),
    hf_export=lazy_hook("hpc_rl.models.qwen3_next.vlm_layout:vlm_state"),
    cpu_engine_cache="batched_states",  # linear-attention layers keep conv and recurrent states, not keys/values
)
_DEFAULTS = {"use_qk_norm": True, "partial_rotary_factor": 0.25, "scoring_func": "softmax",
             "e_score_correction_bias": False}

FAMILIES = (
    ModelFamily(name="qwen3_next", hf_model_types=("qwen3_next",), hf_architectures=("Qwen3NextForCausalLM",),
                moe=True, description="Qwen3-Next (Qwen3-Next-80B-A3B): hybrid Gated DeltaNet, MoE with a gated "
                                      "shared expert",
                slime_spec=("slime_plugins.models.qwen3_next", "get_qwen3_next_spec"),
                hf_defaults={**_DEFAULTS, "norm_topk_prob": True, "sparse_step_layers": True},
                make_tiny=lazy_hook("hpc_rl.models.qwen3_next.tiny:make_tiny_qwen3_next"), **_HOOKS),
    ModelFamily(name="qwen3_5", hf_model_types=("qwen3_5_text", "qwen3_5"),
                hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
                description="Qwen3.5 dense (0.8B-27B; the text model of the vision-language release)",
                slime_spec=("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"),  # with --num-experts: qwen3_5_moe
                hf_defaults=_DEFAULTS,
                make_tiny=lazy_hook("hpc_rl.models.qwen3_next.tiny:make_tiny_qwen3_5"), **_HOOKS),
    ModelFamily(name="qwen3_5_moe", hf_model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
                hf_architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), moe=True,
                description="Qwen3.5-MoE and Qwen3.6 (35B-A3B, 397B-A17B): hybrid Gated DeltaNet, MoE with a gated "
                            "shared expert",
                hf_defaults={**_DEFAULTS, "norm_topk_prob": True},
                make_tiny=lazy_hook("hpc_rl.models.qwen3_next.tiny:make_tiny_qwen3_5_moe"), **_HOOKS),
)
