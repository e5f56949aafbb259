"""Submit-time checks of the mixture-of-experts, optimizer-offload and SGLang MoE settings, and their notes.

Owns: what Megatron-core 0.16.1 or SGLang 0.5.23 would refuse only after the queue wait, as problems that
name the numbers: the trainer's expert layout (`parallel_layout`), the MoE training values (dispatcher,
router dtype, load balancing, drop policy, capacity factor), expert biases only at expert TP 1, sliding windows
without CP on cpu, what a family's checkpoint cannot be served with (its registry `sglang_problems`: gpt-oss from a
bf16 checkpoint only, with SGLang EP 1: `hpc_rl.models.gpt_oss.serving`), DeepEP and the flex dispatcher only on cuda,
routing replay only for MoE models and what Megatron's RouterReplay and R3 need (`routing_replay_problems`),
group-limited routing, top-1 softmax routing; Megatron's optimizer offload rules; SGLang's MoE engine options against
the engine's GPUs and the model's experts (attention DP,
EP, dense-MLP TP, DP LM head); and one note line per GPU-only choice a cpu run keeps, with the same numerics.
"""

from __future__ import annotations

from typing import Any

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.parallel_layout import ParallelLayout, layout_problems
from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sections.training import LOAD_BALANCING_TYPES
from hpc_rl.config.sglang_options import attention_dp_size, engine_kind
from hpc_rl.config.training_modes import is_sft
from hpc_rl.models.registry import family

CAPACITY_BALANCING_TYPES = tuple(t for t in LOAD_BALANCING_TYPES if t != "sinkhorn")
"""Megatron's load balancing types that work with a capacity factor."""

Problems = list[Problem]


def _training_value_problems(config: RunConfig, arch: ModelArchitecture) -> Problems:
    training = config.training
    problems = []  # the values themselves are Literal types (hpc_rl.config.sections.training), checked at load
    if training.moe_expert_capacity_factor is not None and \
            training.moe_router_load_balancing_type not in CAPACITY_BALANCING_TYPES:
        problems.append(Problem("training.moe_expert_capacity_factor", "unsupported",
                                f"works with load balancing "
                                f"{', '.join(CAPACITY_BALANCING_TYPES)} only (Megatron), not "
                                f"{training.moe_router_load_balancing_type!r}"))
    if training.moe_enable_deepep and training.moe_token_dispatcher_type != "flex":
        problems.append(Problem("training.moe_enable_deepep", "needs",
                                f"DeepEP runs behind the flex dispatcher only (Megatron): add "
                                f"--moe-token-dispatcher-type flex (it is "
                                f"{training.moe_token_dispatcher_type!r})"))
    if config.cluster.device == "cpu":
        if training.moe_token_dispatcher_type == "flex":
            problems.append(Problem("training.moe_token_dispatcher_type", "unsupported",
                                    "flex dispatches through DeepEP, a CUDA library; "
                                    "on device cpu use alltoall or allgather"))
        if training.moe_enable_deepep:
            problems.append(Problem("training.moe_enable_deepep", "unsupported",
                                    "DeepEP is a CUDA library; on device cpu drop it"))
    if arch.moe_router_topk == 1 and arch.moe_router_score_function == "softmax" and not arch.moe_router_pre_softmax \
            and training.moe_router_load_balancing_type != "sinkhorn":
        problems.append(Problem("model", "needs",
                                "top-1 softmax routing needs --moe-router-pre-softmax (a softmax over the one "
                                "chosen expert has zero gradient; Megatron refuses it)"))
    expert_tp = training.expert_tensor_parallel_size or training.tensor_model_parallel_size
    if arch.add_bias_linear and expert_tp > 1:
        problems.append(Problem("training.expert_tensor_parallel_size", "unsupported",
                                f"{expert_tp} (it defaults to TP): the experts have "
                                f"biases (gpt-oss) and Megatron builds MoE biases at expert TP 1 only: add "
                                f"--expert-tensor-parallel-size 1 (slime's gpt-oss line does)"))
    if arch.window_size and config.training.context_parallel_size > 1 and config.cluster.device == "cpu":
        problems.append(Problem("training.context_parallel_size", "unsupported",
                                "sliding-window attention under context parallelism is "
                                "not built on device cpu (its CP attention has no window band): use 1"))
    if arch.moe_router_group_topk is not None:
        groups = arch.moe_router_num_groups
        if not groups or (arch.num_moe_experts or 0) % groups or arch.moe_router_group_topk > groups:
            problems.append(Problem("model", "not_divisible",
                                    f"group-limited routing: moe_router_num_groups ({groups}) must divide the "
                                    f"{arch.num_moe_experts} experts and be >= moe_router_group_topk "
                                    f"({arch.moe_router_group_topk})"))
    return problems


