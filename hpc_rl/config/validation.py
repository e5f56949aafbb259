"""Submit-time validation of a whole `RunConfig`: every problem in one pass, before anything is queued.

Owns: collecting the problems of every rule module (`collect_problems`, with the model resolved once:
`resolved_model`) and raising them together, each at the file line or flag that set its field (`validate`,
`ValidationFailed`); the rules of each concept live in its own module (docs/architecture.md lists them): batch
arithmetic and engine topology (`layout_checks`), the trainer's parallel layout (`parallel_layout`), the model vs its
layout and checkpoint (`model_checks`), MoE and routing replay (`moe_checks`), MTP and speculative decoding
(`mtp_checks`), the memory plan (`memory_plan`), slime's cross-flag rules (`slime_flag_checks`), the GPU cluster
(`cluster_checks`), plug-ins (`plugin_checks`), training modes (`training_modes`), LoRA (`lora_checks`), engines
(`sglang_options`), single-field ranges (`value_ranges`) and files (`file_checks`, skippable with `--no-check-files`
for rendering a job away from the cluster's filesystem). This module keeps the few rules of no other home: pairs of
fields with no concept of their own, and wandb. Each problem names the field and the fix.
"""

from __future__ import annotations

import importlib.util
import logging

from hpc_rl.config.cluster_checks import gpu_cluster_problems
from hpc_rl.config.file_checks import multimodal_config_problems, path_problems, prompt_file_problems
from hpc_rl.config.layout_checks import batch_problems, topology_problems
from hpc_rl.config.lora_checks import lora_problems
from hpc_rl.config.mtp_checks import speculative_notes
from hpc_rl.config.model_checks import fp8_problems, model_problems, moe_and_memory_problems
from hpc_rl.config.moe_checks import device_notes, routing_replay_problems
from hpc_rl.config.plugin_checks import plugin_problems
from hpc_rl.config.problems import Problem, locate, setting_locations
from hpc_rl.config.resolved_model import ResolvedModel, resolve_model
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sglang_options import engine_problems
from hpc_rl.config.slime_flag_checks import slime_flag_problems
from hpc_rl.config.training_modes import mode_problems
from hpc_rl.config.value_ranges import range_problems

log = logging.getLogger(__name__)
WANDB_SETTINGS = ("wandb_mode", "wandb_project", "wandb_team", "wandb_group", "wandb_key", "wandb_host", "wandb_dir",
                  "wandb_run_id")


class ValidationFailed(ValueError):
    """Raised with every problem found (one line each)."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems))


def _single_field_problems(config: RunConfig) -> list[Problem]:
    problems = range_problems(config)
    training, rollout = config.training, config.rollout
    if rollout.max_turns is not None and not rollout.custom_generate_function_path:
        problems.append(Problem("rollout.max_turns", "unused",
                                "is read by a custom generate function only; set "
                                "custom_generate_function_path or drop max_turns"))
    algorithm = config.algorithm
    if algorithm.loss_type == "custom_loss" and not algorithm.custom_loss_function_path:
        problems.append(Problem("algorithm.loss_type", "needs", "custom_loss needs custom_loss_function_path "
                                                       "(--custom-loss-function-path module.fn)"))
    if algorithm.custom_loss_function_path and algorithm.loss_type != "custom_loss":
        problems.append(Problem("algorithm.custom_loss_function_path",
                                "unused",
                                f"is called only with loss_type custom_loss (loss_type is {algorithm.loss_type!r}; "
                                f"slime would ignore the path silently): add --loss-type custom_loss or drop the path"))
    problems += _wandb_problems(config)
    if training.offload_train and not config.cluster.colocate:
        problems.append(Problem("training.offload_train", "unused",
                                "offloads the trainer while colocated engines generate; "
                                "this run is not colocated: drop --offload/--offload-train"))
    return problems


def _wandb_problems(config: RunConfig) -> list[Problem]:
    logging_config = config.logging
    if not logging_config.use_wandb:
        given = [name for name in WANDB_SETTINGS if getattr(logging_config, name) is not None]
        return [Problem(f"logging.{name}", "unused",
                        "is read only with use_wandb: add --use-wandb or drop it") for name in given]
    if importlib.util.find_spec("wandb") is None:
        return [Problem("logging.use_wandb", "needs", "needs the wandb package, which is not installed here: "
                                             "pip install 'hpc_rl[wandb]' (from a checkout: pip install -e '.[wandb]') "
                                             "where the job runs, or drop --use-wandb")]
    return []


def collect_problems(config: RunConfig, *, check_files: bool = True,
                     model: ResolvedModel | None = None) -> list[Problem]:
    """Every problem found in `config` (empty list = valid). With check_files, every line of the prompt files is
    checked too (not a sample of them). The model is resolved once (`model`, or here) and handed to every check
    that reads it. `validate` locates them (the file line or flag that set each field)."""
    model = model or resolve_model(config)
    problems = (_single_field_problems(config) + batch_problems(config) + topology_problems(config)
                + model_problems(config, model) + slime_flag_problems(config, model) + gpu_cluster_problems(config))
    problems += moe_and_memory_problems(config, model)
    problems += routing_replay_problems(config)
    problems += fp8_problems(config, model)
    problems += multimodal_config_problems(config)
    if check_files:
        problems += path_problems(config) + prompt_file_problems(config)
    problems += plugin_problems(config)
    problems += lora_problems(config, model.arch, check_files=check_files)
    problems += mode_problems(config, check_files=check_files)
    problems += engine_problems(config.rollout.engine, config.cluster.device, config.sglang.server_options())
    return problems


def validate(config: RunConfig, *, check_files: bool = True) -> None:
    """Raise ValidationFailed listing every problem, each at the file line or flag that set its field (when the
    config was loaded), or return if the config is valid."""
    model = resolve_model(config)
    problems = collect_problems(config, check_files=check_files, model=model)
    if problems:
        raise ValidationFailed(locate(problems, setting_locations(config)))
    for note in device_notes(config, model.arch) + speculative_notes(config):
        log.info(note)

