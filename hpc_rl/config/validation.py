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
from dataclasses import dataclass
from pathlib import Path

from hpc_rl.config.memory_plan import plan_memory
from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
from hpc_rl.config.parallel_layout import ParallelLayout
from hpc_rl.config.moe_checks import device_notes, moe_problems, optimizer_problems, sglang_moe_problems
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.file_checks import path_problems, prompt_file_problems
from hpc_rl.config.value_ranges import range_problems
from hpc_rl.config.sglang_options import engine_problems
from hpc_rl.plugins import PluginError, load_plugin

CONFIG_PLUGINS = {"rollout.custom_rm_path": "reward", "rollout.dynamic_sampling_filter_path": "dynamic_sampling_filter",
                  "rollout.buffer_filter_path": "buffer_filter", "rollout.custom_generate_function_path": "generate",
                  "algorithm.custom_loss_function_path": "loss",
                  "algorithm.custom_advantage_function_path": "advantage"}
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
            f"({training.global_batch_size} * {training.num_steps_per_rollout} = {trained}); "
            f"e.g. set global_batch_size to {samples // max(1, training.num_steps_per_rollout)}",
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
    if rollout.rm_type is None and rollout.custom_rm_path is None:
        problems.append(Problem("rollout.rm_type", "no reward: set rm_type (e.g. deepscaler) or custom_rm_path"))
    if rollout.rm_type == "remote_rm" and not rollout.rm_url:
        problems.append(Problem("rollout.rm_url", "rm_type remote_rm needs rm_url"))
    if config.eval.eval_interval is not None and not config.eval.eval_prompt_data:
        problems.append(Problem("eval.eval_interval", "eval_interval is set but eval_prompt_data is empty"))
    if rollout.num_rollout is None and rollout.num_epoch is None:
        problems.append(Problem("rollout.num_rollout", "set num_rollout or num_epoch"))
    return problems


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
        if cluster.rollout_num_gpus_per_engine >= 1 and cluster.actor_num_gpus_per_node % cluster.rollout_num_gpus_per_engine:
            problems.append(Problem(
                "cluster.rollout_num_gpus_per_engine",
                f"colocate: an engine of {cluster.rollout_num_gpus_per_engine} GPUs must sit on the GPUs of whole "
                f"trainer ranks of one node; it does not divide actor_num_gpus_per_node ({cluster.actor_num_gpus_per_node})",
            ))
        if training.pipeline_model_parallel_size > 1:
            problems.append(Problem(
                "training.pipeline_model_parallel_size",
                "colocate: every trainer rank hands full tensors to the engine on its GPUs, which pipeline "
                "parallelism splits; use pipeline_model_parallel_size 1 or decoupled mode (colocate: false)",
            ))
    elif cluster.rollout_num_gpus < 1:
        problems.append(Problem("cluster.rollout_num_gpus", "decoupled mode needs rollout_num_gpus >= 1"))
    if cluster.device == "cuda":
        if cluster.actor_num_gpus_per_node > cluster.num_gpus_per_node:
            problems.append(Problem(
                "cluster.actor_num_gpus_per_node",
                f"{cluster.actor_num_gpus_per_node} exceeds num_gpus_per_node ({cluster.num_gpus_per_node})",
            ))
        if cluster.rollout_num_gpus_per_engine > cluster.num_gpus_per_node:
            problems.append(Problem(
                "cluster.rollout_num_gpus_per_engine",
                f"an engine cannot span nodes: {cluster.rollout_num_gpus_per_engine} > num_gpus_per_node "
                f"({cluster.num_gpus_per_node})",
            ))
    return problems


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
    if arch.num_query_groups % tp:
        problems.append(Problem(
            "training.tensor_model_parallel_size",
            f"TP {tp} does not divide the model's {arch.num_query_groups} KV heads ({model_path})",
        ))
    engine_tp = config.cluster.rollout_num_gpus_per_engine
    if arch.num_attention_heads % engine_tp:
        problems.append(Problem(
            "cluster.rollout_num_gpus_per_engine",
            f"engine TP {engine_tp} does not divide the model's {arch.num_attention_heads} heads",
        ))
    if arch.num_layers % config.training.pipeline_model_parallel_size:
        problems.append(Problem(
            "training.pipeline_model_parallel_size",
            f"PP {config.training.pipeline_model_parallel_size} does not divide the model's num_layers "
            f"({arch.num_layers}, {model_path}): every pipeline stage holds num_layers / PP layers",
        ))
    hf_config = Path(config.checkpoint.hf_checkpoint) / "config.json" if config.checkpoint.hf_checkpoint else None
    if hf_config is not None and hf_config.is_file():
        try:
            hf = json.loads(hf_config.read_text())
        except json.JSONDecodeError as error:
            return problems + [Problem(str(hf_config), f"not valid JSON: {error}")]
        for mismatch in architecture_mismatches(arch, hf):
            problems.append(Problem("model", f"{model_path} and {hf_config} disagree: {mismatch}"))
    return problems


def _plugin_problems(config: RunConfig) -> list[Problem]:
    problems = []
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
    found = moe_problems(config, arch) + optimizer_problems(config) + sglang_moe_problems(config, arch)
    problems = [Problem(where, message) for where, message in found]
    sound = arch is not None and ParallelLayout.of(config.training, config.cluster.trainer_world_size, arch).splits(arch)
    if arch is not None and config.cluster.device == "cuda" and sound and config.cluster.rollout_num_gpus_per_engine >= 1:
        problems += [Problem(where, message) for where, message in plan_memory(config, arch).problems()]
    return problems


def collect_problems(config: RunConfig, *, check_files: bool = True) -> list[Problem]:
    """Every problem found in `config` (empty list = valid). With check_files, every line of the
    prompt files is checked too (not a sample of them)."""
    problems = (_single_field_problems(config) + _batch_problems(config) + _topology_problems(config)
                + _model_problems(config))
    problems += _moe_and_memory_problems(config)
    problems += _routing_replay_problems(config)
    if check_files:
        problems += [Problem(p.field, p.message) for p in path_problems(config) + prompt_file_problems(config)]
    problems += _plugin_problems(config)
    problems += [Problem(field, message) for field, message in engine_problems(
        config.rollout.engine, config.cluster.device, config.sglang.server_options()).items()]
    return problems


def validate(config: RunConfig, *, check_files: bool = True) -> None:
    """Raise ValidationFailed listing every problem, or return if the config is valid."""
    problems = collect_problems(config, check_files=check_files)
    if problems:
        raise ValidationFailed(problems)
    for note in device_notes(config, run_architecture(config)):
        log.info(note)
