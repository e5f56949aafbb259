"""A PEFT LoRA adapter merged into its base's HF weights: the merged model transformers loads without PEFT.

Owns: `merge_adapter` (each adapted projection's weight W becomes W + (alpha / r) * B @ A, PEFT's `merge_and_unload`
for plain LoRA without fan_in_fan_out; computed in float32 and cast back to W's dtype), reading a PEFT adapter
directory's tensors and scale (`read_adapter`) and an HF directory's (`read_hf_weights`). Used by `--save-hf-merged`
(`training.hf_save`) and the converters (`training.convert`: tools/convert_torch_dist_to_hf.py --merge-lora,
tools/merge_lora_adapter.py). Does not own the adapter's names (`peft_files`) nor writing HF directories.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."
MATRICES = (".lora_A.weight", ".lora_B.weight")


def adapter_scale(config: Mapping[str, object], where: str) -> float:
    """alpha / r of a PEFT adapter_config (plain LoRA only: rsLoRA, DoRA and modules_to_save are refused)."""
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("use_rslora") \
            or config.get("modules_to_save") or config.get("fan_in_fan_out"):
        raise ValueError(f"{where}: only plain LoRA adapters merge here (no DoRA, rsLoRA, fan_in_fan_out or "
                         "modules_to_save)")
    rank = int(config.get("r", 0))  # type: ignore[call-overload]
    if rank <= 0:
        raise ValueError(f"{where}: adapter_config r={rank} must be > 0")
    return float(config.get("lora_alpha", rank)) / rank  # type: ignore[arg-type]


def merge_adapter(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], scale: float, *,
                  where: str = "adapter") -> dict[str, torch.Tensor]:
    """`base` (HF names) with every adapted weight replaced by W + scale * B @ A; the other tensors as they are."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.items():
        suffix = next((s for s in MATRICES if key.endswith(s)), None)
        if suffix is None or not key.startswith(PEFT_PREFIX):
            raise ValueError(f"{where}: {key!r} is not a PEFT LoRA matrix (base_model.model.<module>.lora_A.weight)")
        pairs.setdefault(key[len(PEFT_PREFIX):-len(suffix)] + ".weight", {})[suffix[1:7]] = tensor
    merged = dict(base)
    for weight_name, pair in pairs.items():
        if weight_name not in base:
            raise ValueError(f"{where}: the base has no {weight_name} (the adapter was trained on another model)")
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{where}: {weight_name} has only {sorted(pair)}")
        weight, a, b = base[weight_name], pair["lora_A"], pair["lora_B"]
        if a.shape[1] != weight.shape[1] or b.shape[0] != weight.shape[0] or a.shape[0] != b.shape[1]:
            raise ValueError(f"{where}: {weight_name} {tuple(weight.shape)} does not fit A {tuple(a.shape)} / "
                             f"B {tuple(b.shape)}")
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
        merged[weight_name] = (weight.to(torch.float32) + delta).to(weight.dtype)
    return merged


def read_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], float]:
    """A PEFT adapter directory's tensors and its scale alpha / r."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_file, weights = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise ValueError(f"{directory}: not a PEFT adapter directory (adapter_config.json and "
                         "adapter_model.safetensors expected)")
    return load_file(str(weights)), adapter_scale(json.loads(config_file.read_text()), str(directory))


def read_hf_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory's safetensors files."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files (an HF checkpoint directory expected)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state
