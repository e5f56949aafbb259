"""The actor's optimizer, on CPU and GPU alike: Megatron DDP + `get_megatron_optimizer` + `OptimizerParamScheduler`.

Owns: wrapping the model in Megatron's `DistributedDataParallel` (grads land in `param.main_grad` buffers and are
reduced over DP by `finalize_model_grads`, which also sums the SP / q-k norm grads over TP and a tied embedding's
over the first and last pipeline stages), Megatron's optimizer over it with its learning-rate schedule
(Megatron's `OptimizerParamScheduler`, built in `lr_schedule`), and one optimizer step. Does not own checkpoint
files (`checkpoint`).

One path for both devices, built in one order: model -> `wrap_ddp` (the distributed optimizer's buffers) ->
`get_megatron_optimizer` (Megatron's classes: `FP32Optimizer` over fp32 parameters,
`Float16OptimizerWithFloat16Params` or the `DistributedOptimizer` over bf16 parameters with fp32 main copies,
chained with the experts' optimizer for MoE) -> `OptimizerParamScheduler`. On a CPU-only build Megatron's optimizer
makes a few small tensors on `device='cuda'` and sorts parameters by CUDA type names; `cpu_switch.
host_optimizer_calls` switches exactly those lines (measured: megatron-core 0.16.1, torch 2.13 CPU, gloo, DP=2,
fp32 and bf16, plain and distributed; nothing else in it needed a switch).

What the step adds to Megatron's own `step()` (whose parts it calls in Megatron's order, as `ChainedOptimizer.step`
does: `prepare_grads`, `get_grad_norm`, `clip_grad_by_total_norm_fp32`, `step_with_ready_grads`): in bf16 without a
loss scale Megatron builds no grad scaler and applies NaN/inf gradients; here a non-finite gradient norm (or a grad
scaler's found_inf) on any rank skips the step on every rank (`StepResult.skipped`). The norm is always computed
(Megatron skips it when clip_grad is 0) because the step and its telemetry report it.

Weights loaded into the model after the optimizer is built (an HF or weights-only checkpoint, a resume without
optimizer state) reach the fp32 main copies only through `reload_model_params()`: without it the first step
writes the construction-time weights plus one update back into the model.

The schedule (`lr_schedule`): Megatron's `OptimizerParamScheduler` over the whole run unless lr_decay_iters says
otherwise (`lr_schedule.schedule_for_run`); it writes the lr of the next step into the param groups, so each
change of its horizon or position is followed by `step(0)`.
The scheduler's state is not saved: it is the config's schedule at `steps_done` (saved in the checkpoint's JSON).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpc_rl.config.sections.training import OptimizerConfig
from hpc_rl.training.cpu_switch import cuda_available, host_optimizer_calls
from hpc_rl.training.lr_schedule import megatron_scheduler, schedule_for_run


SHARDED_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def wants_distributed_optimizer(config: OptimizerConfig) -> bool:
    """Megatron's distributed optimizer (state sharded over DP) for adam; megatron-core 0.16.1's DistributedOptimizer
    asserts "Only Adam and HybridDeviceOptimizer currently supported", so sgd runs Megatron's unsharded one."""
    return config.optimizer == "adam"


