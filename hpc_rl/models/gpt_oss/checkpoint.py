"""gpt-oss checkpoints as released: fused experts, in bf16 or MXFP4, read under the per-expert names.

Owns: MXFP4 dequantisation (`dequantize_mxfp4`), splitting a layer's fused experts into the per-expert tensors
`hpc_rl.models.gpt_oss.names` maps (`unfuse_experts`) and back (`fuse_experts`), a reader that serves a
checkpoint's tensors under the per-expert names (`PerExpertReader`, used by `hpc_rl.weights.hf_import`), writing
them back in the released layout (`fused_state`, for the torch_dist -> HF converter and --save-hf: transformers
and SGLang read gpt-oss's experts fused only), and the same per-expert names as views into a loaded transformers
model's fused experts (`expert_views`, the CPU engine's weight updates by HF name).

On disk (transformers' GptOssForCausalLM and openai/gpt-oss-*):
  bf16:  model.layers.L.mlp.experts.gate_up_proj [E, H, 2I] (x @ W; gate = even columns, up = odd),
         gate_up_proj_bias [E, 2I] (same interleave), down_proj [E, I, H], down_proj_bias [E, H].
  MXFP4: gate_up_proj_blocks [E, 2I, H/32, 16] uint8 and gate_up_proj_scales [E, 2I, H/32] uint8 (rows are output
         features, interleaved as above), down_proj_blocks [E, H, I/32, 16] and down_proj_scales [E, H, I/32];
         the biases stay bf16. config.json's quantization_config says {"quant_method": "mxfp4", ...}.
MXFP4 (OCP microscaling): each byte holds two FP4 (E2M1) values, the low nibble first; each block of 32 values
shares one E8M0 scale byte s, the value's factor 2^(s - 127). E2M1 codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
8..15 the same negated. Dequantised to bf16 here, once, on import: the trainer trains bf16 weights (slime's
tools/preprocess_gpt_oss.py does the same offline). torch is imported inside the functions (a family's pure
modules load no torch on import: the registry's tier).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
MXFP4_BLOCK = 32
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def is_mxfp4(hf_config: dict[str, Any]) -> bool:
    """True when config.json says the experts are MXFP4 (openai/gpt-oss-20b and -120b as released)."""
    quant = hf_config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method not in (None, "mxfp4"):
        raise ValueError(f"config.json's quantization_config quant_method {method!r}: hpc_rl reads gpt-oss in bf16 "
                         f"or MXFP4 only; dequantise it first")
    return method == "mxfp4"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., G, 16] uint8 blocks and [..., G] uint8 scales -> [..., G * 32] values of `dtype` (bf16 by default)."""
    import torch

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected [..., G, 16] "
                         f"and [..., G]")
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack([low, high], dim=-1).flatten(-2)  # [..., G, 32]: low nibble first
    exponent = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype or torch.bfloat16)


def unfuse_experts(prefix: str, fused: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors from one layer's bf16 fused ones (`fused` keyed by gate_up_proj, gate_up_proj_bias,
    down_proj, down_proj_bias); `prefix` is `model.layers.L.mlp.experts`."""
    gate_up, down = fused["gate_up_proj"], fused["down_proj"]
    out = {}
    for expert in range(gate_up.shape[0]):
        out[f"{prefix}.{expert}.gate_proj.weight"] = gate_up[expert, :, 0::2].t().contiguous()
        out[f"{prefix}.{expert}.up_proj.weight"] = gate_up[expert, :, 1::2].t().contiguous()
        out[f"{prefix}.{expert}.down_proj.weight"] = down[expert].t().contiguous()
        if "gate_up_proj_bias" in fused:
            out[f"{prefix}.{expert}.gate_proj.bias"] = fused["gate_up_proj_bias"][expert, 0::2].contiguous()
            out[f"{prefix}.{expert}.up_proj.bias"] = fused["gate_up_proj_bias"][expert, 1::2].contiguous()
        if "down_proj_bias" in fused:
            out[f"{prefix}.{expert}.down_proj.bias"] = fused["down_proj_bias"][expert].contiguous()
    return out


def fuse_experts(prefix: str, per_expert: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """The inverse of `unfuse_experts`: one layer's fused bf16 tensors (names under `prefix`)."""
    import torch

    def stack(part: str, kind: str) -> torch.Tensor:
        return torch.stack([per_expert[f"{prefix}.{e}.{part}.{kind}"] for e in range(num_experts)])

    gate, up = stack("gate_proj", "weight"), stack("up_proj", "weight")  # [E, I, H]
    gate_up = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2).contiguous()  # rows g0 u0 g1 ..: [E, H, 2I]
    out = {f"{prefix}.gate_up_proj": gate_up,
           f"{prefix}.down_proj": stack("down_proj", "weight").transpose(1, 2).contiguous()}
    if f"{prefix}.0.gate_proj.bias" in per_expert:
        gate_b, up_b = stack("gate_proj", "bias"), stack("up_proj", "bias")
        out[f"{prefix}.gate_up_proj_bias"] = torch.stack([gate_b, up_b], dim=-1).flatten(-2).contiguous()
        out[f"{prefix}.down_proj_bias"] = stack("down_proj", "bias")
    return out


