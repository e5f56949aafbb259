"""The actor's optimizer on GPU: Megatron's (distributed) optimizer + `OptimizerParamScheduler`.

Owns: the same interface as `hpc_rl.training.optimizer.ActorOptimizer` (`step()`, `zero_grad()`,
`steps_done`, `sharded_state()`, `restore()`) over `get_megatron_optimizer`, so the step and the
checkpoint code do not know which one they hold. Megatron's optimizer computes the clipping norm
over unique shards and skips steps with non-finite gradients itself.

NOT RUN on this project's CPU machines (Megatron's optimizer allocates on CUDA): written against
megatron-core 0.16.1's signatures; exercise it on a GPU node before relying on it. Only
`megatron_optimizer_fields` runs in the unit tests (Megatron's `OptimizerConfig` is built from it on CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from hpc_rl.config.schema import OptimizerConfig
from hpc_rl.training.optimizer import StepResult, learning_rate, reset_adam_state, schedule_for_run

_NEVER = 10**12  # "no decay" for Megatron's scheduler, which needs a decay horizon


def megatron_optimizer_fields(config: OptimizerConfig, *, params_dtype: torch.dtype,
                              distributed: bool) -> dict[str, Any]:
    """Megatron's `OptimizerConfig` fields for `config`, offload settings included (slime passes Megatron's
    --optimizer-cpu-offload, --optimizer-offload-fraction, --overlap-cpu-optimizer-d2h-h2d and
    --use-precision-aware-optimizer straight through; the fraction's default is Megatron-LM's CLI one, 1.0)."""
    return dict(
        optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
        clip_grad=config.clip_grad, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        params_dtype=params_dtype, use_distributed_optimizer=distributed,
        optimizer_cpu_offload=config.optimizer_cpu_offload,
        optimizer_offload_fraction=config.optimizer_offload_fraction if config.optimizer_cpu_offload else 0.0,
        overlap_cpu_optimizer_d2h_h2d=config.overlap_cpu_optimizer_d2h_h2d,
        use_precision_aware_optimizer=config.use_precision_aware_optimizer)


class MegatronActorOptimizer:
    """`get_megatron_optimizer([ddp_model])` with slime's lr/wd schedule."""

    def __init__(self, ddp_model: torch.nn.Module, config: OptimizerConfig, *, params_dtype: torch.dtype) -> None:
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.ddp_model, self.config = ddp_model, config
        distributed = bool(getattr(ddp_model.ddp_config, "use_distributed_optimizer", False))
        megatron_config = MegatronOptimizerConfig(
            **megatron_optimizer_fields(config, params_dtype=params_dtype, distributed=distributed))
        self.optimizer = get_megatron_optimizer(megatron_config, [ddp_model])
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr,
            lr_warmup_steps=config.lr_warmup_iters, lr_decay_steps=config.lr_decay_iters or _NEVER,
            lr_decay_style=config.lr_decay_style, start_wd=config.weight_decay, end_wd=config.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant")
        self.steps_done = 0

    def set_run_length(self, total_steps: int) -> None:
        """The run's length decides the decay (and a warm-up fraction): Megatron's scheduler reads both per step."""
        self.config = schedule_for_run(self.config, total_steps)
        self.scheduler.lr_warmup_steps = self.config.lr_warmup_iters
        self.scheduler.lr_decay_steps = self.config.lr_decay_iters or _NEVER

    def zero_grad(self) -> None:
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> StepResult:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.ddp_model])
        lr = learning_rate(self.config, self.steps_done)
        success, grad_norm, _ = self.optimizer.step()
        if success:
            self.scheduler.step(increment=1)
            self.steps_done += 1
        self.zero_grad()
        return StepResult(grad_norm=float(grad_norm or 0.0), lr=lr, skipped=not success)

    def reset_state(self) -> None:
        """slime's --reset-optimizer-states over Megatron's (chained) optimizer: moments and steps to zero."""
        for chained in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            reset_adam_state(chained.optimizer)

    def restore_steps(self, steps_done: int) -> None:
        """Resume the schedule at `steps_done` without optimizer state (a checkpoint saved with save_optim off)."""
        self.scheduler.step(increment=steps_done)
        self.steps_done = steps_done

    def sharded_state(self, model_sharded_state_dict: dict[str, Any], *, is_loading: bool = False) -> dict[str, Any]:
        return {"optimizer": self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading),
                "scheduler": self.scheduler.state_dict()}

    def restore(self, loaded: dict[str, Any], steps_done: int) -> None:
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.scheduler.load_state_dict(loaded["scheduler"])
        self.steps_done = steps_done
