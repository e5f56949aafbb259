"""Assemble a trainer rank: its model roles (actor, reference, on-policy-distillation teacher, PPO's critic),
built through one path (`build_role`), and the `RolloutTrainer` over them.

Owns: where each role's initial weights come from (`weight_sources`, slime's rules: the actor from `load` if it
holds a checkpoint, else `ref_load`, else `hf_checkpoint`; each of `load`/`ref_load` may be a torch_dist
checkpoint or an HF directory; `ref_ckpt_step` picks an iteration of `ref_load`; a checkpoint that saved an
updated reference restores it; the teacher from `opd_teacher_load`; the critic from its own checkpoint, else the
actor's initial weights with a fresh value head); the order a role is built in (module, weights, then DDP and
the optimizer for the trained roles, host memory for the frozen ones: `build_role`). Does not own the command
loop (`__main__`), the swap of frozen weights onto the device (`host_weights`) nor the passes (`step`).
"""

from __future__ import annotations

import inspect
import json
import re
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from hpc_rl.config.lora import LoraConfig
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.training_modes import frozen_model_roles
from hpc_rl.models.deepseek_v32.config_rules import is_indexer_parameter
from hpc_rl.config.sections.algorithm import AlgorithmConfig, DistillationConfig
from hpc_rl.config.sections.training import CheckpointConfig, CriticConfig, OptimizerConfig, TrainingConfig
from hpc_rl.plugins import load_plugin
from hpc_rl.training import checkpoint
from hpc_rl.training.checkpoint_manifest import choose_resume, resume_directory
from hpc_rl.training.critic import critic_load_dir, critic_optimizer_config, install_value_head
from hpc_rl.training.custom_hooks import trainer_args
from hpc_rl.training.host_weights import move_to_host
from hpc_rl.training.lora.attach import lora_actor
from hpc_rl.training.model_provider import build_gpt_model, check_moe_training
from hpc_rl.training.optimizer import ActorOptimizer, wants_distributed_optimizer, wrap_ddp
from hpc_rl.training.parallel import ParallelInfo
from hpc_rl.training.step import CriticPart, RolloutTrainer
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
    return bool(path) and (is_hf_checkpoint(path) or choose_resume(path).exists  # (an unreadable tracker too)
                           or Path(path, ".metadata").exists())


def resume_source(checkpoints: CheckpointConfig) -> str | None:
    """`load` (an HF dir, or a root whose newest whole iteration is loaded), or the iteration dir
    `checkpoint_manifest.resume_directory` picks with `ckpt_step`; None when load holds no whole checkpoint and
    start_rollout_id asks for a start anyway (then ref_load / hf_checkpoint give the weights)."""
    load = checkpoints.load
    if not load or is_hf_checkpoint(load):
        return load
    if checkpoints.ckpt_step is None and checkpoints.start_rollout_id is None:
        return load
    chosen = resume_directory(load, checkpoints.ckpt_step, checkpoints.start_rollout_id)
    return str(chosen) if chosen is not None else (None if choose_resume(load).exists else load)


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
    if training.freeze_indexer:
        freeze_indexer(model)
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


def freeze_indexer(model: torch.nn.Module) -> list[str]:
    """slime's --freeze-indexer: every DeepSeek Sparse Attention indexer parameter gets requires_grad False (so DDP
    and Megatron's optimizer never see it); returns their names. A model chunk with self-attention and no indexer is
    an error, as in slime (a pipeline stage without attention may have none)."""
    names = [name for name, _ in model.named_parameters()]
    frozen = [name for name in names if is_indexer_parameter(name)]
    for name, param in model.named_parameters():
        if is_indexer_parameter(name):
            param.requires_grad_(False)
    if not frozen and any(".self_attention." in f".{name}" for name in names):
        raise ValueError("training.freeze_indexer (--freeze-indexer): this model has self-attention and no DeepSeek "
                         "Sparse Attention indexer parameters (core_attention.indexer.*) to freeze")
    return frozen


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


def _optimized(model: torch.nn.Module, config: OptimizerConfig) -> tuple[torch.nn.Module, Any]:
    """`model` in Megatron's DDP with Megatron's optimizer (one path on CPU and GPU): the distributed one for adam;
    Megatron's DistributedOptimizer refuses SGD, which steps unsharded (`optimizer.wants_distributed_optimizer`)."""
    ddp = wrap_ddp(model, distributed_optimizer=wants_distributed_optimizer(config))
    return ddp, ActorOptimizer(ddp, config)


# ------------------------------------------------------------------ the model roles, built through one path

