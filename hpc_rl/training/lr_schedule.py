"""The learning-rate schedule of a run: Megatron's `OptimizerParamScheduler`, on CPU and GPU alike.

Owns: building Megatron's scheduler from the `optimizer` section (linear warm-up from 0, then constant, linear or
cosine decay to `min_lr`) at a number of completed steps, the lr of the step after `steps_done` without an
optimizer (`learning_rate`), and a run's schedule (`schedule_for_run`: slime's defaults, lr_decay_iters over every
step of the run, lr_warmup_fraction a share of it). The optimizer that steps it is `optimizer.ActorOptimizer`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hpc_rl.config.sections.training import OptimizerConfig

_NEVER = 10**12
"""The decay horizon for "no decay": Megatron's scheduler needs one (constant style, no lr_decay_iters)."""


def megatron_scheduler(optimizer: Any, config: OptimizerConfig, steps_done: int = 0) -> Any:
    """Megatron's `OptimizerParamScheduler` for `config` over `optimizer`'s param groups, at `steps_done` (the lr
    of the next step is in the param groups)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = config.lr_warmup_iters
    decay = max(config.lr_decay_iters or _NEVER, warmup + 1)  # Megatron asserts warm-up < decay
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=config.lr_decay_style, start_wd=config.weight_decay,
        end_wd=config.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
    if steps_done:
        scheduler.step(increment=steps_done)
    return scheduler


@dataclass
class _ParamGroups:
    """Stands in for an optimizer when only the schedule is asked for (`learning_rate`)."""

    param_groups: list[dict[str, Any]]


def learning_rate(config: OptimizerConfig, steps_done: int) -> float:
    """lr of the optimizer step that follows `steps_done` completed steps, as Megatron's scheduler gives it."""
    return megatron_scheduler(_ParamGroups([{}]), config, steps_done).get_lr({})


def schedule_for_run(config: OptimizerConfig, total_steps: int) -> OptimizerConfig:
    """The schedule of a run of `total_steps` optimizer steps (slime's: lr_decay_iters defaults to every step of
    the run; lr_warmup_fraction is a share of lr_decay_iters)."""
    decay = config.lr_decay_iters or total_steps
    warmup = int(config.lr_warmup_fraction * decay) if config.lr_warmup_fraction is not None else config.lr_warmup_iters
    return dataclasses.replace(config, lr_decay_iters=decay, lr_warmup_iters=warmup, lr_warmup_fraction=None)
