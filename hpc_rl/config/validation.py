"""Submit-time validation of a whole `RunConfig`: every problem in one pass, before anything is queued.

Owns: cross-section rules (batch arithmetic, GPU topology, parallel sizes vs the model; experts, optimizer
offload and the per-GPU memory plan through `moe_checks` and `memory_plan`), file
checks (`file_checks`, skippable with `--no-check-files` for rendering a job away from the cluster's
filesystem), single-field ranges (`value_ranges`), plug-in import + signature checks, and the model
architecture vs the HF checkpoint's config.json. Each problem names the field (or file:line) and the fix.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from hpc_rl.config.lora_checks import lora_problems
from hpc_rl.config.fp8_scheme import read_fp8_blocks
from hpc_rl.config.memory_plan import plan_memory
from hpc_rl.config.mla_checks import mla_problems, speculative_notes
from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
from hpc_rl.models.deepseek_v32.config_rules import training_problems as dsa_training_problems
from hpc_rl.models.mla import fields_unused_by
from hpc_rl.models.qwen3_next.config_rules import layout_problems as hybrid_layout_problems
from hpc_rl.config.precision import TRAINER_DTYPES, trainer_dtype_name
from hpc_rl.config.parallel_layout import ParallelLayout
from hpc_rl.config.plugin_args import custom_config_values
from hpc_rl.config.moe_checks import device_notes, moe_problems, optimizer_problems, sglang_moe_problems
from hpc_rl.config.settings_sources import flat_index
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.file_checks import path_problems, prompt_file_problems
from hpc_rl.config.value_ranges import range_problems
from hpc_rl.config.pipeline_split import PipelineSplitError, training_split
from hpc_rl.config.sglang_options import attention_dp_size, engine_kind, engine_problems, external_engine_url
from hpc_rl.config.training_modes import is_sft, mode_problems
from hpc_rl.plugins import PluginError, load_plugin

CONFIG_PLUGINS = {"rollout.custom_rm_path": "reward", "rollout.dynamic_sampling_filter_path": "dynamic_sampling_filter",
                  "rollout.buffer_filter_path": "buffer_filter", "rollout.custom_generate_function_path": "generate",
                  "algorithm.custom_loss_function_path": "loss",
                  "algorithm.custom_advantage_function_path": "advantage",
                  "algorithm.custom_tis_function_path": "tis",
                  "rollout.rollout_sample_filter_path": "sample_filter",
                  "rollout.rollout_all_samples_process_path": "all_samples_process",
                  "rollout.custom_rollout_log_function_path": "rollout_log",
                  "eval.custom_eval_rollout_log_function_path": "eval_rollout_log",
                  "rollout.custom_reward_post_process_path": "reward_post_process",
                  "training.custom_megatron_init_path": "megatron_init",
                  "training.custom_megatron_before_log_prob_hook_path": "before_log_prob_hook",
                  "training.custom_megatron_before_train_step_hook_path": "before_train_step_hook",
                  "algorithm.rollout_data_postprocess_path": "rollout_data_postprocess",
                  "training.custom_model_provider_path": "model_provider",
                  "rollout.custom_update_weight_post_write_path": "update_weight_post_write"}
"""Config field (section.name) -> its kind in `hpc_rl.plugins.PLUGIN_KINDS` (the signatures' one home).
A field the schema does not have (yet) is skipped."""
log = logging.getLogger(__name__)
WANDB_SETTINGS = ("wandb_mode", "wandb_project", "wandb_team", "wandb_group", "wandb_key", "wandb_host", "wandb_dir",
                  "wandb_run_id")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the config: where, what, and what to do."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


class ValidationFailed(ValueError):
    """Raised with every problem found (one line each)."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems))


def _batch_problems(config: RunConfig) -> list[Problem]:
    rollout, training = config.rollout, config.training
    problems = []
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    trained = training.global_batch_size * training.num_steps_per_rollout
    if samples != trained:
        problems.append(Problem(
            "rollout.rollout_batch_size",
            f"rollout_batch_size * n_samples_per_prompt ({rollout.rollout_batch_size} * "
            f"{rollout.n_samples_per_prompt} = {samples}) must equal global_batch_size * num_steps_per_rollout "
            f"({training.global_batch_size} * {training.num_steps_per_rollout} = {trained})"
            + _batch_hint(samples, training.num_steps_per_rollout, rollout.rollout_batch_size,
                          rollout.n_samples_per_prompt, training.global_batch_size),
        ))
    prompt_len, context_len = rollout.rollout_max_prompt_len, rollout.rollout_max_context_len
    if prompt_len is not None and context_len is not None and prompt_len > context_len - 1:
        problems.append(Problem(
            "rollout.rollout_max_prompt_len",
            f"{prompt_len} leaves no room for a response in rollout_max_context_len {context_len}: set it to at most "
            f"{context_len - 1} (or leave it unset: rollout_max_context_len - 1)",
        ))
    if rollout.over_sampling_batch_size is not None and rollout.over_sampling_batch_size < rollout.rollout_batch_size:
        problems.append(Problem(
            "rollout.over_sampling_batch_size",
            f"{rollout.over_sampling_batch_size} is below rollout_batch_size ({rollout.rollout_batch_size}); "
            f"set it >= rollout_batch_size",
        ))
    dp = _data_parallel_size(config)
    if dp and training.global_batch_size % dp:
        problems.append(Problem(
            "training.global_batch_size",
            f"{training.global_batch_size} is not divisible by the data-parallel size {dp}",
        ))
    if training.use_dynamic_batch_size and not training.max_tokens_per_gpu:
        problems.append(Problem("training.max_tokens_per_gpu", "use_dynamic_batch_size needs max_tokens_per_gpu"))
    if rollout.rm_type is None and rollout.custom_rm_path is None and not is_sft(rollout.rollout_function_path):
        problems.append(Problem("rollout.rm_type", "no reward: set rm_type (e.g. deepscaler) or custom_rm_path"))
    if rollout.rm_type == "remote_rm" and not rollout.rm_url:
        problems.append(Problem("rollout.rm_url", "rm_type remote_rm needs rm_url"))
    if config.eval.eval_interval is not None and not config.eval.eval_prompt_data:
        problems.append(Problem("eval.eval_interval", "eval_interval is set but eval_prompt_data is empty"))
    if rollout.num_rollout is None and rollout.num_epoch is None:
        problems.append(Problem("rollout.num_rollout", "set num_rollout or num_epoch"))
    return problems


def _batch_hint(samples: int, steps: int, *sizes: int) -> str:
    """What to set so that a rollout's samples split into optimizer steps; '' when a size is itself invalid
    (below 1: its own range problem says so, and any arithmetic on it would mislead)."""
    if min(steps, *sizes) < 1:
        return ""
    if samples % steps == 0:
        return f"; e.g. set global_batch_size to {samples // steps}"
    divisors = sorted((d for d in range(1, samples + 1) if samples % d == 0), key=lambda d: (abs(d - steps), d))[:3]
    options = ", ".join(f"{samples // d} x {d}" for d in sorted(divisors))
    return (f"; num_steps_per_rollout {steps} does not divide {samples} samples: set global_batch_size x "
            f"num_steps_per_rollout to one of {options}, or change rollout_batch_size")


def _data_parallel_size(config: RunConfig) -> int:
    model_parallel = config.training.model_parallel_size
    world = config.cluster.trainer_world_size
    return world // model_parallel if model_parallel and world % model_parallel == 0 else 0


def _topology_problems(config: RunConfig) -> list[Problem]:
    cluster, training = config.cluster, config.training
    problems = []
    if cluster.rollout_num_gpus_per_engine < 1:
        problems.append(Problem("cluster.rollout_num_gpus_per_engine", "must be >= 1"))
    elif cluster.rollout_num_gpus % cluster.rollout_num_gpus_per_engine:
        problems.append(Problem(
            "cluster.rollout_num_gpus",
            f"{cluster.rollout_num_gpus} is not divisible by rollout_num_gpus_per_engine "
            f"({cluster.rollout_num_gpus_per_engine}); engines cannot be formed",
        ))
    world = cluster.trainer_world_size
    if world % training.model_parallel_size:
        problems.append(Problem(
            "training.tensor_model_parallel_size",
            f"TP*PP*CP = {training.tensor_model_parallel_size}*{training.pipeline_model_parallel_size}*"
            f"{training.context_parallel_size} = {training.model_parallel_size} does not divide the trainer's "
            f"{world} GPUs (actor_num_nodes * actor_num_gpus_per_node)",
        ))
    if cluster.colocate:
        if cluster.rollout_num_gpus != world:
            problems.append(Problem(
                "cluster.rollout_num_gpus",
                f"colocate: engines share the trainer's GPUs, so rollout_num_gpus ({cluster.rollout_num_gpus}) "
                f"must equal actor_num_nodes * actor_num_gpus_per_node ({world})",
            ))
        engine_tp, per_node = cluster.rollout_num_gpus_per_engine, cluster.actor_num_gpus_per_node
        if engine_tp >= 1 and per_node % engine_tp and engine_tp % per_node:
            problems.append(Problem(
                "cluster.rollout_num_gpus_per_engine",
                f"colocate: an engine of {engine_tp} GPUs must sit on the GPUs of whole trainer ranks: it must divide "
                f"actor_num_gpus_per_node ({per_node}) or, spanning nodes, be a multiple of it",
            ))
    elif (cluster.rollout_num_gpus < 1 and not config.rollout.rollout_external_engine_addrs
          and not cluster.debug_train_only):
        problems.append(Problem("cluster.rollout_num_gpus", "decoupled mode needs rollout_num_gpus >= 1"))
    problems += _engine_span_problems(config) + _external_engine_problems(config)
    if cluster.device == "cuda":
        if cluster.actor_num_gpus_per_node > cluster.num_gpus_per_node:
            problems.append(Problem(
                "cluster.actor_num_gpus_per_node",
                f"{cluster.actor_num_gpus_per_node} exceeds num_gpus_per_node ({cluster.num_gpus_per_node})",
            ))
    return problems


def _external_engine_problems(config: RunConfig) -> list[Problem]:
    """slime's --rollout-external-engine-addrs: each address well formed; engines another job runs cannot share
    the trainer's GPUs."""
    addresses = config.rollout.rollout_external_engine_addrs
    problems = []
    for index, address in enumerate(addresses):
        try:
            external_engine_url(address)
        except ValueError as error:
            problems.append(Problem(f"rollout.rollout_external_engine_addrs[{index}]", str(error)))
    if addresses and config.cluster.colocate:
        problems.append(Problem("rollout.rollout_external_engine_addrs",
                                "external engines run on GPUs this job does not hold, so they cannot be colocated "
                                "with the trainer: drop --colocate (or the external engines)"))
    return problems


def _engine_span_problems(config: RunConfig) -> list[Problem]:
    """An engine larger than a node spans whole nodes (SGLang's --nnodes splits its TP ranks evenly); the CPU
    engine cannot follow such an engine's weight-update group (each node's TP ranks join it in SGLang)."""
    cluster = config.cluster
    engine_tp = cluster.rollout_num_gpus_per_engine
    per_node = cluster.actor_num_gpus_per_node if cluster.colocate else cluster.num_gpus_per_node
    if engine_tp <= per_node or per_node < 1:
        return []
    if engine_tp % per_node:
        return [] if cluster.colocate else [Problem("cluster.rollout_num_gpus_per_engine",
                        f"an engine of {engine_tp} GPUs spans nodes of {per_node} GPUs, so it takes whole nodes: make "
                        f"it a multiple of {per_node} (SGLang splits an engine's TP ranks evenly over its --nnodes)")]
    if (not cluster.colocate and config.rollout.update_weight_transport != "disk"
            and engine_kind(config.rollout.engine, cluster.device) == "cpu"):
        return [Problem("cluster.rollout_num_gpus_per_engine",
                        f"the CPU engine spans {engine_tp // per_node} nodes here, and cannot join a weight-update "
                        "group with the TP ranks of every node (as SGLang does): use colocated mode, "
                        "--update-weight-transport disk, or engines of at most one node")]
    return []


def _architecture(config: RunConfig) -> tuple[ModelArchitecture | None, str, list[Problem]]:
    """The run's architecture (model flags first, else the model file), a name for messages, problems."""
    if config.model_args is not None:
        return config.model_args, "the model flags", []
    if not config.model:
        return None, "", [Problem("model", "no model architecture: give Megatron's model flags (slime's MODEL_ARGS, "
                                           "e.g. --num-layers 36 ...) or model: configs/models/<name>.yaml")]
    model_path = Path(config.model)
    if not model_path.is_file():
        return None, "", [Problem("model", f"model file {model_path} not found")]
    try:
        return ModelArchitecture.from_yaml(model_path), str(model_path), []
    except ValueError as error:
        return None, "", [Problem("model", str(error))]


def run_architecture(config: RunConfig) -> ModelArchitecture | None:
    """The run's architecture (model flags, else the model file), or None when neither gives one."""
    return _architecture(config)[0]


def _model_problems(config: RunConfig) -> list[Problem]:
    arch, model_path, found = _architecture(config)
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
            f"TP {tp} does not divide the model's {heads} {kind} ({model_path})",
        ))
    # SGLang splits attention heads over the engine's attention-TP group (its GPUs / attention DP)
    engine_tp = config.cluster.rollout_num_gpus_per_engine // attention_dp_size(config.sglang.server_options())
    if engine_tp and arch.num_attention_heads % engine_tp:
        problems.append(Problem(
            "cluster.rollout_num_gpus_per_engine",
            f"engine (attention) TP {engine_tp} does not divide the model's {arch.num_attention_heads} heads",
        ))
    try:
        training_split(arch.num_layers, config.training)
    except PipelineSplitError as error:
        problems.append(Problem("training.pipeline_model_parallel_size", f"{error} ({model_path})"))
    problems += [Problem(where, message) for where, message in dsa_training_problems(arch, config.training)]
    problems += [Problem(where, message) for where, message in hybrid_layout_problems(
        arch, tp=tp, cp=config.training.context_parallel_size)]
    hf_config = Path(config.checkpoint.hf_checkpoint) / "config.json" if config.checkpoint.hf_checkpoint else None
    if hf_config is not None and hf_config.is_file():
        try:
            hf = json.loads(hf_config.read_text())
        except json.JSONDecodeError as error:
            return problems + [Problem(str(hf_config), f"not valid JSON: {error}")]
        for mismatch in architecture_mismatches(arch, hf):
            problems.append(Problem("model", f"{model_path} and {hf_config} disagree: {mismatch}"))
    return problems


