"""TensorBoard scalars of a run and the progress line printed per rollout.

Owns: where a run's TensorBoard files go (`tensorboard_dir`: `logging.tensorboard_dir`, default
`<run_dir>/tensorboard`, under `logging.tb_experiment_name` when set), one TensorBoard event file per process
there (each process writes its own; TensorBoard merges them; written by `event_file`, without torch), which writers the controller's
scalars go to (TensorBoard always, W&B too with `logging.use_wandb`: `wandb_scalars`), and formatting a
rollout's headline numbers on one line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_rl.telemetry.event_file import ScalarEventFile

if TYPE_CHECKING:
    from hpc_rl.config.schema import RunConfig
    from hpc_rl.telemetry.wandb_scalars import WandbScalars


def tensorboard_dir(config: RunConfig, run_dir: str | Path) -> str:
    """The run's TensorBoard directory (every process of the run writes its own event file into it)."""
    root = Path(config.logging.tensorboard_dir or Path(run_dir) / "tensorboard")
    return str(root / config.logging.tb_experiment_name if config.logging.tb_experiment_name else root)


class ScalarLog:
    """`log(metrics, step)` writes every finite numeric metric as a scalar (TensorBoard, and W&B if given)."""

    def __init__(self, log_dir: str | Path | None, *, filename_suffix: str = "",
                 wandb: WandbScalars | None = None, tensorboard_skips: tuple[str, ...] = ()) -> None:
        self._writer: ScalarEventFile | None = None
        self._tensorboard_skips = tensorboard_skips
        """Name prefixes another process writes to the same TensorBoard dir (W&B still gets them)."""
        if log_dir is not None:
            self._writer = ScalarEventFile(log_dir, filename_suffix=filename_suffix)
        self._wandb = wandb

    @classmethod
    def for_controller(cls, log_dir: str | Path, config: RunConfig, *, run_dir: str | Path) -> ScalarLog:
        """The controller's scalars: TensorBoard, plus the run's W&B run when `logging.use_wandb` is set."""
        wandb = None
        if config.logging.use_wandb:
            from hpc_rl.telemetry.wandb_scalars import WandbScalars

            wandb = WandbScalars.open(config, run_dir)
        # train/* is trainer rank 0's, per optimizer step; the controller's per-rollout summary of it would
        # put a second series under the same tags on another step axis.
        return cls(log_dir, filename_suffix=".controller", wandb=wandb, tensorboard_skips=("train/",))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._wandb is not None:
            self._wandb.log(metrics, step)
        if self._writer is None:
            return
        for name, value in metrics.items():
            if name.startswith(self._tensorboard_skips):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._writer.add_scalar(name, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


TREND_WINDOW = 10
"""Rollouts averaged for the reward trend of the progress line."""


def progress_line(rollout_id: int, num_rollout: int, metrics: dict[str, Any], *,
                  rewards_so_far: list[float] | None = None, eval_sampling: str = "") -> str:
    """`rollout 30/100 | reward 0.420 | avg10 0.381 (first 10: 0.094) | resp len 3.1 | grad_norm 0.52 |
    entropy 1.23 | gen 1.2s train 0.8s sync 0.1s | eval tiny_copy 0.950 (greedy)` (missing parts left out).

    What tells a user that training works: the reward averaged over the last TREND_WINDOW rollouts against
    the first ones (one rollout's mean is noisy), a nonzero gradient norm, the policy's entropy. Not
    shown: ppo_kl and pg_loss, exactly 0 on every step of an on-policy GRPO run that learns (one optimizer
    step per rollout: the policy is the rollout's; group-normalised advantages have mean 0); they are in
    TensorBoard. Eval says how it samples (greedy eval scores above sampled training rewards). The training
    modes add theirs: SFT's loss (and its held-out eval: loss, exact match), PPO's value loss, distillation's
    reverse KL to the teacher."""
    parts = [f"rollout {rollout_id + 1}/{num_rollout}"]
    if "rollout/reward_mean" in metrics:
        parts.append(f"reward {metrics['rollout/reward_mean']:.3f}")
    history = rewards_so_far or []
    if len(history) >= 2 * TREND_WINDOW:
        recent, first = history[-TREND_WINDOW:], history[:TREND_WINDOW]
        parts.append(f"avg{TREND_WINDOW} {sum(recent) / len(recent):.3f} (first {TREND_WINDOW}: "
                     f"{sum(first) / len(first):.3f})")
    if "rollout/response_len_mean" in metrics:
        parts.append(f"resp len {metrics['rollout/response_len_mean']:.1f}")
    modes = (("train/loss", "loss"),) if "train/pg_loss" not in metrics else ()  # SFT: no policy loss
    for key, label in (*modes, ("train/grad_norm", "grad_norm"), ("train/entropy_loss", "entropy"),
                       ("train/value_loss", "value_loss"), ("train/opd_reverse_kl", "opd_kl")):
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.3g}")
    if metrics.get("train/skipped"):
        parts.append("step skipped (NaN/inf)")
    times = [f"{label} {metrics[key]:.2f}s" for key, label in
             (("time/rollout", "gen"), ("time/train", "train"), ("time/weight_sync", "sync"), ("time/eval", "eval"))
             if key in metrics]
    if times:
        parts.append(" ".join(times))
    evals = [f"eval {k[len('eval/'):-len('/reward_mean')]} {v:.3f}" for k, v in metrics.items()
             if k.startswith("eval/") and k.endswith("/reward_mean")]
    if evals and eval_sampling:
        evals[-1] += f" ({eval_sampling})"
    evals += [f"eval {k[len('eval/'):].replace('/', ' ')} {v:.3f}" for k, v in metrics.items()
              if k.startswith("eval/") and k.endswith(("/loss", "/exact_match"))]  # SFT's held-out chats
    parts.extend(evals)
    return " | ".join(parts)


def eval_sampling_note(temperature: float | None, n_samples: int) -> str:
    """How eval samples, for the progress line: "greedy" or "temperature 0.6", and "n 4" when > 1."""
    how = "greedy" if temperature == 0 else f"temperature {temperature:g}" if temperature is not None else ""
    return ", ".join(part for part in (how, f"{n_samples} samples per prompt" if n_samples > 1 else "") if part)