def fused_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (HF names) with every layer's per-expert tensors replaced by the layer's fused ones, in the order the
    layers' first expert tensor came; a layer must hold all its experts (E read off the highest index)."""
    layers: dict[str, int] = {}
    for name in state:
        match = _PER_EXPERT.match(name)
        if match:
            layers[match.group(1)] = max(layers.get(match.group(1), 0), int(match.group(2)) + 1)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _PER_EXPERT.match(name)
        if match is None:
            out[name] = tensor
        elif f"{match.group(1)}.gate_up_proj" not in out:
            prefix = match.group(1)
            out.update(fuse_experts(prefix, {k: v for k, v in state.items() if k.startswith(prefix + ".")},
                                    layers[prefix]))
    return out


def expert_views(prefix: str, experts: Any) -> dict[str, torch.Tensor]:
    """Per-expert names (under `prefix`, a GptOssExperts module's name) -> views into its fused tensors; writing a
    view writes the module's parameter (gate even / up odd columns of gate_up_proj, transposed)."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    views = {}
    for expert in range(gate_up.shape[0]):
        views[f"{prefix}.{expert}.gate_proj.weight"] = gate_up[expert, :, 0::2].t()
        views[f"{prefix}.{expert}.up_proj.weight"] = gate_up[expert, :, 1::2].t()
        views[f"{prefix}.{expert}.down_proj.weight"] = down[expert].t()
        views[f"{prefix}.{expert}.gate_proj.bias"] = experts.gate_up_proj_bias[expert, 0::2]
        views[f"{prefix}.{expert}.up_proj.bias"] = experts.gate_up_proj_bias[expert, 1::2]
        views[f"{prefix}.{expert}.down_proj.bias"] = experts.down_proj_bias[expert]
    return views


class PerExpertReader:
    """A checkpoint reader (`hf_import.HFTensorReader` or a dict) that also serves each layer's fused experts,
    bf16 or MXFP4, under the per-expert names; one layer's experts are split once and kept until another
    layer's are asked for (a rank reads one layer's experts in a row)."""

    def __init__(self, inner: Any, *, dtype: torch.dtype | None = None) -> None:
        self.inner = inner
        self.dtype = dtype
        self._layer: str | None = None
        self._experts: dict[str, torch.Tensor] = {}

    def _fused_layers(self) -> set[str]:
        return {match.group(1) for name in self.inner.keys() if (match := _FUSED.match(name))}

    def keys(self) -> list[str]:
        names = [name for name in self.inner.keys() if not _FUSED.match(name)]
        for prefix in sorted(self._fused_layers()):
            names += list(self._split(prefix))
        return names

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, name: str) -> bool:
        match = _PER_EXPERT.match(name)
        if match and match.group(1) in self._fused_layers():
            return name in self._split(match.group(1))
        return name in self.inner

    def __getitem__(self, name: str) -> torch.Tensor:
        match = _PER_EXPERT.match(name)
        if match and name not in self.inner:
            return self._split(match.group(1))[name]
        return self.inner[name]

    def _read(self, name: str) -> torch.Tensor:
        tensor = self.inner[name]
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def _split(self, prefix: str) -> dict[str, torch.Tensor]:
        if self._layer == prefix:
            return self._experts
        fused: dict[str, torch.Tensor] = {}
        for part in ("gate_up_proj", "down_proj"):
            if f"{prefix}.{part}" in self.inner:
                fused[part] = self._read(f"{prefix}.{part}")
            elif f"{prefix}.{part}_blocks" in self.inner:  # MXFP4: rows are output features; bf16 fused is x @ W
                weight = dequantize_mxfp4(self.inner[f"{prefix}.{part}_blocks"], self.inner[f"{prefix}.{part}_scales"],
                                          self.dtype)
                fused[part] = weight.transpose(1, 2)
            if f"{prefix}.{part}_bias" in self.inner:
                fused[f"{part}_bias"] = self._read(f"{prefix}.{part}_bias")
        if "gate_up_proj" not in fused or "down_proj" not in fused:
            raise KeyError(f"{prefix}: the checkpoint has neither gate_up_proj/down_proj nor their MXFP4 "
                           f"_blocks/_scales")
        self._layer, self._experts = prefix, unfuse_experts(prefix, fused)
        return self._experts


def read_released(reader: Any, hf_config: dict[str, Any]) -> PerExpertReader:
    """The family's `hf_reader` hook: a released checkpoint's fused (bf16 or MXFP4) experts under the per-expert
    names (another quantisation is refused with the reason)."""
    is_mxfp4(hf_config)
    return PerExpertReader(reader)


def released_state(state: Mapping[str, torch.Tensor], arch: Any, reference_dir: Any) -> dict[str, torch.Tensor]:
    """The family's `hf_export` hook: experts fused, as released (transformers and SGLang read no other layout)."""
    return fused_state(state)