def _fp8_problems(config: RunConfig) -> list[Problem]:
    """An FP8 hf_checkpoint is one hpc_rl can serve (block e4m3, dynamic activations). force_fp8_ue8m0_scale without
    one does nothing, as in slime (a recipe's line may carry it to a bf16 run)."""
    try:
        read_fp8_blocks(config.checkpoint.hf_checkpoint)
    except ValueError as error:
        return [Problem("checkpoint.hf_checkpoint", f"{error}; FP8 rollouts need a block-FP8 release")]
    return []


def _plugin_problems(config: RunConfig) -> list[Problem]:
    problems = []
    for path in config.rollout.rollout_sample_hook_path:  # slime's repeatable --rollout-sample-hook-path
        try:
            load_plugin("sample_hook", path)
        except PluginError as error:
            problems.append(Problem("rollout.rollout_sample_hook_path", str(error)))
    for setting, kind in CONFIG_PLUGINS.items():
        section, name = setting.split(".")
        path = getattr(getattr(config, section), name, None)
        if not path:
            continue
        if kind == "reward" and config.rollout.group_rm:
            kind = "group_reward"
        try:
            load_plugin(kind, path)
        except PluginError as error:
            problems.append(Problem(setting, str(error)))
    return problems


def _single_field_problems(config: RunConfig) -> list[Problem]:
    problems = [Problem(p.field, p.message) for p in range_problems(config)]
    training, rollout = config.training, config.rollout
    if rollout.max_turns is not None and not rollout.custom_generate_function_path:
        problems.append(Problem("rollout.max_turns", "is read by a custom generate function only; set "
                                                     "custom_generate_function_path or drop max_turns"))
    algorithm = config.algorithm
    if algorithm.loss_type == "custom_loss" and not algorithm.custom_loss_function_path:
        problems.append(Problem("algorithm.loss_type", "custom_loss needs custom_loss_function_path "
                                                       "(--custom-loss-function-path module.fn)"))
    if algorithm.custom_loss_function_path and algorithm.loss_type != "custom_loss":
        problems.append(Problem("algorithm.custom_loss_function_path",
                                f"is called only with loss_type custom_loss (loss_type is {algorithm.loss_type!r}; "
                                f"slime would ignore the path silently): add --loss-type custom_loss or drop the path"))
    problems += _wandb_problems(config)
    if training.offload_train and not config.cluster.colocate:
        problems.append(Problem("training.offload_train", "offloads the trainer while colocated engines generate; "
                                                          "this run is not colocated: drop --offload/--offload-train"))
    return problems


