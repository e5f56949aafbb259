"""The released Qwen3-VL checkpoints' config.json shapes (Qwen3-VL-8B-Instruct, Qwen3-VL-30B-A3B-Instruct), and what
one weight sync of them moves, computed on the meta device.

Owns: `RELEASES` (config.json dicts with the public configs' numbers; written here because nothing can be downloaded:
text model, vision tower and token ids as the Hub files give them, in transformers 4.57's spelling,
`rope_scaling` + `rope_theta`, as the released files are), and `sync_bytes` (builds transformers' model of a config
on the meta device, checks that hpc_rl's name map names exactly its tensors, the MoE experts per expert, and sums
the bytes a bf16 sync sends: the language model, the vision tower (blocks, patch embed, position grid), the merger
and the deepstack mergers). Used by benchmarks/bench_vl_sync_bytes.py and its unit test; docs/vision-language.md
holds the numbers.
"""

from __future__ import annotations

import copy
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


def _meta_hf_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """transformers' model of `hf` on the meta device: {HF tensor name: shape}, fused experts split per expert."""
    import torch
    from transformers import (Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLMoeConfig,
                              Qwen3VLMoeForConditionalGeneration)

    keys = copy.deepcopy({k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    text = keys["text_config"]
    text["rope_parameters"] = {**text.pop("rope_scaling"), "rope_theta": text.pop("rope_theta")}
    keys["vision_config"].pop("model_type")
    moe = hf["model_type"] == "qwen3_vl_moe"
    config = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(**keys)
    with torch.device("meta"):
        model = (Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration)(config)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # in memory: [E, out, in]
            experts, out, inner = tensor.shape
            prefix = name.rsplit(".", 1)[0] + "."
            for g in range(experts):
                if name.endswith("gate_up_proj"):
                    shapes[f"{prefix}{g}.gate_proj.weight"] = (out // 2, inner)
                    shapes[f"{prefix}{g}.up_proj.weight"] = (out // 2, inner)
                else:
                    shapes[f"{prefix}{g}.down_proj.weight"] = (out, inner)
        else:
            shapes[name] = tuple(tensor.shape)
    return shapes


def sync_bytes(hf: dict[str, Any], itemsize: int = 2) -> dict[str, int]:
    """Bytes one weight sync of `hf`'s model moves in a dtype of `itemsize` bytes, by part: language_model
    (embedding, layers, norm, lm_head; of which routed_experts), vision_blocks (tower without the mergers),
    merger, deepstack_mergers, and total. Refuses when hpc_rl's name map and transformers' tensors differ."""
    import math

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.models.qwen3_vl.names import architecture_fields_from_hf
    from hpc_rl.weights import hf_mapping

    shapes = _meta_hf_shapes(hf)
    arch = ModelArchitecture(**architecture_fields_from_hf(hf))
    mapped = [name for _, names in hf_mapping.name_map(arch) for name in names]
    if sorted(mapped) != sorted(shapes):
        extra, missing = sorted(set(mapped) - set(shapes)), sorted(set(shapes) - set(mapped))
        raise ValueError(f"name map vs transformers' tensors: only mapped {extra[:4]}, only in the model {missing[:4]}")
    parts = dict(language_model=0, routed_experts=0, vision_blocks=0, merger=0, deepstack_mergers=0)
    for name, shape in shapes.items():
        size = math.prod(shape) * itemsize
        if name.startswith("model.visual.deepstack_merger_list."):
            parts["deepstack_mergers"] += size
        elif name.startswith("model.visual.merger."):
            parts["merger"] += size
        elif name.startswith("model.visual."):
            parts["vision_blocks"] += size
        else:
            parts["language_model"] += size
            if ".mlp.experts." in name:
                parts["routed_experts"] += size
    parts["total"] = parts["language_model"] + parts["vision_blocks"] + parts["merger"] + parts["deepstack_mergers"]
    return parts
