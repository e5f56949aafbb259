"""Plug-ins with slime's signatures, one per plug-in point, for tests that need a path that loads
(`tests.unit.plugin_fixtures.<name>`). Each returns something of the right shape and records nothing."""

from __future__ import annotations

from typing import Any


async def reward(args: Any, sample: Any) -> float:
    return 1.0


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any]) -> Any:
    return sample


def custom_loss(args: Any, batch: dict[str, Any], logits: Any, sum_of_sample_mean: Any) -> tuple[Any, dict[str, Any]]:
    return logits.sum() * 0.0, {}


def custom_advantages(args: Any, rollout_data: dict[str, Any]) -> None:
    per_token = [mask * reward for mask, reward in zip(rollout_data["loss_masks"], rollout_data["rewards"])]
    rollout_data["advantages"] = rollout_data["returns"] = per_token


def tis(args: Any, *, pg_loss: Any, train_log_probs: Any, rollout_log_probs: Any, loss_masks: Any,
        **kwargs: Any) -> tuple[Any, Any, dict[str, Any]]:
    return pg_loss, loss_masks, {}


SEEN_ROLLOUT_DATA: list[dict[str, Any]] = []
"""What `recording_advantages` was handed (keys and shapes), for the process that ran it to report."""


def recording_advantages(args: Any, rollout_data: dict[str, Any]) -> None:
    SEEN_ROLLOUT_DATA.append({key: [tuple(v.shape) for v in value] if isinstance(value, list) and value
                              and hasattr(value[0], "shape") else value for key, value in rollout_data.items()
                              if key in ("entropy", "ref_entropy", "loss_masks")})
    custom_advantages(args, rollout_data)


TRAINER_CALLS: list[tuple[Any, ...]] = []
"""What the trainer hooks below were called with, in order (the rank process reports it)."""


INIT_CALLS: list[int] = []


def record_init(args: Any) -> None:
    INIT_CALLS.append(args.global_batch_size)


def record_log_prob_pass(args: Any, model: Any, store_prefix: str) -> None:
    TRAINER_CALLS.append(("log_prob", store_prefix))


def record_train_step(args: Any, rollout_id: int, step_id: int, model: Any, optimizer: Any,
                      opt_param_scheduler: Any) -> None:
    TRAINER_CALLS.append(("train_step", rollout_id, step_id))


def untrain_everything(args: Any, rollout_id: int, rollout_data: dict[str, Any]) -> None:
    TRAINER_CALLS.append(("postprocess", rollout_id, sorted(rollout_data)))
    rollout_data["loss_masks"] = [mask * 0 for mask in rollout_data["loss_masks"]]


def sample_hook(args: Any, sample: Any) -> None:
    return None


def groups_visitor(args: Any, samples: Any) -> None:
    return None


def all_samples_visitor(args: Any, all_samples: Any, data_source: Any) -> None:
    return None


def rollout_log(rollout_id: int, args: Any, samples: Any, rollout_extra_metrics: Any, rollout_time: float) -> bool:
    return False


def eval_log(rollout_id: int, args: Any, data: Any, extra_metrics: Any) -> bool:
    return False


def reward_post_process(args: Any, samples: Any) -> tuple[list[float], list[float]]:
    raw = [s.reward for s in samples]
    return raw, raw


def tagged_model_provider(pre_process: bool, post_process: bool, vp_stage: Any = None) -> Any:
    """hpc_rl's own tiny Qwen3 stage, marked: a custom model provider as slime calls it."""
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.model_provider import build_gpt_model

    from pathlib import Path

    arch = ModelArchitecture.from_yaml(Path(__file__).resolve().parents[2] / "configs/models/tiny_qwen3.yaml")
    model = build_gpt_model(arch, TrainingConfig())
    model.built_by_custom_provider = (pre_process, post_process, vp_stage)
    return model


def record_post_write(args: Any, version_dir: str, rollout_engines: list[str]) -> None:
    """A post-write hook that notes what it saw in <run_dir>/post_write.log (one line per trainer rank and sync)."""
    import os
    from pathlib import Path

    with open(Path(args.run_dir) / "post_write.log", "a") as log:
        log.write(f"{version_dir} {len(rollout_engines)} {os.path.isfile(os.path.join(version_dir, 'config.json'))}\n")