def _routing_replay_problems(config: RunConfig) -> list[Problem]:
    """use_routing_replay / use_rollout_routing_replay: what Megatron's RouterReplay and R3 need on a MoE model."""
    training = config.training
    flags = [name for name in ("use_routing_replay", "use_rollout_routing_replay") if getattr(training, name)]
    if not flags:
        return []
    where = f"training.{flags[-1]}"
    problems = []  # (a dense model with either flag: the MoE rules' refusal)
    if "sinkhorn" in str(training.moe_router_load_balancing_type):
        problems.append(Problem(where, "Megatron's sinkhorn routing chooses experts without the replay hook: use "
                                       "--moe-router-load-balancing-type aux_loss / seq_aux_loss / none"))
    if training.use_rollout_routing_replay and is_sft(config.rollout.rollout_function_path):
        problems.append(Problem("training.use_rollout_routing_replay",
                                "SFT trains on the data's chats, which no engine routed: drop it (or use "
                                "--use-routing-replay)"))
    if training.use_rollout_routing_replay and training.moe_expert_capacity_factor is not None:
        problems.append(Problem("training.moe_expert_capacity_factor",
                                "drops tokens over an expert's capacity, which the engines never do, so the replayed "
                                "rollout routing would not be the one used: unset it with use_rollout_routing_replay"))
    return problems


