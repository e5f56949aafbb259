"""The LoRA adapter transport's trainer half (issue 33): every rank takes part in writing only the actor's adapter
as a PEFT directory (adapter_config.json + adapter_model.safetensors; the TP shards gathered,
`training.lora.peft_files`), which the engines load by name with /load_lora_adapter. The base is never written.
Its controller half: `hpc_rl.controller.transports.lora` (the directory and name per version, the engines' loads
and unloads, the bytes moved)."""

from __future__ import annotations

from typing import Any

from hpc_rl.config.sections.training import CheckpointConfig
from hpc_rl.protocol.messages import LoraAdapterCommand
from hpc_rl.training.transports.base import TransportRank


def write_adapter(rank: TransportRank, command: LoraAdapterCommand, checkpoint: CheckpointConfig) -> dict[str, Any]:
    """The actor's adapter at `command.path` (its adapter_config names `checkpoint.hf_checkpoint` as the base)."""
    from hpc_rl.training.hf_save import save_hf_checkpoint
    from hpc_rl.training.lora.attach import adapter_settings

    actor = rank.parts.actor
    if adapter_settings(actor) is None:
        raise ValueError("LoraAdapterCommand: the actor has no LoRA adapters (lora.lora_rank is 0): the controller "
                         "chose the lora transport for a run without LoRA")
    path = save_hf_checkpoint(actor, rank.arch, command.path, reference_dir=checkpoint.hf_checkpoint or None,
                              info=rank.info, tp_group=rank.parts.trainer.tp_group)
    rank.engines_updated()
    return {"path": str(path)}
