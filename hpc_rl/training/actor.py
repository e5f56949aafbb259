"""Assemble a trainer rank: actor (DDP + AdamW), frozen reference model, initial weights.

Owns: where the initial weights come from (slime's rules: `load` if it holds a checkpoint, else
`ref_load`, else `hf_checkpoint`; each of `load`/`ref_load` may be a torch_dist checkpoint or an HF
directory) and building the `RolloutTrainer`. Does not own the command loop (`__main__`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.schema import AlgorithmConfig, CheckpointConfig, OptimizerConfig, TrainingConfig
from hpc_rl.training import checkpoint
from hpc_rl.training.model_provider import build_gpt_model
from hpc_rl.training.optimizer import ActorOptimizer, wrap_ddp
from hpc_rl.training.parallel import ParallelInfo
from hpc_rl.training.step import RolloutTrainer
from hpc_rl.weights.hf_import import is_hf_checkpoint, load_hf_into_model


def load_weights(model: torch.nn.Module, source: str | Path, arch: ModelArchitecture, info: ParallelInfo,
                 *, model_file: str | Path | None = None) -> None:
    """Weights only, from an HF directory or a torch_dist checkpoint (any TP size)."""
    if is_hf_checkpoint(source):
        inner = model.module if hasattr(model, "module") else model
        load_hf_into_model(inner, source, arch, tp_rank=info.tp_rank, tp_size=info.tp_size,
                           model_file=model_file, expert_tp_rank=info.expert_tp_rank,
                           expert_tp_size=info.expert_tp_size)
    else:
        checkpoint.load_model_weights(source, model)


def _has_checkpoint(path: str | None) -> bool:
    return bool(path) and (is_hf_checkpoint(path) or checkpoint.latest_iteration(path) is not None
                           or Path(path, ".metadata").exists())


@dataclass
class TrainerParts:
    """What a trainer rank holds for a run."""

    actor: torch.nn.Module
    optimizer: ActorOptimizer
    ref_model: torch.nn.Module | None
    trainer: RolloutTrainer
    resumed: checkpoint.TrainerState | None


def build_trainer(*, arch: ModelArchitecture, training: TrainingConfig, algorithm: AlgorithmConfig,
                  optimizer_config: OptimizerConfig, checkpoints: CheckpointConfig, info: ParallelInfo,
                  model_file: str | Path | None = None, plugin_args: SimpleNamespace | None = None) -> TrainerParts:
    """Actor + optimizer (+ reference model when the KL loss or KL shaping needs one), loaded.
    `plugin_args`: the run's flat config for custom loss/advantage functions (default: these sections')."""
    device = "cpu" if info.on_cpu else "cuda"  # cluster.device, as init_parallel checked it
    if info.on_cpu:
        actor = wrap_ddp(build_gpt_model(arch, training))
        optimizer: ActorOptimizer = ActorOptimizer(actor, optimizer_config)
    else:  # Megatron's optimizer (GPU only; see optimizer_gpu)
        from hpc_rl.training.optimizer_gpu import MegatronActorOptimizer

        actor = wrap_ddp(build_gpt_model(arch, training, device=device), distributed_optimizer=True)
        optimizer = MegatronActorOptimizer(actor, optimizer_config, params_dtype=actor.config.params_dtype)  # type: ignore[assignment]
    resumed = None
    if _has_checkpoint(checkpoints.load) and not is_hf_checkpoint(checkpoints.load):
        resumed = checkpoint.load_checkpoint(checkpoints.load, actor, optimizer)
    else:
        source = next((p for p in (checkpoints.load, checkpoints.ref_load, checkpoints.hf_checkpoint)
                       if _has_checkpoint(p)), None)
        if source is None:
            raise FileNotFoundError("no initial weights: set checkpoint.load, checkpoint.ref_load or "
                                    "checkpoint.hf_checkpoint to an HF directory or a torch_dist checkpoint")
        load_weights(actor, source, arch, info, model_file=model_file)
    ref_model = None
    if algorithm.use_kl_loss or algorithm.kl_coef != 0.0:
        ref_source = next((p for p in (checkpoints.ref_load, checkpoints.hf_checkpoint) if _has_checkpoint(p)), None)
        if ref_source is None:
            raise FileNotFoundError("the KL term needs reference weights: set checkpoint.ref_load")
        ref_model = build_gpt_model(arch, training, device=device)
        load_weights(ref_model, ref_source, arch, info, model_file=model_file)
        ref_model.eval()
        for param in ref_model.parameters():
            param.requires_grad_(False)
    if resumed is not None:
        checkpoint.restore_rng_state(checkpoints.load)
    trainer = RolloutTrainer(actor=actor, optimizer=optimizer, ref_model=ref_model, arch=arch, training=training,
                             algorithm=algorithm, info=info, plugin_args=plugin_args)
    return TrainerParts(actor=actor, optimizer=optimizer, ref_model=ref_model, trainer=trainer, resumed=resumed)
