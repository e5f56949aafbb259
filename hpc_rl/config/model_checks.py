"""The model architecture of a run checked against its parallel layout, its checkpoint and the memory plan.

Owns: resolving the run's architecture (Megatron's model flags first, else the model file: `run_architecture`),
TP/engine-TP dividing the heads, the pipeline split of the layers, family-specific layout rules (DeepSeek-V3.2's
DSA, Qwen3-Next's hybrids), the architecture vs the HF checkpoint's config.json, FP8 checkpoints, and (through
`moe_checks`, `mtp_checks`, `memory_plan`) experts, optimizer offload and the per-GPU memory plan. Called by
`hpc_rl.config.validation.collect_problems`.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpc_rl.config.fp8_scheme import read_fp8_blocks
from hpc_rl.config.memory_plan import plan_memory
from hpc_rl.config.mtp_checks import mtp_problems
from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
from hpc_rl.config.moe_checks import moe_problems, optimizer_problems, sglang_moe_problems
from hpc_rl.config.parallel_layout import ParallelLayout
from hpc_rl.config.pipeline_split import PipelineSplitError, training_split
from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sglang_options import attention_dp_size
from hpc_rl.models.deepseek_v32.config_rules import training_problems as dsa_training_problems
from hpc_rl.models.mla import fields_unused_by
from hpc_rl.models.qwen3_next.config_rules import layout_problems as hybrid_layout_problems


def architecture(config: RunConfig) -> tuple[ModelArchitecture | None, str, list[Problem]]:
    """The run's architecture (model flags first, else the model file), a name for messages, problems."""
    if config.model_args is not None:
        return config.model_args, "the model flags", []
    if not config.model:
        return None, "", [Problem("model", "needs",
                                  "no model architecture: give Megatron's model flags (slime's MODEL_ARGS, "
                                           "e.g. --num-layers 36 ...) or model: configs/models/<name>.yaml")]
    model_path = Path(config.model)
    if not model_path.is_file():
        return None, "", [Problem("model", "not_found", f"model file {model_path} not found")]
    try:
        return ModelArchitecture.from_yaml(model_path), str(model_path), []
    except ValueError as error:
        return None, "", [Problem("model", "bad_file", str(error))]


def run_architecture(config: RunConfig) -> ModelArchitecture | None:
    """The run's architecture (model flags, else the model file), or None when neither gives one."""
    return architecture(config)[0]


def model_problems(config: RunConfig) -> list[Problem]:
    arch, model_path, found = architecture(config)
    if arch is None:
        return found
    problems = []
    tp = config.training.tensor_model_parallel_size
    # MLA has no KV-head groups (hpc_rl.models.mla.GQA_ONLY_FIELDS): TP splits its attention heads
    heads, kind = ((arch.num_attention_heads, "attention heads") if "num_query_groups" in fields_unused_by(arch)
                   else (arch.num_query_groups, "KV heads"))
    if heads % tp:
        problems.append(Problem(
            "training.tensor_model_parallel_size",
            "not_divisible", f"TP {tp} does not divide the model's {heads} {kind} ({model_path})",
        ))
    # SGLang splits attention heads over the engine's attention-TP group (its GPUs / attention DP)
    engine_tp = config.cluster.rollout_num_gpus_per_engine // attention_dp_size(config.sglang.server_options())
    if engine_tp and arch.num_attention_heads % engine_tp:
        problems.append(Problem(
            "cluster.rollout_num_gpus_per_engine",
            "not_divisible", f"engine (attention) TP {engine_tp} does not divide the model's {arch.num_attention_heads} heads",
        ))
    try:
        training_split(arch.num_layers, config.training)
    except PipelineSplitError as error:
        problems.append(Problem("training.pipeline_model_parallel_size", "not_divisible",
                                f"{error} ({model_path})"))
    problems += [Problem(where, "unsupported",
                         message) for where, message in dsa_training_problems(arch, config.training)]
    problems += [Problem(where, "unsupported", message) for where, message in hybrid_layout_problems(
        arch, tp=tp, cp=config.training.context_parallel_size)]
    hf_config = Path(config.checkpoint.hf_checkpoint) / "config.json" if config.checkpoint.hf_checkpoint else None
    if hf_config is not None and hf_config.is_file():
        try:
            hf = json.loads(hf_config.read_text())
        except json.JSONDecodeError as error:
            return problems + [Problem(str(hf_config), "bad_file", f"not valid JSON: {error}")]
        for mismatch in architecture_mismatches(arch, hf):
            problems.append(Problem("model", "mismatch",
                                    f"{model_path} and {hf_config} disagree: {mismatch}"))
    return problems


def fp8_problems(config: RunConfig) -> list[Problem]:
    """An FP8 hf_checkpoint is one hpc_rl can serve (block e4m3, dynamic activations). force_fp8_ue8m0_scale without
    one does nothing, as in slime (a recipe's line may carry it to a bf16 run)."""
    try:
        read_fp8_blocks(config.checkpoint.hf_checkpoint)
    except ValueError as error:
        return [Problem("checkpoint.hf_checkpoint", "unsupported",
                        f"{error}; FP8 rollouts need a block-FP8 release")]
    return []


def moe_and_memory_problems(config: RunConfig) -> list[Problem]:
    """Experts, optimizer offload, SGLang's MoE options; then (cuda runs whose layout is sound) the per-GPU
    memory plan (`hpc_rl.config.memory_plan`)."""
    arch = run_architecture(config)
    found = (moe_problems(config, arch) + optimizer_problems(config) + sglang_moe_problems(config, arch)
             + mtp_problems(config, arch))
    problems = found
    sound = (arch is not None and ParallelLayout.of(config.training, config.cluster.trainer_world_size, arch).splits(arch)
             and _pipeline_splits(arch, config))
    if arch is not None and config.cluster.device == "cuda" and sound and config.cluster.rollout_num_gpus_per_engine >= 1:
        problems += plan_memory(config, arch).problems()
    return problems


def _pipeline_splits(arch: ModelArchitecture, config: RunConfig) -> bool:
    try:
        training_split(arch.num_layers, config.training)
    except PipelineSplitError:
        return False
    return True