ROLES = ("actor", "reference", "teacher", "critic")
FROZEN_ROLES = ("reference", "teacher")
"""Their weights live in (pinned) host memory between passes (`host_weights`)."""


@dataclass(frozen=True)
class WeightSource:
    """Where a role's initial weights may come from: an HF directory or a torch_dist checkpoint (at `iteration`)."""

    path: str | None
    iteration: int | None = None


def weight_sources(role: str, checkpoints: CheckpointConfig,
                   distillation: DistillationConfig) -> list[WeightSource]:
    """Each role's initial weights, first existing source wins (slime's order): the actor from `load`, else
    `ref_load` (at ref_ckpt_step), else `hf_checkpoint`; the reference and the critic (whose value head is fresh)
    from `ref_load`, else `hf_checkpoint`; the teacher from `opd_teacher_load` (at opd_teacher_ckpt_step).
    A role's own checkpoint (the actor's or critic's trainer state, an updated reference) comes first
    (`build_role`)."""
    ref, hf = WeightSource(checkpoints.ref_load, checkpoints.ref_ckpt_step), WeightSource(checkpoints.hf_checkpoint)
    table = {"actor": [WeightSource(checkpoints.load), ref, hf], "reference": [ref, hf], "critic": [ref, hf],
             "teacher": [WeightSource(distillation.opd_teacher_load, distillation.opd_teacher_ckpt_step)]}
    return table[role]


MISSING_WEIGHTS = {
    "actor": "no initial weights: set checkpoint.load, checkpoint.ref_load or checkpoint.hf_checkpoint to an HF "
             "directory or a torch_dist checkpoint",
    "reference": "the KL term needs reference weights: set checkpoint.ref_load",
    "critic": "PPO's critic starts from the actor's initial weights: set checkpoint.ref_load or "
              "checkpoint.hf_checkpoint",
    "teacher": "on-policy distillation with opd_type megatron needs the teacher's weights: set "
               "distillation.opd_teacher_load to an HF directory or a torch_dist checkpoint",
}


def first_weight_source(role: str, checkpoints: CheckpointConfig, distillation: DistillationConfig) -> WeightSource:
    source = next((s for s in weight_sources(role, checkpoints, distillation) if _has_checkpoint(s.path)), None)
    if source is None:
        raise FileNotFoundError(MISSING_WEIGHTS[role])
    return source


def saved_trainer_state(path: str | None) -> checkpoint.TrainerState | None:
    """The trainer state of the torch_dist checkpoint at `path` (None: no checkpoint, an HF directory, or weights
    only), read before any model is built so the frozen roles know whether an updated reference was saved."""
    if not _has_checkpoint(path) or is_hf_checkpoint(path or ""):
        return None
    state_file = checkpoint.resolve_checkpoint_dir(path or "") / checkpoint.STATE_FILE
    if not state_file.is_file():
        return None
    return checkpoint.TrainerState(**json.loads(state_file.read_text()))


@dataclass(frozen=True)
class RoleInputs:
    """What every role is built from (one rank's view of the run)."""

    arch: ModelArchitecture
    training: TrainingConfig
    optimizer: OptimizerConfig
    checkpoints: CheckpointConfig
    distillation: DistillationConfig
    critic: CriticConfig
    info: ParallelInfo
    model_file: str | Path | None
    load: str | None
    """What the actor resumes from (`resume_source`): `checkpoints.load`, or the iteration `ckpt_step` picks."""
    saved: checkpoint.TrainerState | None
    """The actor's checkpoint at `load`, when it holds trainer state (a resume)."""
    lora: LoraConfig | None = None
    """LoRA on the actor (issue 33): adapters on a frozen base; None or lora_rank 0: full training."""


@dataclass
class BuiltRole:
    model: torch.nn.Module
    """DDP-wrapped for the trained roles; a frozen module with host-resident weights for the others."""
    optimizer: Any = None
    resumed: checkpoint.TrainerState | None = None


def _resume_dir(role: str, inputs: RoleInputs) -> str | None:
    """A trained role's own checkpoint: the actor's trainer state at `load`, the critic's at <load>/critic."""
    if role == "actor":
        return inputs.load if inputs.saved is not None else None
    if role == "critic":
        path = critic_load_dir(inputs.critic, inputs.checkpoints.load)
        return path if path and checkpoint.latest_iteration(path) is not None else None
    return None


