"""The actor's optimizer: Megatron DDP + AdamW, the learning-rate schedule, gradient clipping.

Owns: wrapping the model in Megatron's `DistributedDataParallel` (grads land in `param.main_grad`
buffers and are reduced over DP by `finalize_model_grads`, which also sums the SP / q-k norm grads
over TP and a tied embedding's over the first and last pipeline stages), and one optimizer step.
On CPU Megatron's optimizer does not run (hard-coded CUDA), so a plain `torch.optim.AdamW` steps on
`main_grad` with the clipping norm computed over unique shards of every TP, PP and EP rank
(notes/megatron-cpu.md); MoE expert gradients are reduced by Megatron's DDP over the
expert-data-parallel group, the rest over the data-parallel group. On GPU the same interface wraps
Megatron's optimizer (not run here).
The schedule follows Megatron's `OptimizerParamScheduler` (linear warmup from 0, then constant,
linear or cosine decay to `min_lr`), over the whole run unless lr_decay_iters says otherwise (`schedule_for_run`). Does not own checkpointing of this state (`checkpoint`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpc_rl.config.schema import OptimizerConfig


def learning_rate(config: OptimizerConfig, steps_done: int) -> float:
    """lr for the optimizer step that follows `steps_done` completed steps (Megatron's formula)."""
    if config.lr_warmup_iters > 0 and steps_done <= config.lr_warmup_iters:
        return config.lr * steps_done / config.lr_warmup_iters
    if config.lr_decay_style == "constant" or not config.lr_decay_iters:
        return config.lr
    decay_steps = max(config.lr_decay_iters - config.lr_warmup_iters, 1)
    progress = min(max(steps_done - config.lr_warmup_iters, 0) / decay_steps, 1.0)
    if config.lr_decay_style == "linear":
        coefficient = 1.0 - progress
    elif config.lr_decay_style == "cosine":
        coefficient = 0.5 * (math.cos(math.pi * progress) + 1.0)
    else:
        raise ValueError(f"optimizer.lr_decay_style {config.lr_decay_style!r}: use constant, linear or cosine")
    return config.min_lr + (config.lr - config.min_lr) * coefficient


def schedule_for_run(config: OptimizerConfig, total_steps: int) -> OptimizerConfig:
    """The schedule of a run of `total_steps` optimizer steps (slime's: lr_decay_iters defaults to every step of
    the run; lr_warmup_fraction is a share of lr_decay_iters)."""
    decay = config.lr_decay_iters or total_steps
    warmup = int(config.lr_warmup_fraction * decay) if config.lr_warmup_fraction is not None else config.lr_warmup_iters
    return dataclasses.replace(config, lr_decay_iters=decay, lr_warmup_iters=warmup, lr_warmup_fraction=None)


def wrap_ddp(model: torch.nn.Module, *, distributed_optimizer: bool = False) -> torch.nn.Module:
    """Megatron DDP around `model` (fp32 grad buffers; sharded optimizer state on GPU)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=distributed_optimizer,
                                               use_distributed_optimizer=distributed_optimizer)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def grad_sum_loss_multiplier(ddp_model: torch.nn.Module) -> int:
    """What each rank's loss must be multiplied by so that Megatron DDP's gradient reduction over the
    DP x CP group gives the plain SUM of every rank's gradient.

    megatron-core 0.16.1 (`DistributedDataParallel.__init__`, `ParamAndGradBuffer`): with
    `TransformerConfig.calculate_per_token_loss` the buckets' `gradient_scaling_factor` is 1 and the
    collective is a SUM (Megatron expects the loss normalised by the global token count, which
    `finalize_model_grads(num_tokens=...)` would apply afterwards; the step here divides by it up
    front instead). Without the flag the reduction AVERAGES over DP x CP (pre-scaled by 1/size then
    summed, or AVG in the collective with `average_in_collective`), so the loss carries that size.
    """
    from megatron.core import parallel_state

    if ddp_model.config.calculate_per_token_loss:
        return 1
    return parallel_state.get_data_parallel_world_size(with_context_parallel=True)


@torch.no_grad()
def reset_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Zero Adam's moments and step counts in place (the tensors stay, so an offload keeps its storages)."""
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key in ("step", "exp_avg", "exp_avg_sq") and isinstance(value, torch.Tensor):
                value.zero_()
            elif key == "step":
                state[key] = 0


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of `grads` in float64: one norm per tensor (one foreach call for all), squared and summed."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(torch._foreach_norm(grads)).double().square().sum()


@dataclass
class StepResult:
    grad_norm: float
    lr: float
    skipped: bool


class ActorOptimizer:  # the CPU path; hpc_rl.training.optimizer_gpu has the same interface
    """AdamW over a DDP-wrapped model's `main_grad`s; `step()` after the micro-batches' backward."""

    def __init__(self, ddp_model: torch.nn.Module, config: OptimizerConfig) -> None:
        if config.optimizer not in ("adam", "adamw"):
            raise ValueError(f"optimizer.optimizer {config.optimizer!r}: only adam is supported")
        self.ddp_model = ddp_model
        self.config = config
        self.params = [p for p in ddp_model.parameters() if p.requires_grad]
        self.has_experts = getattr(getattr(ddp_model, "config", None), "num_moe_experts", None) is not None
        """A MoE model: every rank joins the expert norm's all-reduce, also a pipeline stage without MoE layers."""
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]  # norms and biases, as Megatron
        self.torch_optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=learning_rate(config, 0), betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
            fused=all(p.device.type == "cpu" for p in self.params) or None,
        )
        """fused on CPU: torch's one-kernel AdamW, the same update without the default's per-tensor Python loop
        (the tiny model's 24 tensors: 1.7 ms less CPU per step)."""
        self.steps_done = 0
        self.finalizes_grads = (dist.is_initialized() and dist.get_world_size() > 1) or self.has_experts
        """Whether `finalize_model_grads` has work: a dense model trained by one rank has no DP, TP, PP or CP peer
        to reduce with (Megatron's all-reduce over its one-rank group costs a gloo round trip per step for
        nothing); a MoE model's routers update their expert bias and counters there even alone."""

    def set_run_length(self, total_steps: int) -> None:
        """The run has `total_steps` optimizer steps: its decay and warm-up follow (`schedule_for_run`)."""
        self.config = schedule_for_run(self.config, total_steps)

    def ordered_params(self) -> list[torch.nn.Parameter]:
        """Parameters in the optimizer's state-id order."""
        return [p for group in self.torch_optimizer.param_groups for p in group["params"]]

    def zero_grad(self) -> None:
        self.ddp_model.zero_grad_buffer()
        for param in self.params:
            param.grad = None

    def grad_norm(self) -> float:
        """L2 norm of all gradients over every TP, PP and EP rank, each parameter counted once: TP
        duplicates (norms, routers) on one TP rank, the tied embedding on the first stage only (the last
        stage's output-layer copy is marked `shared` by Megatron), routed experts (Megatron marks them
        `allreduce=False`) summed over the expert-TP x EP x PP group that holds one copy of them, the rest
        over the TP x PP group (Megatron's optimizer does the same with its dense and expert groups)."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        dense, experts = [], []
        for param in self.params:
            if not getattr(param, "allreduce", True):
                experts.append(param.main_grad)
            elif param_is_not_tensor_parallel_duplicate(param) and param_is_not_shared(param):
                dense.append(param.main_grad)
        groups = [(_sum_of_squares(dense), parallel_state.get_model_parallel_group())]
        if self.has_experts:
            groups.append((_sum_of_squares(experts), parallel_state.get_expert_tensor_model_pipeline_parallel_group()))
        for squares, group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(squares, group=group)
        return float(torch.stack([squares for squares, _ in groups]).sum().sqrt())

    def step(self) -> StepResult:
        """Finish the grad reduction, clip, and step; then zero the grad buffers."""
        from megatron.core.distributed import finalize_model_grads

        if self.finalizes_grads:
            finalize_model_grads([self.ddp_model])
        norm = self.grad_norm()
        lr = learning_rate(self.config, self.steps_done)
        skipped = not math.isfinite(norm)
        if not skipped:
            scale = self.config.clip_grad / (norm + 1e-6) if self.config.clip_grad > 0 else 1.0
            for param in self.params:
                grad = param.main_grad
                if scale < 1.0:
                    grad.mul_(scale)
                param.grad = grad.to(param.dtype)
            for group in self.torch_optimizer.param_groups:
                group["lr"] = lr
            self.torch_optimizer.step()
            self.steps_done += 1
        self.zero_grad()
        return StepResult(grad_norm=norm, lr=lr, skipped=skipped)

    def sharded_state(self, model_sharded_state_dict: dict[str, Any], *, is_loading: bool = False) -> dict[str, Any]:
        """AdamW's moments as sharded tensors shaped like their parameters (reshardable); the step
        count lives in the checkpoint's JSON (it is the same for every parameter)."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        self.ensure_state()
        state = self.torch_optimizer.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.ordered_params())
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        return state

    @torch.no_grad()
    def restore(self, loaded: dict[str, Any], steps_done: int) -> None:
        """Copy a loaded `sharded_state` into the live state tensors."""
        params = self.ordered_params()
        for param_id, entries in loaded["state"].items():
            target = self.torch_optimizer.state[params[param_id]]
            for key, value in entries.items():
                target[key].copy_(value)
            target["step"] = torch.tensor(float(steps_done))
        self.steps_done = steps_done

    @torch.no_grad()
    def reset_state(self) -> None:
        """Adam's moments and step count back to zero (slime's --reset-optimizer-states); the lr schedule
        (steps_done) goes on."""
        reset_adam_state(self.torch_optimizer)

    def restore_steps(self, steps_done: int) -> None:
        """Resume the schedule at `steps_done` without optimizer state (a checkpoint saved with save_optim off)."""
        self.steps_done = steps_done

    def ensure_state(self) -> None:
        """Create AdamW's state tensors (zeros) so a checkpoint can be loaded into them in place."""
        for param in self.ordered_params():
            state = self.torch_optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(float(self.steps_done))
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
