"""What one weight sync of a Qwen3-VL release moves, computed on the meta device.

Owns: `sync_bytes` (builds transformers' model of a config.json on the meta device, checks that hpc_rl's name map
names exactly its tensors, the MoE experts per expert as the sync sends them, and sums the bytes a sync sends in a
dtype, by part: the language model, the vision tower's blocks, patch embed and position grid, the merger and the
deepstack mergers). The releases' configs: `hpc_rl.models.qwen3_vl.releases`; the numbers: docs/vision-language.md
(benchmarks/bench_vl_sync_bytes.py prints them).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.models.qwen3_vl.names import architecture_fields_from_hf
from hpc_rl.weights import hf_mapping


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
