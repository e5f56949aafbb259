"""The vision-language families: Qwen3-VL (dense; Qwen3-VL-2B..32B) and Qwen3-VL-MoE (30B-A3B, 235B-A22B).

The language model is Qwen3's (Qwen3-MoE's) decoder from Megatron's layers with Qwen3-VL's interleaved multimodal
rotary positions and deepstack; the vision tower is transformers' `Qwen3VLVisionModel` inside the Megatron model.
Modules: `tiny` (tiny random checkpoints with processor files), `names` (config.json -> architecture, HF <-> Megatron
rows and layouts, the vision tower's and the fused experts' included), `vision` (the tower, transformers' module),
`layers_rope` (M-RoPE position ids and the interleaved rotary), `layers_model` (the Megatron model). Numbers and the
trainer's interface: docs/vision-language.md.
"""

from hpc_rl.models.registry import ModelFamily, lazy_hook

_HOOKS = dict(
    hf_extra_rows=lazy_hook("hpc_rl.models.qwen3_vl.names:vision_rows"),
    to_megatron=lazy_hook("hpc_rl.models.qwen3_vl.names:to_megatron"),
    to_hf=lazy_hook("hpc_rl.models.qwen3_vl.names:to_hf"),
    hf_text_prefix="model.language_model.",
    serves_images=True,
    model_class=lazy_hook("hpc_rl.models.qwen3_vl.layers_model:vl_model_class"),
)

FAMILIES = (
    ModelFamily(name="qwen3_vl", hf_model_types=("qwen3_vl",), hf_architectures=("Qwen3VLForConditionalGeneration",),
                description="Qwen3-VL dense (2B-32B): Qwen3 text model, M-RoPE, deepstack, a ViT tower",
                hf_defaults={"use_qk_norm": True},
                make_tiny=lazy_hook("hpc_rl.models.qwen3_vl.tiny:make_tiny_qwen3_vl"), **_HOOKS),
    ModelFamily(name="qwen3_vl_moe", hf_model_types=("qwen3_vl_moe",),
                hf_architectures=("Qwen3VLMoeForConditionalGeneration",), moe=True,
                description="Qwen3-VL-MoE (30B-A3B, 235B-A22B): Qwen3-MoE text model, M-RoPE, deepstack, a ViT tower",
                hf_defaults={"use_qk_norm": True, "scoring_func": "softmax", "e_score_correction_bias": False,
                             "norm_topk_prob": True, "n_shared_experts": 0, "sparse_step_layers": True},
                make_tiny=lazy_hook("hpc_rl.models.qwen3_vl.tiny:make_tiny_qwen3_vl_moe"),
                hf_reader=lazy_hook("hpc_rl.models.qwen3_vl.names:read_fused_experts"),
                hf_export=lazy_hook("hpc_rl.models.qwen3_vl.names:released_state"), **_HOOKS),
)
