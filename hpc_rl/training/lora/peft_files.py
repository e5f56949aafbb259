"""The adapters as PEFT's files: whole tensors under PEFT's HF names, `adapter_config.json`, and loading them back.

Owns: gathering each adapter matrix whole over TP (`adapter_state_dict`, every rank of the TP group takes part),
PEFT's names (`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`), the adapter_config.json a PEFT
`LoraConfig` reads (peft_type LORA, r, lora_alpha, lora_dropout, target_modules; no rsLoRA, no DoRA), writing
both (`save_peft_adapter`: adapter_model.safetensors + adapter_config.json, as PeftModel.save_pretrained does), and
loading a PEFT adapter directory into the adapters (`load_peft_adapter`, each rank taking its TP slice). With
lora_type lora one A is shared by a fused layer's slices: it is written once per HF projection (PEFT's layout), and
an adapter whose projections of one fused layer have different A's is refused on load (use canonical_lora).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_rl.config.lora import LoraConfig, target_projections
from hpc_rl.training.lora.adapter import LoraAdapter, adapters_of

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def peft_key(adapter: LoraAdapter, projection: str, matrix: str) -> str:
    """PEFT's saved name of one matrix (matrix: lora_A | lora_B)."""
    return f"{PEFT_PREFIX}{adapter.hf_prefix}.{projection}.{matrix}.weight"


def _whole(adapter: LoraAdapter, tensor: torch.Tensor, split_axis: int | None) -> torch.Tensor:
    if split_axis is None or adapter.tp_size == 1:
        return tensor.detach().clone()
    shards = [torch.empty_like(tensor) for _ in range(adapter.tp_size)]
    dist.all_gather(shards, tensor.detach().contiguous(), group=adapter.tp_group)
    return torch.cat(shards, dim=split_axis)


def adapter_state_dict(model: torch.nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every adapter matrix (or, with `grads`, its autograd gradient), whole, under PEFT's names (a collective over
    each TP group)."""
    out: dict[str, torch.Tensor] = {}

    def value(param: torch.nn.Parameter) -> torch.Tensor:
        return param.grad if grads else param

    for adapter in adapters_of(model):
        column = adapter.geometry.kind == "column"
        for projection in adapter.adapted:
            out[peft_key(adapter, projection, "lora_A")] = _whole(adapter, value(adapter.a_of(projection)),
                                                                  None if column else 1)
            out[peft_key(adapter, projection, "lora_B")] = _whole(adapter, value(adapter.lora_B[projection]),
                                                                  0 if column else None)
    return out


def adapter_config(lora: LoraConfig, base_model: str | None = None) -> dict[str, Any]:
    """PEFT's adapter_config.json for these settings."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.lora_rank, "lora_alpha": lora.lora_alpha, "lora_dropout": lora.lora_dropout,
            "target_modules": target_projections(lora), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "inference_mode": True}


def save_peft_adapter(model: torch.nn.Module, lora: LoraConfig, directory: str | Path, *,
                      base_model: str | None = None, write: bool = True) -> dict[str, torch.Tensor]:
    """Gather the adapters (every rank calls this) and, where `write`, write PEFT's two files into `directory`."""
    from safetensors.torch import save_file

    state = adapter_state_dict(model)
    if write:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(directory / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        (directory / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(lora, base_model), indent=2) + "\n")
    return state


def _read_adapter(directory: Path) -> dict[str, torch.Tensor]:
    weights = directory / ADAPTER_WEIGHTS
    if weights.is_file():
        from safetensors.torch import load_file

        return load_file(str(weights))
    legacy = directory / "adapter_model.bin"
    if legacy.is_file():
        return torch.load(legacy, map_location="cpu", weights_only=True)
    raise ValueError(f"lora.lora_adapter_path: {directory} has no {ADAPTER_WEIGHTS}: give a PEFT adapter directory")


def _slice(adapter: LoraAdapter, whole: torch.Tensor, axis: int | None, local: torch.Tensor, where: str) -> torch.Tensor:
    tp_rank = dist.get_rank(adapter.tp_group) if adapter.tp_size > 1 else 0
    if axis is not None and adapter.tp_size > 1:
        size = local.shape[axis]
        whole = whole.narrow(axis, tp_rank * size, size)
    if tuple(whole.shape) != tuple(local.shape):
        raise ValueError(f"lora.lora_adapter_path: {where} has shape {tuple(whole.shape)}, this model's adapter "
                         f"{tuple(local.shape)} on this rank: the adapter's rank r or the model differs")
    return whole


def load_peft_adapter(model: torch.nn.Module, directory: str | Path) -> None:
    """A PEFT adapter directory's matrices into the model's adapters (each rank its TP slice)."""
    directory = Path(directory)
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    state = _read_adapter(directory)
    scale = config.get("lora_alpha", 0) / max(1, config.get("r", 1))
    adapters = adapters_of(model)
    if adapters and abs(scale - adapters[0].scaling) > 1e-12:
        raise ValueError(f"lora.lora_adapter_path: {directory} has alpha/r {scale}, the run {adapters[0].scaling}: "
                         "give the adapter's --lora-rank and --lora-alpha")
    used = set()
    with torch.no_grad():
        for adapter in adapters:
            column = adapter.geometry.kind == "column"
            for projection in adapter.adapted:
                for matrix, axis in (("lora_A", None if column else 1), ("lora_B", 0 if column else None)):
                    key = peft_key(adapter, projection, matrix)
                    if key not in state:
                        raise ValueError(f"lora.lora_adapter_path: {directory} has no {key}: its target_modules "
                                         "differ from --target-modules")
                    local = adapter.a_of(projection) if matrix == "lora_A" else adapter.lora_B[projection]
                    value = _slice(adapter, state[key], axis, local, key)
                    if matrix == "lora_A" and adapter.shared_a and projection != adapter.adapted[0] \
                            and not torch.equal(value.to(local.dtype), local):
                        raise ValueError(f"lora.lora_adapter_path: {key} differs from {adapter.adapted[0]}'s A: the "
                                         "projections of one fused layer have their own A's (--lora-type "
                                         "canonical_lora)")
                    local.copy_(value)
                    used.add(key)
    unused = sorted(set(state) - used)
    if unused:
        raise ValueError(f"lora.lora_adapter_path: {directory} has matrices this run's adapters do not: {unused[:3]}"
                         f"{' ...' if len(unused) > 3 else ''} (its target_modules differ from --target-modules)")
