"""gpt-oss's experts as the engines read them in a weight sync: each layer's experts fused, as released.

Owns the family's `fuse_for_engine` hook (`EXPERT_FUSION`): which synced HF tensors belong together (one layer's
per-expert tensors, `group_of`), the fused tensors' names and shapes for the sync plan (`fused_shapes`), and
building them from the gathered per-expert tensors (`fuse`). The sender (`hpc_rl.weights.engine_fusion`) plans
a layer's experts as one unit, so a bucket holds a whole layer's experts, and fuses them before packing.

Why (read in the installed sglang 0.5.23 wheel): GptOssForCausalLM.load_weights (sglang/srt/models/gpt_oss.py),
which both /update_weights_from_distributed (flattened bucket or per tensor) and /update_weights_from_tensor
(load_format null, as hpc_rl's colocated body) call with the received (name, tensor) pairs, as the checkpoint load
does, reads a bf16 model's experts only through `FusedMoE.make_expert_params_mapping_fused`: the names
`model.layers.L.mlp.experts.gate_up_proj` [E, H, 2I], `.gate_up_proj_bias` [E, 2I], `.down_proj` [E, I, H],
`.down_proj_bias` [E, H] (the HF release's bf16 layout: x @ W, gate in the even columns of 2I, up in the odd). It
transposes the two weights to [E, 2I, H] / [E, H, I] and hands each to `FusedMoE.weight_loader_fused` (shard ids
w13 / w2: every local expert at once, TP-narrowed on the 2I resp. I dimension, the interleave kept; the down bias
zeroed on MoE-TP ranks other than 0). A per-expert name (`mlp.experts.K.gate_proj.weight`) matches none of its
mappings and is skipped without a word. So the sync sends exactly the release's fused tensors: the engine's update
path is then its checkpoint-load path. Not covered: an engine serving the MXFP4 release (quantization_config
mxfp4): its load_weights reads experts only as `_blocks` / `_scales` (and the biases), so bf16 fused experts are
skipped there too (`hpc_rl.config.moe_checks` refuses that line). Not read as working: an SGLang engine with
expert parallelism (ep_size > 1): weight_loader_fused narrows by MoE-TP only and copies into all local experts,
so a fused [E, ...] tensor meets [E / ep, ...] (its checkpoint load meets the same; never run here).

Memory (sender rank 0, and each colocated rank): one layer's experts at a time, full size, twice (the gathered
per-expert tensors, then the fused copy; the per-expert ones are dropped once fused), beside the packed bucket:
gpt-oss-20b 32 experts x 3 x 2880 x 2880 x 2 B = 1.6 GB per copy, gpt-oss-120b (128 experts) 6.4 GB. A layer's
experts are one bucket whatever update_weight_buffer_size says (SGLang loads a fused tensor whole), so the
sender's two reused bucket buffers and the engine's receiving buffer are that big too (`largest_group_bytes`,
counted by `hpc_rl.config.memory_plan`). torch is
imported inside `fuse` (the family's pure tier: this module loads no torch on import).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ModelArchitecture = Any
"""`arch` is a `hpc_rl.config.model.ModelArchitecture` (not imported: config imports the registry's modules)."""

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


class ExpertFusion:
    """gpt-oss's `fuse_for_engine` hook: one layer's per-expert HF tensors <-> its fused ones."""

    def group_of(self, hf_name: str) -> str | None:
        """The fused unit `hf_name` belongs to (its layer's `model.layers.L.mlp.experts`), None if it is synced as
        it is."""
        match = _PER_EXPERT.match(hf_name)
        return match.group(1) if match else None

    def fused_shapes(self, group: str, entries: Sequence[tuple[str, Sequence[int]]]
                     ) -> list[tuple[str, tuple[int, ...]]]:
        """The fused (name, shape)s of one layer from its per-expert (name, shape)s (all its experts)."""
        shapes = {name: tuple(shape) for name, shape in entries}
        experts = _expert_count(group, shapes)
        inner, hidden = shapes[f"{group}.0.gate_proj.weight"]
        out = [(f"{group}.gate_up_proj", (experts, hidden, 2 * inner)),
               (f"{group}.down_proj", (experts, inner, hidden))]
        if f"{group}.0.gate_proj.bias" in shapes:
            out += [(f"{group}.gate_up_proj_bias", (experts, 2 * inner)),
                    (f"{group}.down_proj_bias", (experts, hidden))]
        return out

    def fuse(self, group: str, named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """One layer's fused tensors (`fused_shapes` order) from all its gathered per-expert tensors; each fused
        tensor is allocated once and filled expert by expert (no stacked intermediates)."""
        import torch

        tensors = dict(named)
        experts = _expert_count(group, {name: tuple(t.shape) for name, t in tensors.items()})
        gate = tensors[f"{group}.0.gate_proj.weight"]
        inner, hidden = gate.shape
        gate_up = torch.empty((experts, hidden, 2 * inner), dtype=gate.dtype, device=gate.device)
        down = torch.empty((experts, inner, hidden), dtype=gate.dtype, device=gate.device)
        for expert in range(experts):
            gate_up[expert, :, 0::2] = tensors[f"{group}.{expert}.gate_proj.weight"].t()
            gate_up[expert, :, 1::2] = tensors[f"{group}.{expert}.up_proj.weight"].t()
            down[expert] = tensors[f"{group}.{expert}.down_proj.weight"].t()
        out = [(f"{group}.gate_up_proj", gate_up), (f"{group}.down_proj", down)]
        if f"{group}.0.gate_proj.bias" in tensors:
            bias = tensors[f"{group}.0.gate_proj.bias"]
            gate_up_bias = torch.empty((experts, 2 * inner), dtype=bias.dtype, device=bias.device)
            down_bias = torch.empty((experts, hidden), dtype=bias.dtype, device=bias.device)
            for expert in range(experts):
                gate_up_bias[expert, 0::2] = tensors[f"{group}.{expert}.gate_proj.bias"]
                gate_up_bias[expert, 1::2] = tensors[f"{group}.{expert}.up_proj.bias"]
                down_bias[expert] = tensors[f"{group}.{expert}.down_proj.bias"]
            out += [(f"{group}.gate_up_proj_bias", gate_up_bias), (f"{group}.down_proj_bias", down_bias)]
        return out


    def largest_group_bytes(self, arch: ModelArchitecture, itemsize: int) -> int:
        """Bytes of one layer's fused experts (weights and biases) at `itemsize` bytes a value: the smallest
        bucket a sync of this model can have."""
        experts, hidden = int(arch.num_moe_experts or 0), arch.hidden_size
        inner = arch.moe_ffn_hidden_size or arch.ffn_hidden_size
        return experts * (3 * hidden * inner + 2 * inner + hidden) * itemsize


def _expert_count(group: str, shapes: dict[str, tuple[int, ...]]) -> int:
    """The layer's expert count; every expert 0..E-1 must have all of its tensors."""
    experts = {int(match.group(2)) for name in shapes if (match := _PER_EXPERT.match(name))}
    count = max(experts) + 1 if experts else 0
    kinds = {name.split(".", 6)[-1] for name in shapes if name.startswith(f"{group}.0.")}
    missing = [f"{group}.{e}.{kind}" for e in range(count) for kind in kinds if f"{group}.{e}.{kind}" not in shapes]
    if not count or missing or set(experts) != set(range(count)):
        raise ValueError(f"{group}: fusing a layer's experts needs every expert's tensors; missing "
                         f"{missing[:3] or 'all'} (a layer's experts must be gathered together)")
    return count


EXPERT_FUSION = ExpertFusion()