def moe_problems(config: RunConfig, arch: ModelArchitecture | None, layout: ParallelLayout | None = None) -> Problems:
    """The trainer side: layout, MoE values, routing replay."""
    training = config.training
    if arch is None:
        return []
    layout = layout or ParallelLayout.of_run(config, arch)
    problems = layout_problems(layout, arch, training)
    if not arch.is_moe:
        for name in ("use_routing_replay", "use_rollout_routing_replay"):
            if getattr(training, name):
                problems.append(Problem(f"training.{name}", "unsupported",
                                        "replays the routers' expert choices; this model is dense (no "
                                        "experts): drop it"))
        return problems
    return problems + _training_value_problems(config, arch)


def routing_replay_problems(config: RunConfig) -> list[Problem]:
    """use_routing_replay / use_rollout_routing_replay: what Megatron's RouterReplay and R3 need on a MoE model."""
    training = config.training
    flags = [name for name in ("use_routing_replay", "use_rollout_routing_replay") if getattr(training, name)]
    if not flags:
        return []
    where = f"training.{flags[-1]}"
    problems = []  # (a dense model with either flag: the MoE rules' refusal)
    if "sinkhorn" in str(training.moe_router_load_balancing_type):
        problems.append(Problem(where, "unsupported",
                                "Megatron's sinkhorn routing chooses experts without the replay hook: use "
                                "--moe-router-load-balancing-type aux_loss / seq_aux_loss / none"))
    if training.use_rollout_routing_replay and is_sft(config.rollout.rollout_function_path):
        problems.append(Problem("training.use_rollout_routing_replay",
                                "unsupported",
                                "SFT trains on the data's chats, which no engine routed: drop it (or use "
                                "--use-routing-replay)"))
    if training.use_rollout_routing_replay and training.moe_expert_capacity_factor is not None:
        problems.append(Problem("training.moe_expert_capacity_factor",
                                "unsupported",
                                "drops tokens over an expert's capacity, which the engines never do, so the replayed "
                                "rollout routing would not be the one used: unset it with use_rollout_routing_replay"))
    return problems


def optimizer_problems(config: RunConfig) -> Problems:
    """Megatron's optimizer-offload rules (checked for cuda runs; on cpu the flags change nothing)."""
    optimizer = config.optimizer
    if config.cluster.device != "cuda":
        return []
    problems = []
    if optimizer.optimizer_cpu_offload and not optimizer.use_precision_aware_optimizer:
        problems.append(Problem("optimizer.optimizer_cpu_offload", "needs",
                                "needs --use-precision-aware-optimizer (Megatron's hybrid "
                                "device optimizer runs on that code path): add it"))
    if optimizer.use_precision_aware_optimizer and optimizer.optimizer != "adam":
        problems.append(Problem("optimizer.use_precision_aware_optimizer", "unsupported",
                                f"works with adam only (Megatron), not "
                                f"{optimizer.optimizer!r}"))
    if optimizer.overlap_cpu_optimizer_d2h_h2d and not optimizer.optimizer_cpu_offload:
        problems.append(Problem("optimizer.overlap_cpu_optimizer_d2h_h2d", "unused",
                                "is read only with --optimizer-cpu-offload: add "
                                "it or drop this flag"))
    return problems


