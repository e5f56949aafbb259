"""The model architecture of a run checked against its parallel layout, its checkpoint and the memory plan.

Owns: TP/engine-TP dividing the heads, the pipeline split of the layers, family-specific layout rules (DeepSeek-V3.2's
DSA, Qwen3-Next's hybrids), the architecture vs the HF checkpoint's config.json, FP8 checkpoints, and (through
`moe_checks`, `mtp_checks`, `memory_plan`) experts, optimizer offload and the per-GPU memory plan. Each check takes
the model resolved once per validation (`hpc_rl.config.resolved_model`; resolved here when not given). Called by
`hpc_rl.config.validation.collect_problems`.
"""

from __future__ import annotations

from hpc_rl.config.fp8_scheme import fp8_blocks_of
from hpc_rl.config.memory_plan import plan_memory
from hpc_rl.config.mtp_checks import mtp_problems
from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
from hpc_rl.config.moe_checks import moe_problems, optimizer_problems, sglang_moe_problems
from hpc_rl.config.parallel_layout import ParallelLayout
from hpc_rl.config.pipeline_split import PipelineSplitError, training_split
from hpc_rl.config.problems import Problem
from hpc_rl.config.resolved_model import ResolvedModel, resolve_model, run_architecture
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sglang_options import attention_dp_size
from hpc_rl.models.deepseek_v32.config_rules import training_problems as dsa_training_problems
from hpc_rl.models.mla import fields_unused_by
from hpc_rl.models.qwen3_next.config_rules import layout_problems as hybrid_layout_problems


__all__ = ["fp8_problems", "model_problems", "moe_and_memory_problems", "run_architecture"]


def model_problems(config: RunConfig, model: ResolvedModel | None = None) -> list[Problem]:
    model = model or resolve_model(config)
    arch, model_path = model.arch, model.source
    if arch is None:
        return model.problems
    problems = []
    tp = config.training.tensor_model_parallel_size
    # MLA has no KV-head groups (hpc_rl.models.mla.GQA_ONLY_FIELDS): TP splits its attention heads
    heads, kind = ((arch.num_attention_heads, "attention heads") if "num_query_groups" in fields_unused_by(arch)
                   else (arch.num_query_groups, "KV heads"))
    if heads % tp:
        problems.append(Problem(
            "training.tensor_model_parallel_size",
            "not_divisible",
            f"TP {tp} does not divide the model's {heads} {kind} ({model_path})",
        ))
    # SGLang splits attention heads over the engine's attention-TP group (its GPUs / attention DP)
    engine_tp = config.cluster.rollout_num_gpus_per_engine // attention_dp_size(config.sglang.server_options())
    if engine_tp and arch.num_attention_heads % engine_tp:
        problems.append(Problem(
            "cluster.rollout_num_gpus_per_engine",
            "not_divisible",
            f"engine (attention) TP {engine_tp} does not divide the model's {arch.num_attention_heads} heads",
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
    hf_config = model.hf_config_path
    if model.hf_config_error is not None:
        return problems + [Problem(str(hf_config), "bad_file", f"not valid JSON: {model.hf_config_error}")]
    if model.hf_config is not None:
        for mismatch in architecture_mismatches(arch, model.hf_config):
            problems.append(Problem("model", "mismatch",
                                    f"{model_path} and {hf_config} disagree: {mismatch}"))
    return problems


def fp8_problems(config: RunConfig, model: ResolvedModel | None = None) -> list[Problem]:
    """An FP8 hf_checkpoint is one hpc_rl can serve (block e4m3, dynamic activations). force_fp8_ue8m0_scale without
    one does nothing, as in slime (a recipe's line may carry it to a bf16 run)."""
    model = model or resolve_model(config)
    try:
        if model.hf_config_error is not None:
            raise ValueError(model.hf_config_error)
        if model.hf_config is not None:
            fp8_blocks_of(model.hf_config, model.hf_config_path or "config.json")
    except ValueError as error:
        return [Problem("checkpoint.hf_checkpoint", "unsupported",
                        f"{error}; FP8 rollouts need a block-FP8 release")]
    return []


def moe_and_memory_problems(config: RunConfig, model: ResolvedModel | None = None) -> list[Problem]:
    """Experts, optimizer offload, SGLang's MoE options; then (cuda runs whose layout is sound) the per-GPU
    memory plan (`hpc_rl.config.memory_plan`)."""
    model = model or resolve_model(config)
    arch = model.arch
    layout = ParallelLayout.of_run(config, arch)
    problems = (moe_problems(config, arch, layout) + optimizer_problems(config)
                + sglang_moe_problems(config, arch, model.hf_config) + mtp_problems(config, arch))
    sound = arch is not None and layout.splits(arch) and _pipeline_splits(arch, config)
    if arch is not None and config.cluster.device == "cuda" and sound and config.cluster.rollout_num_gpus_per_engine >= 1:
        problems += plan_memory(config, arch, layout).problems()
    return problems


def _pipeline_splits(arch: ModelArchitecture, config: RunConfig) -> bool:
    try:
        training_split(arch.num_layers, config.training)
    except PipelineSplitError:
        return False
    return True