def _wandb_problems(config: RunConfig) -> list[Problem]:
    logging_config = config.logging
    if not logging_config.use_wandb:
        given = [name for name in WANDB_SETTINGS if getattr(logging_config, name) is not None]
        return [Problem(f"logging.{name}", "is read only with use_wandb: add --use-wandb or drop it") for name in given]
    if importlib.util.find_spec("wandb") is None:
        return [Problem("logging.use_wandb", "needs the wandb package, which is not installed here: "
                                             "pip install 'hpc_rl[wandb]' (from a checkout: pip install -e '.[wandb]') "
                                             "where the job runs, or drop --use-wandb")]
    return []


def _moe_and_memory_problems(config: RunConfig) -> list[Problem]:
    """Experts, optimizer offload, SGLang's MoE options; then (cuda runs whose layout is sound) the per-GPU
    memory plan (`hpc_rl.config.memory_plan`)."""
    arch = run_architecture(config)
    found = (moe_problems(config, arch) + optimizer_problems(config) + sglang_moe_problems(config, arch)
             + mla_problems(config, arch))
    problems = [Problem(where, message) for where, message in found]
    sound = (arch is not None and ParallelLayout.of(config.training, config.cluster.trainer_world_size, arch).splits(arch)
             and _pipeline_splits(arch, config))
    if arch is not None and config.cluster.device == "cuda" and sound and config.cluster.rollout_num_gpus_per_engine >= 1:
        problems += [Problem(where, message) for where, message in plan_memory(config, arch).problems()]
    return problems


