"""Job topology from the config: het groups, engines, GPU assignment, ports, NCCL world sizes.

Owns: the pure arithmetic of placing trainer ranks and SGLang engines on nodes (decoupled: two het
groups; colocated: one group, engines overlapping the trainer's GPUs), the per-process port plan
(virtual Slurm nodes share one network stack, so every server gets its own port) and the
weight-update group layout (trainer rank 0 = rank 0, engine i at 1 + sum of earlier engines' TP).
The training modes' shapes: a trainer-only job (SFT: `debug_train_only`) has one group and no engine; an
on-policy-distillation teacher started with the job gets a het group of its own (its own GPUs; never in
the weight-update group, never behind the router).
No processes, no Slurm calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpc_rl.config.schema import ClusterConfig

DEFAULT_BASE_PORT = 15000
PORTS_PER_ENGINE = 4  # HTTP, NCCL/gloo side channels, spare: SGLang opens a few ports after its own


@dataclass(frozen=True, kw_only=True)
class EnginePlacement:
    """One engine: its het group, node (index within that group), GPUs and HTTP port."""

    engine_index: int
    het_group: int
    node_index: int
    gpu_ids: tuple[int, ...]
    port: int
    weight_group_rank_offset: int


@dataclass(frozen=True, kw_only=True)
class HetGroup:
    """One heterogeneous-job component."""

    index: int
    role: str
    """trainer | rollout | trainer+rollout (colocated) | teacher (on-policy distillation's teacher engine)."""
    num_nodes: int
    gpus_per_node: int
    tasks_per_node: int


@dataclass(frozen=True, kw_only=True)
class JobTopology:
    """Everything the launcher needs to place processes."""

    groups: tuple[HetGroup, ...]
    engines: tuple[EnginePlacement, ...]
    trainer_world_size: int
    trainer_nodes: int
    trainer_procs_per_node: int
    weight_update_world_size: int
    """1 (trainer rank 0) + the GPUs of every engine."""
    colocate: bool
    router_port: int
    router_metrics_port: int
    controller_port: int
    rendezvous_port: int
    extra: dict[str, int] = field(default_factory=dict)
    teacher: EnginePlacement | None = None
    """On-policy distillation's teacher engine, when the job starts it (opd_teacher_hf_checkpoint)."""

    def describe(self) -> str:
        """Human-readable summary for `--dry-run` and logs."""
        lines = [f"job topology ({'colocated' if self.colocate else 'decoupled'}):"]
        for group in self.groups:
            lines.append(
                f"  het group {group.index} [{group.role}]: {group.num_nodes} node(s) x {group.gpus_per_node} GPU(s)"
            )
        lines.append(
            f"  trainer: {self.trainer_world_size} rank(s) = {self.trainer_nodes} node(s) x "
            f"{self.trainer_procs_per_node}, torchrun rendezvous port {self.rendezvous_port}"
        )
        lines.append(f"  engines: {len(self.engines)}" + (" (a trainer-only job: no engines, no router)"
                                                           if not self.engines else ""))
        for engine in self.engines:
            lines.append(
                f"    engine {engine.engine_index}: het group {engine.het_group}, node {engine.node_index}, "
                f"GPUs {list(engine.gpu_ids)}, port {engine.port}, weight-group rank {engine.weight_group_rank_offset}"
            )
        if self.teacher is not None:
            lines.append(f"  teacher (on-policy distillation): het group {self.teacher.het_group}, GPUs "
                         f"{list(self.teacher.gpu_ids)}, port {self.teacher.port}; behind the job's engine key")
        if self.engines and self.colocate:
            lines.append("  weights: /update_weights_from_tensor per bucket from each trainer rank to the engine on its "
                         "GPUs (CUDA IPC; no weight-update group); engines run with --enable-memory-saver")
        elif self.engines:
            lines.append(f"  weight-update (NCCL) world size: {self.weight_update_world_size}")
        router = f", router {self.router_port} (metrics {self.router_metrics_port})" if self.engines else ""
        lines.append(f"  ports: controller {self.controller_port}{router}")
        return "\n".join(lines)


def plan_topology(cluster: ClusterConfig, *, base_port: int = DEFAULT_BASE_PORT) -> JobTopology:
    """Place trainer ranks and engines (and a distillation teacher, `opd_teacher_num_gpus` > 0); raises
    ValueError for shapes that cannot be placed."""
    engine_tp = cluster.rollout_num_gpus_per_engine
    if engine_tp < 1 or cluster.rollout_num_gpus % engine_tp:
        raise ValueError(
            f"rollout_num_gpus ({cluster.rollout_num_gpus}) must be a positive multiple of "
            f"rollout_num_gpus_per_engine ({engine_tp})"
        )
    num_engines = 0 if cluster.debug_train_only else cluster.rollout_num_gpus // engine_tp
    gpus_per_node = cluster.num_gpus_per_node
    if engine_tp > gpus_per_node:
        raise ValueError(f"an engine of {engine_tp} GPUs does not fit on a node of {gpus_per_node}")
    trainer_world = cluster.trainer_world_size
    engine_port = base_port + 10

    def place(engines_per_node: int, het_group: int) -> list[EnginePlacement]:
        """Engines fill nodes in order, each on the next `engine_tp` GPUs of its node."""
        placed = []
        for index in range(num_engines):
            node, slot = divmod(index, engines_per_node)
            placed.append(EnginePlacement(
                engine_index=index, het_group=het_group, node_index=node,
                gpu_ids=tuple(range(slot * engine_tp, (slot + 1) * engine_tp)),
                port=engine_port + PORTS_PER_ENGINE * index, weight_group_rank_offset=1 + index * engine_tp,
            ))
        return placed

    if cluster.debug_train_only:  # SFT: the trainer alone
        engines: list[EnginePlacement] = []
        groups: tuple[HetGroup, ...] = (HetGroup(
            index=0, role="trainer", num_nodes=cluster.actor_num_nodes,
            gpus_per_node=cluster.actor_num_gpus_per_node, tasks_per_node=cluster.actor_num_gpus_per_node),)
    elif cluster.colocate:
        engines = place(max(1, cluster.actor_num_gpus_per_node // engine_tp), het_group=0)
        groups = (HetGroup(
            index=0, role="trainer+rollout", num_nodes=cluster.actor_num_nodes,
            gpus_per_node=cluster.actor_num_gpus_per_node, tasks_per_node=cluster.actor_num_gpus_per_node,
        ),)
    else:
        engines_per_node = gpus_per_node // engine_tp
        rollout_nodes = math.ceil(num_engines / engines_per_node)
        engines = place(engines_per_node, het_group=1)
        groups = (
            HetGroup(index=0, role="trainer", num_nodes=cluster.actor_num_nodes,
                     gpus_per_node=cluster.actor_num_gpus_per_node, tasks_per_node=cluster.actor_num_gpus_per_node),
            HetGroup(index=1, role="rollout", num_nodes=rollout_nodes,
                     gpus_per_node=min(gpus_per_node, cluster.rollout_num_gpus), tasks_per_node=engines_per_node),
        )
    teacher, teacher_gpus = None, cluster.opd_teacher_num_gpus
    if teacher_gpus > 0:
        if teacher_gpus > gpus_per_node:
            raise ValueError(f"a teacher engine of {teacher_gpus} GPUs does not fit on a node of {gpus_per_node}")
        teacher = EnginePlacement(engine_index=-1, het_group=len(groups), node_index=0,
                                  gpu_ids=tuple(range(teacher_gpus)), port=engine_port + PORTS_PER_ENGINE * num_engines,
                                  weight_group_rank_offset=-1)
        groups = (*groups, HetGroup(index=len(groups), role="teacher", num_nodes=1, gpus_per_node=teacher_gpus,
                                    tasks_per_node=1))
    return JobTopology(
        groups=groups,
        engines=tuple(engines),
        teacher=teacher,
        trainer_world_size=trainer_world,
        trainer_nodes=cluster.actor_num_nodes,
        trainer_procs_per_node=cluster.actor_num_gpus_per_node,
        weight_update_world_size=1 + num_engines * engine_tp,
        colocate=cluster.colocate,
        controller_port=base_port,
        router_port=base_port + 1,
        router_metrics_port=base_port + 2,
        rendezvous_port=base_port + 3,
    )
