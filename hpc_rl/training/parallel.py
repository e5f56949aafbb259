"""Process groups for trainer ranks: torch.distributed world + Megatron's model-parallel state.

Owns: `init_parallel` (gloo on CPU, nccl on GPU; then `initialize_model_parallel` with the
`training` section's TP/PP/CP/EP sizes; then the RNG seeds) and `ParallelInfo`, the few ranks and
groups the step, the exporter and checkpoints ask for: its sizes are the config's `ParallelLayout` (the layout's
one home, `hpc_rl.config.parallel_layout`, which validation and the memory plan use too), checked against the
groups Megatron built; its ranks are Megatron's. Does not own the weight-update group to the
engines (`hpc_rl.weights.process_group`), the pipeline schedule (`hpc_rl.training.pipeline`) or the
CP sequence split (`hpc_rl.training.context_parallel`).
"""

from __future__ import annotations

import datetime

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpc_rl.config.parallel_layout import ParallelLayout
from hpc_rl.config.sections.training import TrainingConfig
from hpc_rl.training.cpu_switch import apply_cpu_switches, seed_megatron_rng


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's place in the trainer world."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int
    on_cpu: bool
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    expert_tp_rank: int = 0
    expert_tp_size: int = 1
    expert_dp_rank: int = 0
    """This rank's replica of the experts: ranks with the same expert-DP rank hold one copy of them."""

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the embedding (pipeline stage 0)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank holds the output layer: it computes logits, log-probs, the loss and metrics."""
        return self.pp_rank == self.pp_size - 1

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())


TRAINER_NCCL_ENV = {
    # The weight-update group is one NCCL communicator shared with the engines, which run with
    # cuMem off (engines.sglang_launch.ENGINE_ENV, as slime does): both ends must agree. NCCL reads it
    # once, at its first communicator in the process, so it is set before init_process_group.
    "NCCL_CUMEM_ENABLE": "0",
}


def trainer_runs_on_cpu(device: str) -> bool:
    """`cluster.device` -> CPU or GPU trainer; `cuda` without a visible GPU is an error, not a fallback."""
    if device == "cpu":
        return True
    if device != "cuda":
        raise ValueError(f"cluster.device {device!r}: use cpu or cuda")
    if not torch.cuda.is_available():
        raise RuntimeError("cluster.device is cuda but this trainer rank sees no GPU (torch.cuda.is_available() "
                           "is False): check the job's GPUs / CUDA_VISIBLE_DEVICES, or set cluster.device: cpu")
    return False


def apply_trainer_nccl_env(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set `TRAINER_NCCL_ENV` in `environ` (a GPU trainer, before its first NCCL call); returns what it
    changed. A different user value is overridden: the engines' end of the weight group is fixed."""
    changed = {key: value for key, value in TRAINER_NCCL_ENV.items() if environ.get(key) != value}
    environ.update(changed)
    return changed


def init_parallel(training: TrainingConfig, *, device: str = "cpu") -> ParallelInfo:
    """Join the torchrun world (env:// rendezvous) and build Megatron's groups; idempotent per process."""
    from megatron.core import parallel_state

    on_cpu = trainer_runs_on_cpu(device)
    if on_cpu:
        apply_cpu_switches()
    else:
        apply_trainer_nccl_env(os.environ)
    torch.set_num_threads(max(1, int(getattr(training, "num_threads", 1) or 1)))
    if not dist.is_initialized():
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="gloo" if on_cpu else "nccl", timeout=datetime.timedelta(
            minutes=training.distributed_timeout_minutes))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=training.tensor_model_parallel_size,
            pipeline_model_parallel_size=training.pipeline_model_parallel_size,
            context_parallel_size=training.context_parallel_size,
            expert_model_parallel_size=training.expert_model_parallel_size,
            expert_tensor_parallel_size=training.expert_tensor_parallel_size,
        )
    seed_megatron_rng(training.seed)
    return current_parallel_info(on_cpu=on_cpu, layout=ParallelLayout.of(training, dist.get_world_size()))


def _megatron_sizes() -> dict[str, int]:
    from megatron.core import parallel_state

    return {"tp_size": parallel_state.get_tensor_model_parallel_world_size(),
            "dp_size": parallel_state.get_data_parallel_world_size(),
            "pp_size": parallel_state.get_pipeline_model_parallel_world_size(),
            "cp_size": parallel_state.get_context_parallel_world_size(),
            "ep_size": parallel_state.get_expert_model_parallel_world_size(),
            "expert_tp_size": parallel_state.get_expert_tensor_parallel_world_size()}


def layout_sizes(layout: ParallelLayout) -> dict[str, int]:
    """`ParallelInfo`'s sizes from the config's layout."""
    return {"tp_size": layout.tp, "dp_size": layout.dp, "pp_size": layout.pp, "cp_size": layout.cp,
            "ep_size": layout.ep, "expert_tp_size": layout.etp}


def current_parallel_info(*, on_cpu: bool | None = None, layout: ParallelLayout | None = None) -> ParallelInfo:
    """Ranks and sizes of the already-initialised groups; with `layout` (the run's), the sizes are the layout's,
    and a group Megatron built of another size is an error naming both."""
    from megatron.core import parallel_state

    sizes = _megatron_sizes()
    if layout is not None:
        planned = layout_sizes(layout)
        differ = {name: (planned[name], built) for name, built in sizes.items() if planned[name] != built}
        if differ:
            raise RuntimeError(f"Megatron built process groups of other sizes than the config's parallel layout "
                               f"(size: layout, Megatron): {differ}")
        sizes = planned
    return ParallelInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        expert_tp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        expert_dp_rank=parallel_state.get_expert_data_parallel_rank(),
        on_cpu=(not torch.cuda.is_available()) if on_cpu is None else on_cpu,
        **sizes,
    )


def shutdown_parallel() -> None:
    """Destroy Megatron's groups and the default group (end of a run or a test)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