def sglang_moe_problems(config: RunConfig, arch: ModelArchitecture | None,
                        hf_config: dict[str, Any] | None = None) -> Problems:
    """SGLang's MoE engine options against the engine's GPUs and the model (SGLang checks them at start)."""
    if engine_kind(config.rollout.engine, config.cluster.device) != "sglang":
        return []
    options = config.sglang.server_options()
    own_problems = family(arch.family).sglang_problems if arch is not None else None  # gpt-oss: MXFP4, EP
    own = [] if own_problems is None else own_problems(options, hf_config)
    if any(option is None for option, _ in own):  # the checkpoint itself cannot be served
        return [Problem("checkpoint.hf_checkpoint", "unsupported", f"{config.checkpoint.hf_checkpoint} {message}")
                for option, message in own if option is None]
    gpus = config.cluster.rollout_num_gpus_per_engine
    problems = [Problem(f"sglang.extra_args.{option}", "unsupported", message) for option, message in own]
    if int(options.get("dp_size") or 1) > 1 and not options.get("enable_dp_attention"):
        problems.append(Problem("sglang.extra_args.dp_size", "needs", (
            f"{options['dp_size']} without enable_dp_attention starts {options['dp_size']} server replicas of "
            f"{gpus} GPU(s) each, but an engine has rollout_num_gpus_per_engine = {gpus} GPUs: add "
            f"--sglang-enable-dp-attention (attention data parallelism inside the engine) or run more engines")))
    attention_dp = attention_dp_size(options)
    if gpus % attention_dp:
        problems.append(Problem("sglang.extra_args.dp_size", "not_divisible",
                                f"attention DP {attention_dp} does not divide the engine's "
                                f"{gpus} GPUs (rollout_num_gpus_per_engine)"))
    if options.get("enable_dp_lm_head") and attention_dp == 1:
        problems.append(Problem("sglang.extra_args.enable_dp_lm_head", "needs",
                                "needs attention DP (SGLang): add "
                                "--sglang-enable-dp-attention --sglang-dp-size N"))
    dense_tp = options.get("moe_dense_tp_size")
    if dense_tp is not None and dense_tp not in (1, gpus):
        problems.append(Problem("sglang.extra_args.moe_dense_tp_size", "unsupported",
                                f"{dense_tp}: SGLang takes 1 or the engine's TP size "
                                f"({gpus})"))
    ep_key = "ep_size" if "ep_size" in options else "expert_parallel_size"
    ep = int(options.get(ep_key) or 1)
    if ep > 1 and arch is not None and not arch.is_moe:
        problems.append(Problem(f"sglang.extra_args.{ep_key}", "unsupported",
                                f"{ep}: the model is dense (no experts to split); drop it"))
    elif ep > 1 and arch is not None:
        if gpus % ep:
            problems.append(Problem(f"sglang.extra_args.{ep_key}", "not_divisible",
                                    f"EP {ep} does not divide the engine's {gpus} GPUs "
                                    f"(rollout_num_gpus_per_engine)"))
        slots = (arch.num_moe_experts or 0) + int(options.get("ep_num_redundant_experts") or 0)
        if slots % ep:
            problems.append(Problem(f"sglang.extra_args.{ep_key}", "not_divisible", (
                f"the model's {arch.num_moe_experts} experts (+ ep_num_redundant_experts) = {slots} do not split "
                f"over EP {ep}: add --sglang-ep-num-redundant-experts to make them divide, or change EP")))
    return problems


def device_notes(config: RunConfig, arch: ModelArchitecture | None) -> list[str]:
    """One line per GPU-only choice that a cpu run keeps, saying what runs instead (the same numerics)."""
    if config.cluster.device != "cpu":
        return []
    training, optimizer = config.training, config.optimizer
    notes = []
    if arch is not None and arch.is_moe and training.moe_grouped_gemm:
        notes.append("--moe-grouped-gemm is a GPU kernel choice; on cpu each local expert runs as its own matmul, "
                     "with the same numerics")
    if arch is not None and arch.is_moe and training.moe_permute_fusion:
        notes.append("--moe-permute-fusion is a GPU kernel choice; on cpu tokens are permuted by plain torch ops, "
                     "with the same numerics")
    offload = [flag for flag, on in (("--optimizer-cpu-offload", optimizer.optimizer_cpu_offload),
                                     ("--overlap-cpu-optimizer-d2h-h2d", optimizer.overlap_cpu_optimizer_d2h_h2d),
                                     ("--use-precision-aware-optimizer", optimizer.use_precision_aware_optimizer))
               if on]
    if offload:
        notes.append(f"{' '.join(offload)}: Megatron's GPU optimizer options; on cpu the trainer's Adam keeps its "
                     f"fp32 state in host memory already, so they change nothing")
    return notes