def build_role(role: str, inputs: RoleInputs) -> BuiltRole:
    """One role's model on this rank: build its stage, load its weights, then (trained roles) Megatron DDP and the
    optimizer, built after the weights are in (Megatron's mixed-precision optimizer copies the fp32 main
    parameters when it is built) and then a resume from the role's own checkpoint; (frozen roles) eval, no
    grads, weights moved to (pinned) host memory before the next role is built, so the device never holds two
    models' weights."""
    if role not in ROLES:
        raise ValueError(f"unknown model role {role!r}: one of {', '.join(ROLES)}")
    arch, training, info = inputs.arch, inputs.training, inputs.info
    module = build_model(arch, training, device="cpu" if info.on_cpu else "cuda")
    resume_from = _resume_dir(role, inputs)
    if role == "reference" and inputs.saved is not None and inputs.saved.has_ref_model:
        checkpoint.load_ref_model(inputs.load or "", module)  # updated by algorithm.ref_update_interval
    elif resume_from is None:
        checkpoints = dataclasses.replace(inputs.checkpoints, load=inputs.load)  # the actor's first source
        source = first_weight_source(role, checkpoints, inputs.distillation)
        load_weights(module, source.path or "", arch, info, model_file=inputs.model_file, iteration=source.iteration)
    if role in FROZEN_ROLES:
        return BuiltRole(model=move_to_host(_frozen(module), pin=not info.on_cpu))
    if role == "actor":
        module, config = freeze_parameters(module, training), inputs.optimizer
        if inputs.lora is not None:
            module = lora_actor(module, inputs.lora, seed=training.seed, start_from_adapter=resume_from is None)
    else:
        module, config = install_value_head(module, seed=training.seed), critic_optimizer_config(
            inputs.optimizer, inputs.critic)
    ddp, optimizer = _optimized(module, config)
    resumed = checkpoint.load_checkpoint(resume_from, ddp, optimizer) if resume_from else None
    return BuiltRole(model=ddp, optimizer=optimizer, resumed=resumed)


def trainer_roles(algorithm: AlgorithmConfig, distillation: DistillationConfig) -> list[str]:
    """The roles a run builds, frozen ones first (each leaves the device before the next is built)."""
    return [*frozen_model_roles(algorithm, distillation), "actor",
            *(["critic"] if algorithm.advantage_estimator == "ppo" else [])]


def build_trainer(*, arch: ModelArchitecture, training: TrainingConfig, algorithm: AlgorithmConfig,
                  optimizer_config: OptimizerConfig, checkpoints: CheckpointConfig, info: ParallelInfo,
                  model_file: str | Path | None = None, plugin_args: SimpleNamespace | None = None,
                  distillation: DistillationConfig | None = None, critic: CriticConfig | None = None,
                  lora: LoraConfig | None = None) -> TrainerParts:
    """Actor + optimizer (+ reference model when the KL loss or KL shaping needs one, + the teacher for
    opd_type megatron, + the critic for advantage_estimator ppo), loaded, each through `build_role`.
    `plugin_args`: the run's flat config for custom loss/advantage functions (default: these sections').
    slime's --custom-megatron-init-path hook runs first (the process groups are up, no model yet)."""
    check_moe_training(arch, training)
    distillation, critic = distillation or DistillationConfig(), critic or CriticConfig()
    if training.custom_megatron_init_path:
        load_plugin("megatron_init", training.custom_megatron_init_path)(
            plugin_args if plugin_args is not None else trainer_args(training, algorithm))
    load = resume_source(checkpoints)
    inputs = RoleInputs(arch=arch, training=training, optimizer=optimizer_config, checkpoints=checkpoints,
                        distillation=distillation, critic=critic, info=info, model_file=model_file,
                        load=load, saved=saved_trainer_state(load), lora=lora)
    built = {role: build_role(role, inputs) for role in trainer_roles(algorithm, distillation)}
    actor, ref, teacher, critic_role = (built["actor"], built.get("reference"), built.get("teacher"),
                                        built.get("critic"))
    if actor.resumed is not None:
        checkpoint.restore_rng_state(load or "")
    critic_part = (CriticPart(model=critic_role.model, optimizer=critic_role.optimizer, config=critic)
                   if critic_role is not None else None)
    trainer = RolloutTrainer(actor=actor.model, optimizer=actor.optimizer, ref_model=ref.model if ref else None,
                             arch=arch, training=training, algorithm=algorithm, info=info, plugin_args=plugin_args,
                             teacher_model=teacher.model if teacher else None, distillation=distillation,
                             critic=critic_part)
    return TrainerParts(actor=actor.model, optimizer=actor.optimizer, ref_model=trainer.ref_model, trainer=trainer,
                        resumed=actor.resumed, teacher_model=trainer.teacher_model,
                        critic_model=critic_part.model if critic_part else None,
                        critic_optimizer=critic_part.optimizer if critic_part else None,
                        critic_config=critic_part.config if critic_part else None)
