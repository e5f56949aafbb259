"""Value ranges of single fields, checked at submit time: a batch of 0 or an lr of -1 never queues.

Owns: the table of which fields must be >= 1, >= 0, > 0 or within [0, 1], refusing NaN and infinity in
any number of the config (and numbers past float32's range), and the sampling-parameter
rules SGLang itself enforces (temperature >= 0, top_p in (0, 1], top_k -1 or >= 1), for the training
and the eval sampling alike. Each problem names the field, the value and the allowed range.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from hpc_rl.config.problems import Problem
from hpc_rl.config.schema import RunConfig


def _at_least(low: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= low), f">= {low:g}"


_POSITIVE = ((lambda v: v > 0), "> 0")
_UNIT = ((lambda v: 0 <= v <= 1), "within [0, 1]")
_BETA = ((lambda v: 0 <= v < 1), "within [0, 1)")

# field path -> (test, allowed range); None values (not set) are not checked.
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{path: _at_least(1) for path in (
        "cluster.actor_num_nodes", "cluster.actor_num_gpus_per_node", "cluster.rollout_num_gpus_per_engine",
        "cluster.num_gpus_per_node", "rollout.num_rollout", "rollout.num_epoch", "rollout.rollout_batch_size",
        "rollout.n_samples_per_prompt", "rollout.rollout_max_response_len", "rollout.rollout_max_context_len",
        "rollout.over_sampling_batch_size", "rollout.max_turns", "rollout.update_weights_interval",
        "rollout.update_weight_buffer_size", "training.global_batch_size", "training.num_steps_per_rollout",
        "training.micro_batch_size", "training.max_tokens_per_gpu", "training.tensor_model_parallel_size",
        "training.pipeline_model_parallel_size", "training.context_parallel_size", "training.recompute_num_layers",
        "training.num_threads", "slurm.cpus_per_gpu", "checkpoint.save_interval", "eval.eval_interval", "eval.n_samples_per_eval_prompt",
        "eval.eval_max_response_len", "sglang.server_concurrency", "slurm.cpus_per_task",
        "rollout.rollout_max_prompt_len", "checkpoint.keep_last")},
    **{path: _at_least(0) for path in (
        "cluster.rollout_num_gpus", "rollout.max_staleness", "rollout.reward_workers", "rollout.answer_parse_workers", "algorithm.kl_loss_coef", "algorithm.kl_coef",
        "algorithm.tis_clip_low", "optimizer.min_lr", "optimizer.lr_warmup_iters", "optimizer.lr_decay_iters",
        "optimizer.weight_decay", "optimizer.clip_grad", "controller.max_engine_restarts",
        "slurm.requeue_signal_seconds", "slurm.max_num_timeout", "training.max_nonfinite_steps")},
    **{path: _POSITIVE for path in (
        "optimizer.lr", "optimizer.adam_eps", "algorithm.eps_clip", "algorithm.eps_clip_high", "algorithm.tis_clip",
        "controller.registration_timeout", "controller.engine_health_interval", "controller.engine_request_timeout",
        "controller.engine_admin_timeout", "rollout.reward_timeout", "controller.trainer_command_timeout")},
    **{path: _UNIT for path in ("algorithm.gamma", "algorithm.lambd", "sglang.mem_fraction_static",
                                "optimizer.optimizer_offload_fraction")},
    "cluster.gpu_memory_gib": _POSITIVE,
    **{path: _BETA for path in ("optimizer.adam_beta1", "optimizer.adam_beta2")},
    # slime / vime flags of issues 25 and 26
    **{path: _at_least(0) for path in ("training.train_memory_margin_bytes", "controller.engine_health_first_wait")},
    **{path: _POSITIVE for path in ("controller.engine_health_timeout",)},
    **{path: _at_least(0) for path in ("checkpoint.ref_ckpt_step", "checkpoint.ckpt_step", "checkpoint.start_rollout_id")},
    **{path: _at_least(1) for path in ("algorithm.ref_update_interval", "eval.eval_max_prompt_len",
                                       "eval.eval_max_context_len", "training.log_probs_max_tokens_per_gpu",
                                       "training.distributed_timeout_minutes")},
    **{path: _at_least(0) for path in ("eval.eval_min_new_tokens",)},
    "controller.frame_signer_min_bytes": _at_least(0),
}

# (temperature, top_p, top_k) field paths of each sampling setting.
SAMPLING_FIELDS = (
    ("rollout.rollout_temperature", "rollout.rollout_top_p", "rollout.rollout_top_k"),
    ("eval.eval_temperature", "eval.eval_top_p", "eval.eval_top_k"),
)


def _value(config: RunConfig, path: str) -> Any:
    section, name = path.split(".")
    return getattr(getattr(config, section), name)


def _sampling_problems(config: RunConfig) -> Iterator[Problem]:
    for temperature_path, top_p_path, top_k_path in SAMPLING_FIELDS:
        temperature, top_p, top_k = (_value(config, p) for p in (temperature_path, top_p_path, top_k_path))
        if temperature is not None and temperature < 0:
            yield Problem(temperature_path, "out_of_range",
                          f"{temperature} must be >= 0 (0: greedy); SGLang rejects it")
        if top_p is not None and not 0 < top_p <= 1:
            yield Problem(top_p_path, "out_of_range", f"{top_p} must be within (0, 1]; SGLang rejects it")
        if top_k is not None and top_k != -1 and top_k < 1:
            yield Problem(top_k_path, "out_of_range", f"{top_k} must be -1 (off) or >= 1; SGLang rejects it")


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: the trainer computes in float32 (bf16 on GPUs, whose range is the same)."""


def _nonfinite_problems(config: RunConfig) -> Iterator[Problem]:
    """Every number of the config that is NaN or infinite (`--lr inf`, `--rollout-temperature nan`: YAML and
    Python's float() read both): none has a meaning, and a NaN passes every range test. Also every number past
    float32's range (`--lr 1e39`): finite in Python, but torch's optimizer fails on it mid-run ("cannot be
    converted to type float without overflow"), and nothing in a run needs such a value."""
    for section, name, number in config.section_fields():
        numbers = number if isinstance(number, list) else [number]
        if any(isinstance(n, float) and not math.isfinite(n) for n in numbers):
            yield Problem(f"{section}.{name}", "out_of_range",
                          f"{number} is not a finite number; give a real value")
        elif any(isinstance(n, float) and abs(n) > FLOAT32_MAX for n in numbers):
            yield Problem(f"{section}.{name}", "out_of_range",
                          f"{number} is beyond float32's range (+-{FLOAT32_MAX:.4g}): "
                          "no setting needs it, and torch's float32 math overflows on it")


def range_problems(config: RunConfig) -> list[Problem]:
    """Every field outside its allowed range, every NaN or infinity, and every sampling value SGLang would
    refuse."""
    nonfinite = list(_nonfinite_problems(config))
    skip = {problem.field for problem in nonfinite}
    problems = []
    for path, (test, allowed) in RANGES.items():
        value = _value(config, path)
        if path not in skip and value is not None and not isinstance(value, bool) and not test(value):
            problems.append(Problem(path, "out_of_range", f"{value} is out of range: must be {allowed}"))
    return nonfinite + problems + [p for p in _sampling_problems(config) if p.field not in skip]
