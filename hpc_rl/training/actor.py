"""Assemble a trainer rank: actor (DDP + AdamW), frozen reference model, initial weights; the training
modes' extra models: the on-policy-distillation teacher (opd_type megatron) and PPO's critic.

Owns: where the initial weights come from (slime's rules: `load` if it holds a checkpoint, else
`ref_load`, else `hf_checkpoint`; each of `load`/`ref_load` may be a torch_dist checkpoint or an HF
directory; `ref_ckpt_step` picks an iteration of `ref_load`; a checkpoint that saved an updated reference
restores it; the teacher from `opd_teacher_load`; the critic from its own checkpoint, else the actor's initial
weights with a fresh value head) and building the `RolloutTrainer`. Does not own the command loop (`__main__`).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.schema import (
    AlgorithmConfig, CheckpointConfig, CriticConfig, DistillationConfig, OptimizerConfig, TrainingConfig,
)
from hpc_rl.plugins import load_plugin
from hpc_rl.training import checkpoint
from hpc_rl.training.critic import critic_load_dir, critic_optimizer_config, install_value_head
from hpc_rl.training.custom_hooks import trainer_args
from hpc_rl.training.model_provider import build_gpt_model, check_moe_training
from hpc_rl.training.optimizer import ActorOptimizer, wants_distributed_optimizer, wrap_ddp
from hpc_rl.training.parallel import ParallelInfo
from hpc_rl.training.step import CriticPart, RolloutTrainer, skips_advantages
from hpc_rl.weights.hf_import import is_hf_checkpoint, load_hf_into_model


def load_weights(model: torch.nn.Module, source: str | Path, arch: ModelArchitecture, info: ParallelInfo,
                 *, model_file: str | Path | None = None, iteration: int | None = None) -> None:
    """Weights only, from an HF directory or a torch_dist checkpoint (any TP size; `iteration` of a root)."""
    if is_hf_checkpoint(source):
        if iteration is not None:
            raise ValueError(f"checkpoint.ref_ckpt_step {iteration}: {source} is an HF directory, not a torch_dist "
                             "root with iterations")
        inner = model.module if hasattr(model, "module") else model
        load_hf_into_model(inner, source, arch, tp_rank=info.tp_rank, tp_size=info.tp_size,
                           model_file=model_file, expert_tp_rank=info.expert_tp_rank,
                           expert_tp_size=info.expert_tp_size)
    else:
        checkpoint.load_model_weights(source, model, iteration)


def _has_checkpoint(path: str | None) -> bool:
    return bool(path) and (is_hf_checkpoint(path) or checkpoint.latest_iteration(path) is not None
                           or Path(path, ".metadata").exists())


def build_model(arch: ModelArchitecture, training: TrainingConfig, *, device: str = "cpu") -> torch.nn.Module:
    """This rank's stage of the model: hpc_rl's GPTModel, or what slime's --custom-model-provider-path builds,
    `fn(pre_process, post_process, vp_stage=None)` (a Megatron GPTModel whose parameter names hpc_rl's weight
    mapping knows: the same layers, another construction)."""
    if not training.custom_model_provider_path:
        return build_gpt_model(arch, training, device=device)
    from megatron.core import parallel_state

    provider = load_plugin("model_provider", training.custom_model_provider_path)
    stages = training.pipeline_model_parallel_size > 1
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True) if stages else True
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True) if stages else True
    kwargs = {"vp_stage": None} if "vp_stage" in inspect.signature(provider).parameters else {}
    return provider(pre_process=first, post_process=last, **kwargs)


def freeze_parameters(model: torch.nn.Module, training: TrainingConfig) -> torch.nn.Module:
    """slime's --only-train-params-name-list / --freeze-params-name-list: parameters whose (Megatron) name the
    regular expressions select (re.search) get requires_grad False before DDP and the optimizer see them; they
    are still synced to the engines and saved."""
    only, frozen = training.only_train_params_name_list, training.freeze_params_name_list
    if not only and not frozen:
        return model
    for name, param in model.named_parameters():  # never unfreezes (MTP layers without MTP training stay frozen)
        if only:
            param.requires_grad_(param.requires_grad and any(re.search(pattern, name) for pattern in only))
        else:
            param.requires_grad_(param.requires_grad and not any(re.search(pattern, name) for pattern in frozen or ()))
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("training.only_train_params_name_list / freeze_params_name_list leave no parameter to train")
    return model


@dataclass
class TrainerParts:
    """What a trainer rank holds for a run."""

    actor: torch.nn.Module
    optimizer: ActorOptimizer
    ref_model: torch.nn.Module | None
    trainer: RolloutTrainer
    resumed: checkpoint.TrainerState | None
    teacher_model: torch.nn.Module | None = None
    critic_model: torch.nn.Module | None = None
    critic_optimizer: ActorOptimizer | None = None
    critic_config: CriticConfig | None = None


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def _optimized(model: torch.nn.Module, config: OptimizerConfig, info: ParallelInfo) -> tuple[torch.nn.Module, Any]:
    """`model` in Megatron's DDP with Megatron's optimizer (one path on CPU and GPU): the distributed one for adam;
    Megatron's DistributedOptimizer refuses SGD, which steps unsharded (`optimizer.wants_distributed_optimizer`)."""
    ddp = wrap_ddp(model, distributed_optimizer=wants_distributed_optimizer(config))
    return ddp, ActorOptimizer(ddp, config)


