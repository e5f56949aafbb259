"""Every LoRA problem a run config can have, checked at submit (each names its field and what to do).

Owns: `lora_problems` (the `lora` section's own values, its targets against the model's architecture, and what a
LoRA run can do with the rest of the run: colocation, engines, pipeline stages, frozen-parameter lists). Kept apart
from `hpc_rl.config.lora` (the section and its names), which `hpc_rl.config.schema` imports, so that neither imports
the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpc_rl.config.lora import (
    ALL_LINEAR, ATTENTION_PROJECTIONS, LORA_ADAPTER_FILES, LORA_TYPES, LoraConfig, target_projections,
)
from hpc_rl.config.problems import Problem

if TYPE_CHECKING:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.schema import RunConfig


def _architecture_problems(lora: LoraConfig, arch: ModelArchitecture, projections: list[str]) -> list[Problem]:
    problems = []
    mlp = [name for name in projections if name not in ATTENTION_PROJECTIONS]
    if arch.is_moe and mlp:
        problems.append(Problem("lora.target_modules", "unsupported",
                                f"{','.join(mlp)} on a MoE model would adapt the routed experts, whose "
                                "adapters are not built (Megatron's grouped expert GEMMs need per-expert adapters and SGLang "
                                "its MoE LoRA layout): adapt the attention only (--exclude-modules "
                                "gate_proj,up_proj,down_proj)"))
    if arch.multi_latent_attention and any(name in ATTENTION_PROJECTIONS for name in projections):
        problems.append(Problem("lora.target_modules", "unsupported",
                                "multi-latent attention's projections (q_a/q_b/kv_a/kv_b) have no "
                                "adapters here: adapt the dense MLP only (--target-modules gate_proj,up_proj,down_proj) or "
                                "train without LoRA"))
    return problems


def lora_problems(config: RunConfig, arch: ModelArchitecture | None, *, check_files: bool = True
                  ) -> list[Problem]:
    """Every LoRA problem of `config`; empty when LoRA is off and no LoRA flag is set."""
    lora = config.lora
    if lora.lora_rank < 0:
        return [Problem("lora.lora_rank", "out_of_range", f"{lora.lora_rank} must be >= 0 (0: LoRA off)")]
    if not lora.enabled:
        set_flags = [name for name in ("target_modules", "exclude_modules", "lora_adapter_path", "lora_sync_from_tensor",
                                       "lora_base_cpu_backup", "lora_train_only", "save_hf_merged")
                     if getattr(lora, name)]
        return [Problem(f"lora.{name}", "unused",
                        "is set but lora_rank is 0 (LoRA off): give --lora-rank N, or drop it")
                for name in set_flags]
    problems: list[Problem] = []
    if lora.lora_alpha <= 0:
        problems.append(Problem("lora.lora_alpha", "out_of_range",
                                f"{lora.lora_alpha} must be > 0 (the scale is alpha / rank)"))
    if not 0.0 <= lora.lora_dropout < 1.0:
        problems.append(Problem("lora.lora_dropout", "out_of_range",
                                f"{lora.lora_dropout} must be in [0, 1)"))
    if lora.lora_type not in LORA_TYPES:
        problems.append(Problem("lora.lora_type", "not_one_of",
                                f"{lora.lora_type!r} must be one of {', '.join(LORA_TYPES)}"))
    if not lora.target_modules:
        problems.append(Problem("lora.target_modules", "needs",
                                f"is required with lora_rank > 0: give --target-modules {ALL_LINEAR} "
                                "(or e.g. q_proj,k_proj,v_proj,o_proj)"))
    else:
        try:
            projections = target_projections(lora)
        except ValueError as error:
            field, message = str(error).split(": ", 1)
            problems.append(Problem(field, "not_one_of", message))
        else:
            if not projections:
                problems.append(Problem("lora.exclude_modules", "unsupported",
                                        f"{lora.exclude_modules!r} excludes every target module: "
                                        "exclude fewer, or turn LoRA off (--lora-rank 0)"))
            elif arch is not None:
                problems += _architecture_problems(lora, arch, projections)
    if lora.lora_sync_from_tensor and lora.lora_train_only:
        problems.append(Problem("lora.lora_sync_from_tensor", "conflict",
                                "and lora_train_only contradict each other (train-only engines "
                                "never receive the adapter): drop one"))
    if lora.save_hf_merged and not config.checkpoint.save_hf:
        problems.append(Problem("lora.save_hf_merged", "needs",
                                "writes the merged model beside --save-hf's adapter: give --save-hf "
                                "DIR_{rollout_id}, or drop it"))
    if lora.lora_base_cpu_backup and not config.cluster.colocate:
        problems.append(Problem("lora.lora_base_cpu_backup", "unused",
                                "only applies to colocated engines (--colocate): drop it"))
    training = config.training
    if training.only_train_params_name_list or training.freeze_params_name_list:
        problems.append(Problem("training.only_train_params_name_list", "unsupported",
                                "LoRA trains the adapters only (the base is frozen): "
                                "drop --only-train-params-name-list / --freeze-params-name-list"))
    if check_files and lora.lora_adapter_path:
        path = Path(lora.lora_adapter_path)
        missing = [name for name in LORA_ADAPTER_FILES if not (path / name).is_file()]
        if missing:
            problems.append(Problem("lora.lora_adapter_path", "bad_file",
                                    f"{path} has no {', '.join(missing)}: give a PEFT adapter "
                                    "directory (what PeftModel.save_pretrained or --save-hf writes)"))
    problems += _run_problems(config)
    return problems


def _run_problems(config: RunConfig) -> list[Problem]:
    """What a LoRA run can do today: the trainer trains adapters; engines started with --enable-lora get only the
    adapter at each sync: decoupled ones as a PEFT directory in the run dir (the `lora` weight transport), colocated
    ones as tensors (`lora_tensor`, with the base re-sent unless lora_base_cpu_backup); a run starting from
    lora_adapter_path syncs it before rollout 0. The rest is refused with its reason."""
    problems = []
    pipeline = config.training.pipeline_model_parallel_size > 1
    if pipeline and config.checkpoint.save_hf:
        problems.append(Problem("checkpoint.save_hf", "unsupported",
                                "a LoRA actor's PEFT adapter is written by one pipeline stage: with "
                                "pipeline_model_parallel_size > 1 drop --save-hf (the torch_dist checkpoint holds the "
                                "adapters)"))
    if config.cluster.debug_train_only:
        return problems
    lora = config.lora
    unwired = [
        (lora.lora_sync_from_tensor and not config.cluster.colocate, "lora.lora_sync_from_tensor", "the adapter "
         "goes to /load_lora_adapter_from_tensors as CUDA IPC handles, which only an engine on the trainer rank's own "
         "GPU maps (miles sends them to colocated engines only): add --colocate, or drop it (decoupled engines get "
         "the adapter as a PEFT directory on the shared filesystem)"),
        (lora.lora_train_only, "lora.lora_train_only", "with rollout engines the rollouts would keep sampling from "
         "the frozen base while the trainer's policy moves on: drop it (the engines then serve the adapter), or run "
         "trainer-only (--debug-train-only)"),
        (pipeline, "training.pipeline_model_parallel_size", "the adapter sync writes a PEFT directory from one "
         "pipeline stage: use pipeline_model_parallel_size 1 with LoRA and rollout engines"),
        (bool(config.rollout.rollout_external_engine_addrs), "rollout.rollout_external_engine_addrs", "external "
         "engines are not started by this run, so not with --enable-lora: let the run start its engines"),
        (config.rollout.flush_cache_interval != 1, "rollout.flush_cache_interval", "in-place updates keep requests "
         "running across a sync, but a request keeps the adapter it started with (the old one, which the sync "
         "unloads): drop it with LoRA"),
    ]
    return problems + [Problem(name, "unsupported", message) for refused, name, message in unwired if refused]
