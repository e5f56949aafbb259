"""Qwen3-VL's vision tower: transformers' `Qwen3VLVisionModel` built from config.json's vision_config.

Owns: `build_vision_tower` (used by the Megatron model, `layers_model`, and on the meta device by the name rows,
`names.vision_param_names`). Why transformers' module: megatron-core 0.16.1 has no Qwen3-VL tower (its
`models/vision` holds CLIP/RADIO ViTs and a LLaVA-style projector, not Qwen3-VL's patch embed with a learned
position grid resampled per image, 2-D rotary, 2x2 patch merger and deepstack mergers). The MoE release's tower is
the same module (transformers' Qwen3VLMoe vision model is this one under another name). Imports torch and
transformers inside the function (the family's pure tier imports this module's names lazily).
"""

from __future__ import annotations

from typing import Any

NOT_VISION_KEYS = ("model_type", "image_token_id", "mrope_section", "transformers_version")
"""Keys of hpc_rl's `vision_config` that are not the tower's (config.json's top level / text rope)."""


def build_vision_tower(vision_config: dict[str, Any], *, dtype: Any, device: Any) -> Any:
    """transformers' Qwen3-VL vision model of `vision_config` (config.json's vision_config), float weights in
    `dtype` on `device` (random: load the checkpoint after)."""
    import torch
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    keys = {k: v for k, v in vision_config.items() if k not in NOT_VISION_KEYS}
    config = Qwen3VLVisionConfig(**keys)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        tower = Qwen3VLVisionModel(config)
    return tower.to(dtype)