def _pipeline_splits(arch: ModelArchitecture, config: RunConfig) -> bool:
    try:
        training_split(arch.num_layers, config.training)
    except PipelineSplitError:
        return False
    return True


def _slime_flag_problems(config: RunConfig) -> list[Problem]:
    """Cross-field rules of the slime flags of issues 25/26 (checkpoint, reference, old log-probs)."""
    checkpoint, algorithm = config.checkpoint, config.algorithm
    problems = []
    has_reference = algorithm.use_kl_loss or algorithm.kl_coef != 0.0
    if algorithm.ref_update_interval is not None and not has_reference:
        problems.append(Problem("algorithm.ref_update_interval", "updates the reference model, which this run does "
                                "not have (it needs use_kl_loss or kl_coef): drop it or add the KL term"))
    if checkpoint.ref_ckpt_step is not None and not checkpoint.ref_load:
        problems.append(Problem("checkpoint.ref_ckpt_step", "picks an iteration of ref_load, which is not set: "
                                "give --ref-load a torch_dist checkpoint root"))
    if algorithm.keep_old_actor and algorithm.use_rollout_logprobs:
        problems.append(Problem("algorithm.keep_old_actor", "computes old log-probs at the engines' weights, but "
                                "use_rollout_logprobs takes the engines' own log-probs: drop one of them"))
    if algorithm.use_score_centering and config.training.context_parallel_size > 1:
        problems.append(Problem("algorithm.use_score_centering", "scores the engines' top-k ids at each response "
                                "token, which hpc_rl does only without context parallelism: set "
                                "context_parallel_size 1 or drop use_score_centering"))
    if algorithm.use_score_centering and algorithm.custom_loss_function_path:
        problems.append(Problem("algorithm.use_score_centering", "corrects the built-in REINFORCE loss, which "
                                "custom_loss_function_path replaces: drop one of them"))
    if algorithm.get_mismatch_metrics and not algorithm.custom_tis_function_path:
        problems.append(Problem("algorithm.get_mismatch_metrics", "runs custom_tis_function_path for its metrics, "
                                "which is not set (slime asserts the same): add --custom-tis-function-path"))
    if algorithm.use_rollout_entropy and not algorithm.custom_advantage_function_path:
        problems.append(Problem("algorithm.use_rollout_entropy", "hands the log-prob passes' entropies to "
                                "custom_advantage_function_path, which is not set: add it or drop the flag"))
    training = config.training
    for field_name in ("balance_by_flops", "log_probs_max_tokens_per_gpu"):
        if getattr(training, field_name) and not training.use_dynamic_batch_size:
            problems.append(Problem(f"training.{field_name}", "packs micro-batches by tokens, so it needs "
                                    "use_dynamic_batch_size (and max_tokens_per_gpu), as slime does"))
    if training.only_train_params_name_list and training.freeze_params_name_list:
        problems.append(Problem("training.freeze_params_name_list", "give only one of only_train_params_name_list "
                                "and freeze_params_name_list (slime refuses both too)"))
    for field_name in ("only_train_params_name_list", "freeze_params_name_list"):
        for pattern in getattr(training, field_name) or ():
            try:
                re.compile(pattern)
            except re.error as error:
                problems.append(Problem(f"training.{field_name}", f"{pattern!r} is not a regular expression: {error}"))
    rollout = config.rollout
    if rollout.update_weight_transport not in ("nccl", "disk"):
        problems.append(Problem("rollout.update_weight_transport", f"{rollout.update_weight_transport!r} is not nccl "
                                "or disk"))
    if rollout.update_weight_mode != "full":
        problems.append(Problem("rollout.update_weight_mode", f"{rollout.update_weight_mode!r}: only full is offered "
                                "(slime's delta mode needs its SGLang patches: /pull_weights and per-host local "
                                "checkpoints); use full with transport disk or nccl"))
    if rollout.update_weight_transport == "disk":
        if not rollout.update_weight_disk_dir:
            problems.append(Problem("rollout.update_weight_disk_dir", "transport disk writes each version there: "
                                    "give a directory the trainer and the engines both see (slime requires it too)"))
        if config.cluster.colocate:
            problems.append(Problem("rollout.update_weight_transport", "colocated engines get the weights from the "
                                    "trainer on the same GPUs (shared memory / CUDA IPC); disk is for decoupled "
                                    "engines: drop it or drop --colocate"))
    else:
        for name in ("update_weight_disk_dir", "update_weight_disk_keep_files", "custom_update_weight_post_write_path"):
            if getattr(rollout, name):
                problems.append(Problem(f"rollout.{name}", "is read only with update_weight_transport disk: add "
                                        "--update-weight-transport disk or drop it"))
    problems += _flush_cache_interval_problems(config)
    custom_config = config.rollout.custom_config_path
    if custom_config and Path(custom_config).is_file():
        try:
            clashing = sorted(set(custom_config_values(custom_config)) & set(flat_index()))
        except ValueError as error:
            problems.append(Problem("rollout.custom_config_path", str(error)))
        else:
            if clashing:
                problems.append(Problem("rollout.custom_config_path", f"{custom_config} sets config fields "
                                        f"{', '.join(clashing)}: give those as flags or YAML settings (the file is "
                                        "for your plug-ins' own values)"))
    if checkpoint.model_name:
        arch, _, _ = _architecture(config)
        name = checkpoint.model_name.lower().replace("_", "").replace("-", "")
        family = arch.family.replace("_", "") if arch is not None else None
        if family is not None and family not in name:
            problems.append(Problem("checkpoint.model_name", f"{checkpoint.model_name!r} names another family than "
                                    f"the architecture's {arch.family!r} (hpc_rl converts weights by the "  # type: ignore[union-attr]
                                    f"architecture): drop --model-name or fix the model flags"))
    if checkpoint.save_hf:
        try:
            checkpoint.save_hf.format(rollout_id=0)
        except (KeyError, IndexError, ValueError) as error:
            problems.append(Problem("checkpoint.save_hf", f"{checkpoint.save_hf!r} is not a path template with only "
                                    f"{{rollout_id}} in braces ({type(error).__name__}: {error})"))
    return problems
