"""The disk transport's trainer half (slime's --update-weight-transport disk): every rank takes part in writing
the weights as an HF directory the engines load, then the post-write hook runs. Its controller half:
`hpc_rl.controller.transports.disk` (the directory per version, the engines' loads, removing old versions)."""

from __future__ import annotations

from typing import Any

from hpc_rl.config.sections.training import CheckpointConfig
from hpc_rl.protocol.messages import DiskWeightsCommand
from hpc_rl.training.transports.base import TransportRank


def write_weights(rank: TransportRank, command: DiskWeightsCommand, checkpoint: CheckpointConfig) -> dict[str, Any]:
    """The weights at `command.path` (side files from `checkpoint.hf_checkpoint`), then the post-write hook."""
    from hpc_rl.training.hf_save import save_hf_checkpoint

    trainer = rank.parts.trainer
    path = save_hf_checkpoint(rank.parts.actor, rank.arch, command.path, reference_dir=checkpoint.hf_checkpoint or None,
                              info=rank.info, tp_group=trainer.tp_group, fp8=rank.engine_fp8)
    hook_path = getattr(trainer.plugin_args, "custom_update_weight_post_write_path", None)
    if hook_path:
        from hpc_rl.plugins import load_plugin

        load_plugin("update_weight_post_write", hook_path)(trainer.plugin_args, str(path), list(command.engine_urls))
    rank.engines_updated()
    return {"path": str(path)}
