"""Cross-field rules of slime's flags (issues 25/26): checkpoint, reference, old log-probs, weight transport.

Owns: the rules between slime flags that no single section can check (a reference without KL, keep_old_actor with
rollout log-probs, score centering, token-packed micro-batches, parameter-name regexes, the weight transport and
its disk settings, in-place weight updates (flush_cache_interval), a custom config file clashing with config
fields, model_name vs the architecture, the save_hf template). Called by
`hpc_rl.config.validation.collect_problems`.
"""

from __future__ import annotations

import re
from pathlib import Path

from hpc_rl.config.plugin_args import custom_config_values
from hpc_rl.config.problems import Problem
from hpc_rl.config.resolved_model import ResolvedModel, resolve_model
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.settings_sources import flat_index


def slime_flag_problems(config: RunConfig, model: ResolvedModel | None = None) -> list[Problem]:
    """Cross-field rules of the slime flags of issues 25/26 (checkpoint, reference, old log-probs)."""
    checkpoint, algorithm = config.checkpoint, config.algorithm
    problems = []
    has_reference = algorithm.use_kl_loss or algorithm.kl_coef != 0.0
    if algorithm.ref_update_interval is not None and not has_reference:
        problems.append(Problem("algorithm.ref_update_interval", "needs",
                                "updates the reference model, which this run does "
                                "not have (it needs use_kl_loss or kl_coef): drop it or add the KL term"))
    if checkpoint.ref_ckpt_step is not None and not checkpoint.ref_load:
        problems.append(Problem("checkpoint.ref_ckpt_step", "needs",
                                "picks an iteration of ref_load, which is not set: "
                                "give --ref-load a torch_dist checkpoint root"))
    if algorithm.keep_old_actor and algorithm.use_rollout_logprobs:
        problems.append(Problem("algorithm.keep_old_actor", "conflict",
                                "computes old log-probs at the engines' weights, but "
                                "use_rollout_logprobs takes the engines' own log-probs: drop one of them"))
    if algorithm.use_score_centering and config.training.context_parallel_size > 1:
        problems.append(Problem("algorithm.use_score_centering", "unsupported",
                                "scores the engines' top-k ids at each response "
                                "token, which hpc_rl does only without context parallelism: set "
                                "context_parallel_size 1 or drop use_score_centering"))
    if algorithm.use_score_centering and algorithm.custom_loss_function_path:
        problems.append(Problem("algorithm.use_score_centering", "conflict",
                                "corrects the built-in REINFORCE loss, which "
                                "custom_loss_function_path replaces: drop one of them"))
    if algorithm.get_mismatch_metrics and not algorithm.custom_tis_function_path:
        problems.append(Problem("algorithm.get_mismatch_metrics", "needs",
                                "runs custom_tis_function_path for its metrics, "
                                "which is not set (slime asserts the same): add --custom-tis-function-path"))
    if algorithm.use_rollout_entropy and not algorithm.custom_advantage_function_path:
        problems.append(Problem("algorithm.use_rollout_entropy", "needs",
                                "hands the log-prob passes' entropies to "
                                "custom_advantage_function_path, which is not set: add it or drop the flag"))
    training = config.training
    for field_name in ("balance_by_flops", "log_probs_max_tokens_per_gpu"):
        if getattr(training, field_name) and not training.use_dynamic_batch_size:
            problems.append(Problem(f"training.{field_name}", "needs",
                                    "packs micro-batches by tokens, so it needs "
                                    "use_dynamic_batch_size (and max_tokens_per_gpu), as slime does"))
    if training.only_train_params_name_list and training.freeze_params_name_list:
        problems.append(Problem("training.freeze_params_name_list", "conflict",
                                "give only one of only_train_params_name_list "
                                "and freeze_params_name_list (slime refuses both too)"))
    for field_name in ("only_train_params_name_list", "freeze_params_name_list"):
        for pattern in getattr(training, field_name) or ():
            try:
                re.compile(pattern)
            except re.error as error:
                problems.append(Problem(f"training.{field_name}", "bad_type",
                                        f"{pattern!r} is not a regular expression: {error}"))
    rollout = config.rollout
    if rollout.update_weight_mode != "full":
        problems.append(Problem("rollout.update_weight_mode", "not_one_of",
                                f"{rollout.update_weight_mode!r}: only full is offered "
                                "(slime's delta mode needs its SGLang patches: /pull_weights and per-host local "
                                "checkpoints); use full with transport disk or nccl"))
    if rollout.update_weight_transport == "disk":
        if not rollout.update_weight_disk_dir:
            problems.append(Problem("rollout.update_weight_disk_dir", "needs",
                                    "transport disk writes each version there: "
                                    "give a directory the trainer and the engines both see (slime requires it too)"))
        if config.cluster.colocate:
            problems.append(Problem("rollout.update_weight_transport", "unsupported",
                                    "colocated engines get the weights from the "
                                    "trainer on the same GPUs (shared memory / CUDA IPC); disk is for decoupled "
                                    "engines: drop it or drop --colocate"))
    else:
        for name in ("update_weight_disk_dir", "update_weight_disk_keep_files", "custom_update_weight_post_write_path"):
            if getattr(rollout, name):
                problems.append(Problem(f"rollout.{name}", "unused",
                                        "is read only with update_weight_transport disk: add "
                                        "--update-weight-transport disk or drop it"))
    problems += flush_cache_interval_problems(config)
    custom_config = config.rollout.custom_config_path
    if custom_config and Path(custom_config).is_file():
        try:
            clashing = sorted(set(custom_config_values(custom_config)) & set(flat_index()))
        except ValueError as error:
            problems.append(Problem("rollout.custom_config_path", "bad_file", str(error)))
        else:
            if clashing:
                problems.append(Problem("rollout.custom_config_path", "conflict",
                                        f"{custom_config} sets config fields "
                                        f"{', '.join(clashing)}: give those as flags or YAML settings (the file is "
                                        "for your plug-ins' own values)"))
    if checkpoint.model_name:
        arch = (model or resolve_model(config)).arch
        name = checkpoint.model_name.lower().replace("_", "").replace("-", "")
        family = arch.family.replace("_", "") if arch is not None else None
        if family is not None and family not in name:
            problems.append(Problem("checkpoint.model_name", "mismatch",
                                    f"{checkpoint.model_name!r} names another family than "
                                    f"the architecture's {arch.family!r} (hpc_rl converts weights by the "  # type: ignore[union-attr]
                                    f"architecture): drop --model-name or fix the model flags"))
    if checkpoint.save_hf:
        try:
            checkpoint.save_hf.format(rollout_id=0)
        except (KeyError, IndexError, ValueError) as error:
            problems.append(Problem("checkpoint.save_hf", "bad_type",
                                    f"{checkpoint.save_hf!r} is not a path template with only "
                                    f"{{rollout_id}} in braces ({type(error).__name__}: {error})"))
    return problems