# -- GPU cluster: placement, precision, containers (issue 22) ---------------------------------------------------
CONTAINER_RUNTIMES = ("pyxis", "apptainer")


def _gpu_cluster_problems(config: RunConfig) -> list[Problem]:
    cluster, slurm = config.cluster, config.slurm
    problems = []
    if cluster.colocate and config.rollout.async_rollout:
        problems.append(Problem("rollout.async_rollout", "colocated engines cannot generate while the trainer trains "
                                "on the same GPUs (slime's train_async.py refuses --colocate too): drop --train-async, "
                                "or give the engines their own GPUs (no --colocate, --rollout-num-gpus N)"))
    trainer_dtype = trainer_dtype_name(cluster.device) if cluster.device in TRAINER_DTYPES else None
    engine_dtype = sglang_name_of_dtype(config.sglang.server_options().get("dtype"))
    if trainer_dtype and engine_dtype not in (None, trainer_dtype):
        problems.append(Problem("sglang.dtype", f"{config.sglang.server_options()['dtype']!r}: the engines must serve "
                                f"the dtype the trainer exports ({trainer_dtype} on {cluster.device}), else their "
                                "log-probs differ from the trainer's; remove the option (hpc_rl passes it)"))
    mismatch = config.controller.max_logprob_mismatch
    if mismatch is not None and mismatch < 0:
        problems.append(Problem("controller.max_logprob_mismatch", f"{mismatch} must be >= 0 (0: never fail)"))
    if slurm.container_runtime not in CONTAINER_RUNTIMES:
        problems.append(Problem("slurm.container_runtime", f"{slurm.container_runtime!r} must be one of "
                                f"{', '.join(CONTAINER_RUNTIMES)}"))
    for index, mount in enumerate(slurm.container_mounts):
        parts = mount.split(":")
        if not 2 <= len(parts) <= 3 or not all(parts[:2]) or not parts[1].startswith("/"):
            problems.append(Problem(f"slurm.container_mounts[{index}]", f"{mount!r} must be SRC:DST or "
                                    "SRC:DST:FLAGS with an absolute DST (e.g. /data:/data:ro)"))
    if (slurm.container_mounts or slurm.container_runtime != "pyxis") and not slurm.container_image:
        problems.append(Problem("slurm.container_image", "container_runtime/container_mounts are set but no "
                                "container_image: set the image (or drop the container settings)"))
    return problems