def build_critic(*, arch: ModelArchitecture, training: TrainingConfig, optimizer_config: OptimizerConfig,
                 critic: CriticConfig, checkpoints: CheckpointConfig, initial_source: str, info: ParallelInfo,
                 model_file: str | Path | None = None) -> tuple[torch.nn.Module, Any]:
    """The critic and its optimizer: resumed from its own checkpoint when one exists, else the actor's initial
    weights with a fresh value head (slime: the critic starts from the actor's checkpoint and re-initialises
    the output layer it cannot load)."""
    device = "cpu" if info.on_cpu else "cuda"
    model = build_model(arch, training, device=device)
    resume_from = critic_load_dir(critic, checkpoints.load)
    resuming = bool(resume_from) and checkpoint.latest_iteration(resume_from) is not None
    if not resuming:
        load_weights(model, initial_source, arch, info, model_file=model_file)
    ddp, optimizer = _optimized(install_value_head(model, seed=training.seed), critic_optimizer_config(
        optimizer_config, critic), info)
    if resuming:
        checkpoint.load_checkpoint(resume_from, ddp, optimizer)
    return ddp, optimizer


def build_trainer(*, arch: ModelArchitecture, training: TrainingConfig, algorithm: AlgorithmConfig,
                  optimizer_config: OptimizerConfig, checkpoints: CheckpointConfig, info: ParallelInfo,
                  model_file: str | Path | None = None, plugin_args: SimpleNamespace | None = None,
                  distillation: DistillationConfig | None = None, critic: CriticConfig | None = None) -> TrainerParts:
    """Actor + optimizer (+ reference model when the KL loss or KL shaping needs one, + the teacher for
    opd_type megatron, + the critic for advantage_estimator ppo), loaded.
    `plugin_args`: the run's flat config for custom loss/advantage functions (default: these sections').
    slime's --custom-megatron-init-path hook runs first (the process groups are up, no model yet)."""
    device = "cpu" if info.on_cpu else "cuda"  # cluster.device, as init_parallel checked it
    check_moe_training(arch, training)
    distillation = distillation or DistillationConfig()
    if training.custom_megatron_init_path:
        load_plugin("megatron_init", training.custom_megatron_init_path)(
            plugin_args if plugin_args is not None else trainer_args(training, algorithm))
    actor, optimizer = _optimized(freeze_parameters(build_model(arch, training, device=device), training),
                                  optimizer_config, info)
    resumed = None
    if _has_checkpoint(checkpoints.load) and not is_hf_checkpoint(checkpoints.load):
        resumed = checkpoint.load_checkpoint(checkpoints.load, actor, optimizer)
    else:
        source = next((p for p in (checkpoints.load, checkpoints.ref_load, checkpoints.hf_checkpoint)
                       if _has_checkpoint(p)), None)
        if source is None:
            raise FileNotFoundError("no initial weights: set checkpoint.load, checkpoint.ref_load or "
                                    "checkpoint.hf_checkpoint to an HF directory or a torch_dist checkpoint")
        load_weights(actor, source, arch, info, model_file=model_file,
                     iteration=checkpoints.ref_ckpt_step if source == checkpoints.ref_load else None)
        optimizer.reload_model_params()  # the loaded weights into the fp32 main copies
    ref_model = None
    if (algorithm.use_kl_loss or algorithm.kl_coef != 0.0) and not skips_advantages(algorithm):
        ref_source = next((p for p in (checkpoints.ref_load, checkpoints.hf_checkpoint) if _has_checkpoint(p)), None)
        if ref_source is None:
            raise FileNotFoundError("the KL term needs reference weights: set checkpoint.ref_load")
        ref_model = build_model(arch, training, device=device)
        if resumed is not None and resumed.has_ref_model:  # an updated reference (algorithm.ref_update_interval)
            checkpoint.load_ref_model(checkpoints.load or "", ref_model)
        else:
            load_weights(ref_model, ref_source, arch, info, model_file=model_file,
                         iteration=checkpoints.ref_ckpt_step if ref_source == checkpoints.ref_load else None)
        _frozen(ref_model)
    teacher_model = None
    if distillation.use_opd and distillation.opd_type == "megatron":
        teacher_model = build_model(arch, training, device=device)
        load_weights(teacher_model, distillation.opd_teacher_load or "", arch, info, model_file=model_file,
                     iteration=distillation.opd_teacher_ckpt_step)
        _frozen(teacher_model)
    critic_part = None
    if algorithm.advantage_estimator == "ppo":
        critic = critic or CriticConfig()
        initial = next(p for p in (checkpoints.ref_load, checkpoints.hf_checkpoint) if _has_checkpoint(p))
        critic_model, critic_optimizer = build_critic(
            arch=arch, training=training, optimizer_config=optimizer_config, critic=critic, checkpoints=checkpoints,
            initial_source=initial, info=info, model_file=model_file)
        critic_part = CriticPart(model=critic_model, optimizer=critic_optimizer, config=critic)
    if resumed is not None:
        checkpoint.restore_rng_state(checkpoints.load)
    trainer = RolloutTrainer(actor=actor, optimizer=optimizer, ref_model=ref_model, arch=arch, training=training,
                             algorithm=algorithm, info=info, plugin_args=plugin_args, teacher_model=teacher_model,
                             distillation=distillation, critic=critic_part)
    return TrainerParts(actor=actor, optimizer=optimizer, ref_model=ref_model, trainer=trainer, resumed=resumed,
                        teacher_model=teacher_model,
                        critic_model=critic_part.model if critic_part else None,
                        critic_optimizer=critic_part.optimizer if critic_part else None,
                        critic_config=critic_part.config if critic_part else None)