def flush_cache_interval_problems(config: RunConfig) -> list[Problem]:
    """In-place weight updates (flush_cache_interval other than 1) need engines that keep generating while the
    trainer trains (async, decoupled) and a transport whose engine call can keep the cache (SGLang's
    /update_weights_from_disk and /update_weights_from_tensor always flush)."""
    rollout, field_name = config.rollout, "rollout.flush_cache_interval"
    if rollout.flush_cache_interval < 0:
        return [Problem(field_name, "out_of_range",
                        f"{rollout.flush_cache_interval} is negative: give N >= 1 (flush every N-th "
                        "sync) or 0 (never flush)")]
    if rollout.flush_cache_interval == 1:
        return []
    if config.cluster.colocate:
        return [Problem(field_name, "needs",
                        "in-place weight updates need engines on their own GPUs (slime refuses "
                        "--flush-cache-interval with --colocate too): drop it or drop --colocate")]
    if not rollout.async_rollout:
        return [Problem(field_name, "needs",
                        "in-place weight updates happen while the next rollout generates: add "
                        "--async-rollout (rollout.async_rollout: true) or drop it")]
    if rollout.update_weight_transport == "disk":
        return [Problem(field_name, "unsupported",
                        "SGLang's /update_weights_from_disk always flushes the cache, which fails while "
                        "requests are paused in place: use update_weight_transport nccl or drop it")]
    return []