def sglang_name_of_dtype(value: object) -> str | None:
    """SGLang's --dtype spellings as the trainer's names (auto/None: not set)."""
    if value in (None, "auto"):
        return None
    return {"float": "float32", "half": "float16"}.get(str(value), str(value))


def collect_problems(config: RunConfig, *, check_files: bool = True) -> list[Problem]:
    """Every problem found in `config` (empty list = valid). With check_files, every line of the
    prompt files is checked too (not a sample of them)."""
    problems = (_single_field_problems(config) + _batch_problems(config) + _topology_problems(config)
                + _model_problems(config) + _slime_flag_problems(config) + _gpu_cluster_problems(config))
    problems += _moe_and_memory_problems(config)
    problems += _routing_replay_problems(config)
    problems += _fp8_problems(config)
    if check_files:
        problems += [Problem(p.field, p.message) for p in path_problems(config) + prompt_file_problems(config)]
    problems += _plugin_problems(config)
    problems += [Problem(field, message) for field, message in lora_problems(
        config, run_architecture(config), check_files=check_files)]
    problems += [Problem(field, message) for field, message in mode_problems(config, check_files=check_files)]
    problems += [Problem(field, message) for field, message in engine_problems(
        config.rollout.engine, config.cluster.device, config.sglang.server_options()).items()]
    return problems


