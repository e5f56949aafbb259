"""The released Qwen3-VL checkpoints' config.json shapes (Qwen3-VL-8B-Instruct, Qwen3-VL-30B-A3B-Instruct).

Owns: `RELEASES` (config.json dicts with the public configs' numbers; written here because nothing can be downloaded:
text model, vision tower and token ids as the Hub files give them, in transformers 4.57's spelling,
`rope_scaling` + `rope_theta`, as the released files are). What one weight sync of them moves:
`hpc_rl.weights.vl_sync_bytes`; the numbers: docs/vision-language.md.
"""

from __future__ import annotations

from typing import Any

_TEXT_COMMON = dict(attention_bias=False, head_dim=128, hidden_act="silu", max_position_embeddings=262144,
                    num_attention_heads=32, rms_norm_eps=1e-6, rope_theta=5_000_000, vocab_size=151936,
                    rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    bos_token_id=151643, eos_token_id=151645)
_VISION_COMMON = dict(deepstack_visual_indexes=[8, 16, 24], depth=27, hidden_act="gelu_pytorch_tanh", hidden_size=1152,
                      in_channels=3, intermediate_size=4304, num_heads=16, num_position_embeddings=2304,
                      patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
               vision_end_token_id=151653, tie_word_embeddings=False)

RELEASES: dict[str, dict[str, Any]] = {
    "Qwen3-VL-8B-Instruct": dict(
        architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl", **_TOKENS,
        text_config=dict(_TEXT_COMMON, model_type="qwen3_vl_text", hidden_size=4096, intermediate_size=12288,
                         num_hidden_layers=36, num_key_value_heads=8),
        vision_config=dict(_VISION_COMMON, model_type="qwen3_vl", out_hidden_size=4096)),
    "Qwen3-VL-30B-A3B-Instruct": dict(
        architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe", **_TOKENS,
        text_config=dict(_TEXT_COMMON, model_type="qwen3_vl_moe_text", hidden_size=2048, intermediate_size=6144,
                         moe_intermediate_size=768, num_hidden_layers=48, num_key_value_heads=4, num_experts=128,
                         num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
        vision_config=dict(_VISION_COMMON, model_type="qwen3_vl_moe", out_hidden_size=2048)),
}