def wrap_ddp(model: torch.nn.Module, *, distributed_optimizer: bool = False) -> torch.nn.Module:
    """Megatron DDP around `model` (fp32 grad buffers; the distributed optimizer's sharded buffers when asked).

    The grad reduction overlaps the backward on a GPU only: on CPU it runs in `finalize_model_grads` (the same
    collectives, after the last micro-batch's backward instead of during it), so a one-rank dense step can leave it
    out (`ActorOptimizer.finalizes_grads`)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=distributed_optimizer and cuda_available(),
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


@dataclass
class StepResult:
    grad_norm: float
    lr: float
    skipped: bool


def megatron_optimizer_fields(config: OptimizerConfig, *, params_dtype: torch.dtype,
                              distributed: bool) -> dict[str, Any]:
    """Megatron's `OptimizerConfig` fields for `config`: the optimizer (adam or sgd), offload settings included
    (slime passes Megatron's --optimizer-cpu-offload, --optimizer-offload-fraction, --overlap-cpu-optimizer-d2h-h2d
    and --use-precision-aware-optimizer straight through; the fraction's default is Megatron-LM's CLI one, 1.0)."""
    return dict(
        optimizer=config.optimizer, lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
        clip_grad=config.clip_grad, bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        params_dtype=params_dtype, use_distributed_optimizer=distributed,
        optimizer_cpu_offload=config.optimizer_cpu_offload,
        optimizer_offload_fraction=config.optimizer_offload_fraction if config.optimizer_cpu_offload else 0.0,
        overlap_cpu_optimizer_d2h_h2d=config.overlap_cpu_optimizer_d2h_h2d,
        use_precision_aware_optimizer=config.use_precision_aware_optimizer)


def _load_states_without_step(optimizer: Any) -> None:
    """A loading fix for Megatron's `DistributedOptimizer` over torch's Adam (no Transformer Engine or apex, as on
    this project's CPU machines and the bare one-GPU check): in megatron-core 0.16.1
    `load_parameter_state_from_fully_reshardable` passes each parameter's tensors without "step" (handled
    separately, from the param groups) to `_set_main_param_and_optimizer_states`, which copies every key of the live
    state, torch's per-parameter "step" included, and fails with KeyError 'step'. Here the live step is set aside
    for that copy and put back; the step Megatron loaded stays. Other optimizers are left as they are."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(optimizer, DistributedOptimizer) or optimizer.config.use_precision_aware_optimizer:
        return
    original = optimizer._set_main_param_and_optimizer_states

    def set_states(model_param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
        group_index, group_order = optimizer.model_param_group_index_map[model_param]
        state = optimizer.optimizer.state[optimizer.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            original(model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    optimizer._set_main_param_and_optimizer_states = set_states


class ActorOptimizer:
    """Megatron's optimizer over a DDP-wrapped model, with the run's lr schedule; `step()` after the
    micro-batches' backward."""

    def __init__(self, ddp_model: torch.nn.Module, config: OptimizerConfig) -> None:
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        self.ddp_model = ddp_model
        self.config = config
        self._run_length: int | None = None
        """The run length `set_run_length` last applied (None: none yet)."""
        self.params = [p for p in ddp_model.parameters() if p.requires_grad]
        self.params_dtype: torch.dtype = ddp_model.config.params_dtype
        distributed = bool(getattr(ddp_model.ddp_config, "use_distributed_optimizer", False))
        megatron_config = MegatronOptimizerConfig(
            **megatron_optimizer_fields(config, params_dtype=self.params_dtype, distributed=distributed))
        with host_optimizer_calls():
            self.optimizer = get_megatron_optimizer(megatron_config, [ddp_model])
        for chained in self.chained:
            _load_states_without_step(chained)
        self.scheduler = megatron_scheduler(self.optimizer, config)
        self.steps_done = 0
        self._parts: list[Any] = []
        """Each of Megatron's optimizers' sharded state from the last `sharded_state` (restore fills it in)."""
        self._slots: dict[int, str] = {}
        """Each sharded tensor of `_parts` (by id) -> its name in the flat dict `sharded_state` returns."""
        has_experts = getattr(ddp_model.config, "num_moe_experts", None) is not None
        self.finalizes_grads = ((dist.is_initialized() and dist.get_world_size() > 1) or has_experts
                                or ddp_model.ddp_config.overlap_grad_reduce)
        """Whether `finalize_model_grads` has work: a dense model trained by one rank has no DP, TP, PP or CP peer
        to reduce with (Megatron's all-reduce over its one-rank group costs a gloo round trip per step for
        nothing); a MoE model's routers update their expert bias and counters there even alone; an overlapped
        reduction (GPU) is waited for there."""

    @property
    def chained(self) -> list[Any]:
        """Megatron's optimizers inside the (chained) one: the dense parameters', then the experts'."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    @property
    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers (AdamW or SGD) that Megatron's step over the fp32 main parameters."""
        return [chained.optimizer for chained in self.chained if getattr(chained, "optimizer", None) is not None]

    def _reschedule(self) -> None:
        """Megatron's scheduler at `steps_done` under `config`: the next step's lr into the param groups."""
        self.scheduler = megatron_scheduler(self.optimizer, self.config, self.steps_done)

    def set_run_length(self, total_steps: int) -> None:
        """The run has `total_steps` optimizer steps: its decay and warm-up follow (`schedule_for_run`), from the
        next step on. Every train command says it: the scheduler is rebuilt only when the schedule changes."""
        if total_steps == self._run_length:  # every train command says it: the same length, the same schedule
            return
        self._run_length = total_steps
        config = schedule_for_run(self.config, total_steps)
        if config != self.config:
            self.config = config
            self._reschedule()

    @property
    def lr(self) -> float:
        """The lr the next step runs at (the first param group's, as Megatron logs it)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def reload_model_params(self) -> None:
        """The model's parameters (just loaded) into the fp32 main copies; call after every load into the model
        that does not restore this optimizer's state."""
        with host_optimizer_calls():
            self.optimizer.reload_model_params()

    def _any_rank(self, flag: bool) -> bool:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.params[0].device if self.params else "cpu")
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def grad_norm(self) -> float:
        """The L2 norm of the step's gradients as Megatron's optimizer computes it (after `prepare_grads`): each
        parameter counted once over every TP, PP, EP (and, distributed, DP) rank: TP duplicates and the tied
        output layer left out, routed experts over their own group (`ChainedOptimizer.get_grad_norm`)."""
        with host_optimizer_calls():
            return float(self.optimizer.get_grad_norm() or 0.0)

    def step(self) -> StepResult:
        """Finish the grad reduction, check, clip and step (or skip a non-finite step on every rank); then zero
        the grad buffers."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if self.finalizes_grads:
            finalize_model_grads([self.ddp_model])
        lr = self.lr
        with host_optimizer_calls():
            found_inf = self.optimizer.prepare_grads()
        norm = self.grad_norm()
        with host_optimizer_calls():
            skipped = self._any_rank(found_inf or not math.isfinite(norm))
            if not skipped:
                for chained in self.chained:
                    parameters = chained.get_parameters() if not getattr(chained, "is_stub_optimizer", False) else []
                    if parameters and chained.config.clip_grad > 0.0:
                        clip_grad_by_total_norm_fp32(parameters, max_norm=chained.config.clip_grad, total_norm=norm,
                                                     use_decoupled_grad=chained.config.
                                                     use_precision_aware_optimizer_no_fp8_or_ds_fp8)
                self.optimizer.step_with_ready_grads()
        if not skipped:
            self.steps_done += 1
            self.scheduler.step(increment=1)
        self.zero_grad()
        return StepResult(grad_norm=norm, lr=lr, skipped=skipped)

    def sharded_state(self, model_sharded_state_dict: dict[str, Any], *, is_loading: bool = False) -> dict[str, Any]:
        """Megatron's optimizer state (moments and fp32 main copies) as sharded tensors keyed by parameter name, and
        Adam's step count: loadable at any TP/PP/DP/EP layout.

        Each of Megatron's optimizers gives its `sharded_state_dict` in the distributed optimizer's
        `fully_reshardable` format (its default in megatron-core 0.16.1, `fully_sharded_model_space`, builds
        flattened ShardedTensors that 0.16.1's own dist_checkpointing refuses: "ShardedTensor.flattened_range is not
        supported"). How many optimizers Megatron chains depends on the layout (the experts get their own one at
        EP > 1 only), so their sharded tensors are saved as one flat dict by key, and the rest of each one's state
        is its live state at load (`restore`), with the saved step count. (The flat dict's names are positions:
        dist_checkpointing matches sharded tensors by their own keys and offsets, and the layers of a stage share
        one key.)"""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedBase

        self.ensure_state()  # Megatron's state_dict() reads one step count off the state (torch's Adam, no TE/apex)
        with host_optimizer_calls():
            self._parts = [chained.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                                      metadata=SHARDED_OPTIMIZER_METADATA) for chained in self.chained]
        sharded = [value for part in self._parts for value in nested_values(part) if isinstance(value, ShardedBase)]
        self._slots = {id(value): str(index) for index, value in enumerate(sharded)}
        tensors = {self._slots[id(value)]: value for value in sharded}
        return {"adam_step": self._adam_step(), "tensors": tensors}

    def _adam_step(self) -> int:
        """Adam's step count (the same for every parameter: Megatron's optimizers keep it so): in each parameter's
        state (torch's Adam) or in the param groups (Transformer Engine's and apex's FusedAdam)."""
        steps = [float(state["step"]) for torch_optimizer in self.torch_optimizers
                 for state in torch_optimizer.state.values() if "step" in state]
        steps += [float(group["step"]) for torch_optimizer in self.torch_optimizers
                  for group in torch_optimizer.param_groups if group.get("step") is not None]
        return int(max(steps)) if steps else 0

    def restore(self, loaded: dict[str, Any], steps_done: int) -> None:
        """Load a loaded `sharded_state` (made with is_loading=True just before) into Megatron's optimizers and put
        the schedule at `steps_done`."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import ShardedBase

        tensors, step = loaded["tensors"], int(loaded["adam_step"])
        for chained, part in zip(self.chained, self._parts):
            part = dict_list_map_inplace(lambda value: tensors[self._slots[id(value)]]
                                         if isinstance(value, ShardedBase) else value, part)
            for group in part.get("optimizer", {}).get("param_groups", []):
                if "step" in group:
                    group["step"] = step
            with host_optimizer_calls():
                chained.load_state_dict(part)
        self._parts, self._slots = [], {}
        for torch_optimizer in self.torch_optimizers:
            # megatron-core 0.16.1 (torch's Adam, no TE/apex) gives every parameter's state the SAME loaded "step"
            # tensor, which torch's foreach Adam then increments once per parameter: each its own again.
            for state in torch_optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.tensor(float(step))
        self.steps_done = steps_done
        self._reschedule()

    @torch.no_grad()
    def reset_state(self) -> None:
        """Adam's moments and step count back to zero (slime's --reset-optimizer-states); the lr schedule
        (steps_done) goes on."""
        for torch_optimizer in self.torch_optimizers:
            reset_adam_state(torch_optimizer)

    def restore_steps(self, steps_done: int) -> None:
        """Resume the schedule at `steps_done` without optimizer state (a checkpoint saved with save_optim off);
        the caller has loaded the weights, which become the main copies here."""
        self.steps_done = steps_done
        self._reschedule()
        self.reload_model_params()

    def moments(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """The optimizer state of one model parameter as this rank holds it, shaped like the parameter ("param": its
        fp32 main copy, "exp_avg", "exp_avg_sq", "step"). One rank only (a DP shard of it under the distributed
        optimizer when DP > 1): for tests and diagnostics."""
        for chained in self.chained:
            if hasattr(chained, "model_param_group_index_map"):  # the distributed optimizer
                if param in chained.model_param_group_index_map:
                    states = chained._get_main_param_and_optimizer_states(param)
                    whole = all(value.numel() == param.numel() for value in states.values() if value.dim())
                    return {key: value.view(param.shape) if value.dim() and whole else value
                            for key, value in states.items()}
                continue
            main = getattr(param, "main_param", param)  # Float16Optimizer's fp32 copy, else the parameter itself
            if any(main is stepped for group in chained.optimizer.param_groups for stepped in group["params"]):
                return {"param": main, **chained.optimizer.state.get(main, {})}
        raise KeyError("the parameter is not one this optimizer steps (frozen, or of another model)")

    def ensure_state(self) -> None:
        """Create the optimizer's state tensors (zeros, step `steps_done`) where a parameter has none yet, so a
        checkpoint can be saved or loaded into them in place."""
        for chained in self.chained:
            torch_optimizer = getattr(chained, "optimizer", None)
            init_state = getattr(chained, "init_state_fn", None)
            if torch_optimizer is None or init_state is None:
                continue
            init_state(torch_optimizer, chained.config)
            for state in torch_optimizer.state.values():
                if isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)) and "step" not in state:
                    state["step"] = torch.tensor(float(self.steps_done))