def validate(config: RunConfig, *, check_files: bool = True) -> None:
    """Raise ValidationFailed listing every problem, or return if the config is valid."""
    problems = collect_problems(config, check_files=check_files)
    if problems:
        raise ValidationFailed(problems)
    for note in device_notes(config, run_architecture(config)) + speculative_notes(config):
        log.info(note)


def _flush_cache_interval_problems(config: RunConfig) -> list[Problem]:
    """In-place weight updates (flush_cache_interval other than 1) need engines that keep generating while the
    trainer trains (async, decoupled) and a transport whose engine call can keep the cache (SGLang's
    /update_weights_from_disk and /update_weights_from_tensor always flush)."""
    rollout, field_name = config.rollout, "rollout.flush_cache_interval"
    if rollout.flush_cache_interval < 0:
        return [Problem(field_name, f"{rollout.flush_cache_interval} is negative: give N >= 1 (flush every N-th "
                        "sync) or 0 (never flush)")]
    if rollout.flush_cache_interval == 1:
        return []
    if config.cluster.colocate:
        return [Problem(field_name, "in-place weight updates need engines on their own GPUs (slime refuses "
                        "--flush-cache-interval with --colocate too): drop it or drop --colocate")]
    if not rollout.async_rollout:
        return [Problem(field_name, "in-place weight updates happen while the next rollout generates: add "
                        "--async-rollout (rollout.async_rollout: true) or drop it")]
    if rollout.update_weight_transport == "disk":
        return [Problem(field_name, "SGLang's /update_weights_from_disk always flushes the cache, which fails while "
                        "requests are paused in place: use update_weight_transport nccl or drop it")]
    return []
