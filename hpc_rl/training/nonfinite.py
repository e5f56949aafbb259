"""NaN and infinity on the trainer: named, counted, and never sent to the engines.

Owns `NonFiniteSteps`: after each rollout's optimizer steps, a step whose loss or gradient norm is NaN or
infinite (`training.optimizer.ActorOptimizer` skipped it on every rank: `skipped`; Megatron's own step applies
such a step in bf16, where it has no grad scaler) is logged with its rollout, step and values; more than
`training.max_nonfinite_steps` such steps in a row end the run with `NonFiniteTraining`, which the
controller shows as the trainer's error (a run that silently trains nothing and exits 0 was issue 24).
And `check_finite_weights`: before weights leave the trainer (a sync), every rank checks its parameters;
one NaN or infinity anywhere refuses the sync on every rank, naming the first bad parameter (engines fed
such weights crash with "probability tensor contains either inf, nan" and the cause is never named).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

WATCHED = ("loss", "pg_loss", "grad_norm", "value_loss", "critic_grad_norm")  # the last two: PPO's critic


class NonFiniteTraining(RuntimeError):
    """Too many optimizer steps in a row had a NaN/inf loss or gradient norm, or the weights are not finite."""


class NonFiniteSteps:
    """Counts optimizer steps with a non-finite loss or gradient norm, in a row."""

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0

    def check(self, rollout_id: int, steps: list[dict[str, Any]]) -> None:
        """Log every bad step; raise NonFiniteTraining past `max_in_a_row` of them in a row."""
        for offset, metrics in enumerate(steps):
            bad = {key: metrics[key] for key in WATCHED if key in metrics and not math.isfinite(float(metrics[key]))}
            if not bad and not metrics.get("skipped") and not metrics.get("critic_skipped"):
                self.in_a_row = 0
                continue
            self.in_a_row += 1
            self.total += 1
            values = ", ".join(f"{key} {value}" for key, value in bad.items()) or "the optimizer skipped it"
            skipped = bool(metrics.get("skipped") or metrics.get("critic_skipped"))
            what = "the step was skipped" if skipped else "the optimizer applied the step (its gradients were finite)"
            message = (f"rollout {rollout_id}, optimizer step {offset + 1} of {len(steps)}: {values}; {what} "
                       f"({self.in_a_row} in a row, training.max_nonfinite_steps={self.max_in_a_row})")
            log.warning(message)
            if self.in_a_row > self.max_in_a_row:
                raise NonFiniteTraining(
                    f"{message}: stopping. Check the rewards and data of these rollouts, lower optimizer.lr, or "
                    "keep optimizer.clip_grad on; the last checkpoint is kept")


def check_finite_weights(model: torch.nn.Module, *, device: torch.device | str, rank: int) -> None:
    """Raise NonFiniteTraining on every rank when any rank holds a NaN/inf parameter (collective)."""
    first_bad = ""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not bool(torch.isfinite(param).all()):
                first_bad = name
                break
    flag = torch.tensor([1.0 if first_bad else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if float(flag.item()) > 0:
        where = f"{first_bad} on rank {rank}" if first_bad else "on another rank (see its log)"
        if first_bad:
            log.error("parameter %s holds NaN or inf: the weights are not synced", first_bad)
        raise NonFiniteTraining(f"the trainer's weights are not finite ({where}): they are not synced to the "
                                "engines. Lower optimizer.lr or keep optimizer.clip_grad on; resume from the last "
                                "checkpoint")
