"""The adapter-only weight sync of a LoRA run (issue 33), as requests to SGLang 0.5.23's LoRA endpoints: the parts
that do not depend on a transport's plumbing.

Owns: which way a run's adapters reach the engines (`adapter_transport`: none with lora_train_only, tensors with
lora_sync_from_tensor or colocated engines, else a PEFT directory on the shared filesystem), the name each synced
version is served under (`adapter_name`: the engines hold the new version beside the old until no request uses the
old), the bodies of `/load_lora_adapter`, `/load_lora_adapter_from_tensors`, `/unload_lora_adapter` and the
`lora_path` field a rollout's `/generate` carries, and the bytes one sync moves (`adapter_bytes`). Engines start
from the HF checkpoint with `--enable-lora` and keep the base; only colocated engines whose memory saver discarded
it get it again (`controller.transports.lora_tensor`, unless lora_base_cpu_backup).

The two ways (`controller.transports.lora` and `lora_tensor`, each with its trainer half in `training.transports`):
a PEFT directory in the run dir loaded with /load_lora_adapter (decoupled engines), or the tensors themselves with
/load_lora_adapter_from_tensors (`load_from_tensors_request`; colocated engines, `--colocate`, which implies it).

/load_lora_adapter_from_tensors's body (SGLang 0.5.23, io_struct.LoadLoRAAdapterFromTensorsReqInput):
`{lora_name, config_dict (the PEFT adapter_config as JSON), serialized_named_tensors (one entry per engine TP rank,
each base64 of SGLang's MultiprocessingSerializer, a ForkingPickler dump of a dict name -> tensor; every rank gets
the whole adapter and slices it itself), load_format (None | "flattened_bucket"), pinned, added_tokens_config,
lora_id, expected_checksums}`. The same kind of body as /update_weights_from_tensor's: on GPUs the tensors pickle as
CUDA IPC handles, so it reaches only an engine on the sender's node, behind the engine's key (the one pickle hpc_rl
lets through, as for colocated weight updates; hpc_rl never unpickles). On CPU hpc_rl's engine takes a shared-memory
descriptor in each entry (`weights.colocated`) and refuses a pickle.
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


def adapter_transport(lora: LoraConfig, *, colocate: bool = False) -> str:
    """none (lora_train_only: the engines keep the frozen base) | tensor (lora_sync_from_tensor, or colocated
    engines: /load_lora_adapter_from_tensors) | disk (a PEFT directory and /load_lora_adapter)."""
    if lora.lora_train_only:
        return "none"
    return "tensor" if lora.lora_sync_from_tensor or colocate else "disk"


def adapter_name(version: int) -> str:
    """The name the engines serve weight version `version`'s adapter under."""
    return f"{ADAPTER_PREFIX}-v{version}"


def adapter_directory(run_dir: str | Path, version: int) -> Path:
    """Where the disk transport writes version `version`'s PEFT directory."""
    return Path(run_dir) / "adapters" / adapter_name(version)


def load_request(version: int, directory: str | Path) -> dict[str, Any]:
    """The body of `/load_lora_adapter` for a PEFT directory."""
    return {"lora_name": adapter_name(version), "lora_path": str(directory)}


def load_from_tensors_request(name: str, config_dict: Mapping[str, Any], shares: list[str]) -> dict[str, Any]:
    """The body of `/load_lora_adapter_from_tensors`: `shares` one serialized adapter per engine TP rank."""
    if not shares:
        raise ValueError("load_lora_adapter_from_tensors needs one serialized adapter per engine TP rank")
    return {"lora_name": name, "config_dict": dict(config_dict), "serialized_named_tensors": list(shares),
            "load_format": None}


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
