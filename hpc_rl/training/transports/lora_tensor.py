"""The LoRA tensor transport's trainer half (issue 33): every rank gathers the actor's adapter (TP shards whole,
PEFT's names, `training.lora.peft_files.adapter_state_dict`); the rank on each engine's TP rank 0 posts it once to
that engine's /load_lora_adapter_from_tensors, one copy per engine TP rank (SGLang slices it per rank itself): CUDA
IPC handles of the rank's own tensors on GPU, a shared-memory bucket on CPU (`weights.colocated`). The base is not
sent here (the controller sends it with a ColocatedSyncCommand when the engines dropped it). Its controller half:
`hpc_rl.controller.transports.lora_tensor`."""

from __future__ import annotations

from typing import Any

import torch

from hpc_rl.config.sections.training import CheckpointConfig
from hpc_rl.protocol.messages import LoraTensorCommand
from hpc_rl.training.offload import TrainerOffload
from hpc_rl.training.transports.base import TransportRank, export_dtype
from hpc_rl.weights.colocated_sender import post_to_local_engine
from hpc_rl.weights.lora_sync import adapter_bytes, load_from_tensors_request


def post_adapter(url: str, body: dict[str, Any], *, api_key: str | None, timeout_s: float) -> None:
    """POST /load_lora_adapter_from_tensors (`post_to_local_engine`)."""
    post_to_local_engine(url, "load_lora_adapter_from_tensors", body, api_key=api_key, timeout_s=timeout_s)


class TrainerLoraTensor:
    """`sync` runs a LoraTensorCommand."""

    def __init__(self, rank: TransportRank, offload: TrainerOffload, checkpoint: CheckpointConfig, *,
                 engine_api_key: str | None) -> None:
        self.rank, self.offload, self.checkpoint, self.engine_api_key = rank, offload, checkpoint, engine_api_key

    def sync(self, command: LoraTensorCommand, *, timeout_s: float = 600.0) -> dict[str, Any]:
        from hpc_rl.training.lora.attach import adapter_settings
        from hpc_rl.training.lora.peft_files import adapter_config, adapter_state_dict
        from hpc_rl.weights.colocated import serialize_adapter_share
        from hpc_rl.weights.device_identity import trainer_rank_device

        info, actor = self.rank.info, self.rank.parts.actor
        if "weights" in self.offload.offloaded_tags:
            self.offload.require_onloaded("a LoRA adapter sync")
        lora = adapter_settings(actor)
        if lora is None:
            raise ValueError("LoraTensorCommand: the actor has no LoRA adapters (lora.lora_rank is 0): the controller "
                             "chose the lora_tensor transport for a run without LoRA")
        if len(command.rank_engines) != info.world_size:
            raise ValueError(f"LoraTensorCommand pairs {len(command.rank_engines)} trainer ranks with engines; there "
                             f"are {info.world_size}")
        dtype = export_dtype(info.on_cpu)
        state = {name: tensor.to(dtype).contiguous() for name, tensor in adapter_state_dict(actor).items()}
        engine, engine_rank = (int(x) for x in command.rank_engines[info.rank])
        engine_tp = sum(1 for paired, _ in command.rank_engines if int(paired) == engine)
        url = command.engine_urls[engine] if 0 <= engine < len(command.engine_urls) else ""
        if engine_rank == 0 and url:
            share, shared_memory = serialize_adapter_share(list(state.items()), device=trainer_rank_device())
            try:  # the tensors stay alive (and the bucket on disk) until the engine answered
                body = load_from_tensors_request(command.lora_name,
                                                 adapter_config(lora, self.checkpoint.hf_checkpoint or None),
                                                 [share] * engine_tp)
                post_adapter(url, body, api_key=self.engine_api_key, timeout_s=timeout_s)
            finally:
                if shared_memory is not None:
                    shared_memory.close()
                if torch.cuda.is_available():
                    torch.cuda.ipc_collect()  # GPU only: release the IPC handles the engine closed
        self.rank.engines_updated()
        return {"adapter_bytes": adapter_bytes(state)}
