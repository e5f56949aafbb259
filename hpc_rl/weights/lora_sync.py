"""The adapter-only weight sync of a LoRA run (issue 33), as requests to SGLang 0.5.23's LoRA endpoints: the parts
that do not depend on a transport's plumbing.

Owns: which way a run's adapters reach the engines (`adapter_transport`: none with lora_train_only, tensors with
lora_sync_from_tensor, else a PEFT directory on the shared filesystem), the name each synced version is served under
(`adapter_name`: the engines hold the new version beside the old until no request uses the old), the bodies of
`/load_lora_adapter`, `/unload_lora_adapter` and the `lora_path` field a rollout's `/generate` carries, and the bytes
one sync moves (`adapter_bytes`). The base is never re-sent: engines start from the HF checkpoint with
`--enable-lora` and keep it.

Not wired yet (submit refuses LoRA with engines): the controller's transport interface (controller/weight_*.py,
another branch) calls, per sync, the trainer's `hf_save.save_hf_checkpoint` (a LoRA actor writes a PEFT directory,
`training.lora.peft_files`) into `adapter_directory(run_dir, version)`, then `load_request` on every engine, switches
the rollouts' `generate_fields`, and later `unload_request` for the version before; the CPU engine's half is
`engines.cpu.lora_serving` behind `engines.cpu.lora_routes`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_rl.config.lora import LoraConfig

if TYPE_CHECKING:  # torch-free at import: the controller's transport (controller.transports.lora) uses the names
    import torch

ADAPTER_PREFIX = "policy"
TRANSPORTS = ("none", "tensor", "disk")


def adapter_transport(lora: LoraConfig) -> str:
    """none (lora_train_only: the engines keep the frozen base) | tensor (lora_sync_from_tensor:
    /load_lora_adapter_from_tensors) | disk (a PEFT directory and /load_lora_adapter)."""
    if lora.lora_train_only:
        return "none"
    return "tensor" if lora.lora_sync_from_tensor else "disk"


def adapter_name(version: int) -> str:
    """The name the engines serve weight version `version`'s adapter under."""
    return f"{ADAPTER_PREFIX}-v{version}"


def adapter_directory(run_dir: str | Path, version: int) -> Path:
    """Where the disk transport writes version `version`'s PEFT directory."""
    return Path(run_dir) / "adapters" / adapter_name(version)


def load_request(version: int, directory: str | Path) -> dict[str, Any]:
    """The body of `/load_lora_adapter` for a PEFT directory."""
    return {"lora_name": adapter_name(version), "lora_path": str(directory)}


def unload_request(version: int) -> dict[str, Any]:
    """The body of `/unload_lora_adapter`."""
    return {"lora_name": adapter_name(version)}


def generate_fields(lora: LoraConfig, version: int | None) -> dict[str, Any]:
    """What a rollout's `/generate` body adds: the adapter of the weights it samples from (nothing before the first
    sync or when the engines serve the base)."""
    if version is None or adapter_transport(lora) == "none":
        return {}
    return {"lora_path": adapter_name(version)}


def adapter_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes one sync moves: the adapter's tensors, as sent (perf/weight_sync_bytes)."""
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())
