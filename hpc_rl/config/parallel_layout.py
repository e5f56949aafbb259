"""The trainer's parallel layout as Megatron builds it, expert parallelism included, and what must divide.

Owns: `ParallelLayout`: TP x PP x CP x DP for the dense part and, per pipeline stage, ETP x EP x
expert-DP for the experts (Megatron's `initialize_model_parallel`: expert-DP = world / (ETP x EP x PP),
so CP folds into expert-DP), the optimizer shard counts that follow (the distributed optimizer shards
dense parameters over DP x CP and expert parameters over expert-DP), the rules Megatron enforces when it
builds the groups and the MoE layer, as problems that name the numbers (TP x PP x CP dividing the trainer's GPUs,
DP dividing the global batch, the expert groups), and the `--dry-run` lines. The one home of the layout: validation
(`layout_checks`, `moe_checks`), the memory plan and the trainer's `hpc_rl.training.parallel.ParallelInfo` (its sizes)
are made from it. Pure arithmetic: no torch, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.problems import Problem
from hpc_rl.config.sections.training import TrainingConfig

if TYPE_CHECKING:
    from hpc_rl.config.schema import RunConfig


@dataclass(frozen=True)
class ParallelLayout:
    """How `world` trainer ranks split: TP x PP x CP x DP; experts: ETP x EP x expert-DP per PP stage."""

    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    num_experts: int | None = None

    @classmethod
    def of(cls, training: TrainingConfig, world: int, arch: ModelArchitecture | None = None) -> ParallelLayout:
        return cls(world=world, tp=training.tensor_model_parallel_size, pp=training.pipeline_model_parallel_size,
                   cp=training.context_parallel_size, ep=training.expert_model_parallel_size,
                   etp=training.expert_tensor_parallel_size or training.tensor_model_parallel_size,
                   num_experts=arch.num_moe_experts if arch is not None else None)

    @classmethod
    def of_run(cls, config: RunConfig, arch: ModelArchitecture | None = None) -> ParallelLayout:
        """The layout of a run's trainer (its `training` sizes over `cluster.trainer_world_size` ranks)."""
        return cls.of(config.training, config.cluster.trainer_world_size, arch)

    @property
    def model_parallel(self) -> int:
        """TP x PP x CP: the ranks one data-parallel replica spans."""
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel size (0 when TP x PP x CP does not divide the world)."""
        model = self.model_parallel
        return self.world // model if model and self.world % model == 0 else 0

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size (0 when ETP x EP x PP does not divide the world)."""
        expert = self.etp * self.ep * self.pp
        return self.world // expert if self.world % expert == 0 else 0

    @property
    def dense_optimizer_shards(self) -> int:
        """Ranks the distributed optimizer splits a dense parameter's state over (DP x CP)."""
        return max(1, self.dp * self.cp)

    @property
    def expert_optimizer_shards(self) -> int:
        """Ranks the distributed optimizer splits an expert parameter's state over (expert-DP)."""
        return max(1, self.expert_dp)

    def splits(self, arch: ModelArchitecture) -> bool:
        """Every size divides: the world into both groupings, the experts over EP (the layers over PP:
        `pipeline_split`)."""
        return (self.dp > 0 and self.expert_dp > 0 and (arch.num_moe_experts or self.ep) % self.ep == 0)

    def describe(self) -> str:
        lines = [f"parallel layout ({self.world} trainer GPU(s)): TP {self.tp} x PP {self.pp} x CP {self.cp} x "
                 f"DP {self.dp} = {self.tp * self.pp * self.cp * self.dp}"]
        if self.num_experts:
            lines.append(f"  experts, per pipeline stage: ETP {self.etp} x EP {self.ep} x expert-DP {self.expert_dp} "
                         f"= {self.etp * self.ep * self.expert_dp}; {self.num_experts} experts, "
                         f"{self.num_experts // self.ep} per EP rank")
            lines.append(f"  distributed optimizer: dense parameters sharded over DP x CP = {self.dense_optimizer_shards}, "
                         f"expert parameters over expert-DP = {self.expert_optimizer_shards}")
        else:
            lines.append(f"  dense model (no experts); distributed optimizer sharded over DP x CP = "
                         f"{self.dense_optimizer_shards}")
        return "\n".join(lines)


def dense_layout_problems(layout: ParallelLayout, global_batch_size: int) -> list[Problem]:
    """TP x PP x CP must divide the trainer's GPUs, and the data-parallel size the global batch."""
    if layout.model_parallel < 1:
        return []  # a size below 1: its range problem says so
    if layout.world % layout.model_parallel:
        return [Problem("training.tensor_model_parallel_size", "not_divisible",
                        f"TP*PP*CP = {layout.tp}*{layout.pp}*{layout.cp} = {layout.model_parallel} does not divide "
                        f"the trainer's {layout.world} GPUs (actor_num_nodes * actor_num_gpus_per_node)")]
    if layout.dp and global_batch_size % layout.dp:
        return [Problem("training.global_batch_size", "not_divisible",
                        f"{global_batch_size} is not divisible by the data-parallel size {layout.dp}")]
    return []


def layout_problems(layout: ParallelLayout, arch: ModelArchitecture | None,
                    training: TrainingConfig) -> list[Problem]:
    """A problem for each layout Megatron would refuse (after the queue wait) or that cannot split."""
    ep_field, etp_field = "training.expert_model_parallel_size", "training.expert_tensor_parallel_size"
    if arch is None:
        return []
    if not arch.is_moe:
        problems = []
        if layout.ep != 1:
            problems.append(Problem(ep_field, "unsupported",
                                    f"{layout.ep}: the model is dense (no experts to split); set 1"))
        if training.expert_tensor_parallel_size not in (None, 1, layout.tp):
            problems.append(Problem(etp_field, "unsupported",
                                    f"{training.expert_tensor_parallel_size}: the model is dense (no experts); "
                                    f"leave it out"))
        return problems
    problems = []
    experts = arch.num_moe_experts or 0
    if experts % layout.ep:
        problems.append(Problem(ep_field, "not_divisible",
                                f"the model's {experts} experts do not split over EP {layout.ep} (each EP rank "
                                f"holds num_experts / EP experts); use a divisor of {experts}"))
    expert_group = layout.etp * layout.ep * layout.pp
    if layout.world % expert_group:
        problems.append(Problem(ep_field, "not_divisible",
                                f"ETP x EP x PP = {layout.etp} x {layout.ep} x {layout.pp} = {expert_group} does "
                                f"not divide the trainer's {layout.world} GPUs (Megatron builds expert groups of "
                                f"ETP x EP ranks in every pipeline stage)"))
    if layout.tp > 1 and not training.sequence_parallel:
        problems.append(Problem("training.sequence_parallel", "needs",
                                f"MoE with TP {layout.tp} needs sequence parallelism (Megatron's "
                                f"MoE layer raises in training otherwise): add --sequence-parallel"))
    return problems
