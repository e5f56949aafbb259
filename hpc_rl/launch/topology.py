"""Job topology from the config: het groups, engines, GPU assignment, ports, NCCL world sizes.

Owns: the pure arithmetic of placing trainer ranks and SGLang engines on nodes (decoupled: two het
groups; colocated: one group, engines overlapping the trainer's GPUs), the per-process port plan
(virtual Slurm nodes share one network stack, so every server gets its own port) and the
weight-update group layout (trainer rank 0 = rank 0, engine i at 1 + sum of earlier engines' TP).
The training modes' shapes: a trainer-only job (SFT: `debug_train_only`) has one group and no engine; an
on-policy-distillation teacher started with the job gets a het group of its own (its own GPUs; never in
the weight-update group, never behind the router).
No processes, no Slurm calls.

An engine larger than a node spans whole consecutive nodes (SGLang's multi-node serving: `--nnodes N
--node-rank k --dist-init-addr`, each node holding TP ranks k*T/N .. (k+1)*T/N - 1): one process per node,
node-rank 0 serving the HTTP API and the others only SGLang's health endpoints. Every node-rank gets its own
port (on real clusters each node's own address would do; virtual nodes of one machine share loopback), and
node-rank 0 one more for the distributed init (`dist_init_port`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from hpc_rl.config.layout_checks import engine_count_problems, engine_span_problem
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sections.cluster import ClusterConfig

DEFAULT_BASE_PORT = 15000
PORTS_PER_ENGINE = 4  # HTTP, NCCL/gloo side channels, spare: SGLang opens a few ports after its own


@dataclass(frozen=True, kw_only=True)
class EnginePlacement:
    """One engine: its het group, node (index within that group), GPUs and HTTP port."""

    engine_index: int
    het_group: int
    node_index: int
    """Its (first) node, an index into its het group's nodes."""
    gpu_ids: tuple[int, ...]
    """GPU positions on each of its nodes (a multi-node engine: every GPU of each node it spans)."""
    port: int
    weight_group_rank_offset: int
    num_nodes: int = 1
    """Nodes it spans (SGLang `--nnodes`): nodes node_index .. node_index + num_nodes - 1."""

    @property
    def tp_size(self) -> int:
        """All its GPUs (SGLang's TP size over every node it spans)."""
        return len(self.gpu_ids) * self.num_nodes

    def node_ports(self) -> list[int]:
        """The port of each node-rank: node-rank 0's serves the API, the others SGLang's health endpoints."""
        return [node_rank_port(self.port, rank) for rank in range(self.num_nodes)]

    @property
    def dist_init_port(self) -> int:
        """Node-rank 0's port for SGLang's `--dist-init-addr` (multi-node engines)."""
        return self.port + DIST_INIT_PORT_OFFSET


def node_rank_port(port: int, node_rank: int) -> int:
    """Node-rank k of an engine whose node-rank 0 serves at `port` (each in its own block of ports)."""
    return port + PORTS_PER_ENGINE * node_rank


DIST_INIT_PORT_OFFSET = 1
"""In node-rank 0's block of PORTS_PER_ENGINE ports: the distributed init (the HTTP port is at 0)."""


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
    trainer_only: bool = False
    """A trainer-only job (SFT, cluster.debug_train_only): no engine, no router."""

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
        note = (" (a trainer-only job: no engines, no router)" if self.trainer_only else
                "" if self.engines or self.colocate else " (external: rollout.rollout_external_engine_addrs)")
        lines.append(f"  engines: {len(self.engines)}{note}")
        for engine in self.engines:
            if engine.num_nodes > 1:
                nodes = (f"nodes {engine.node_index}-{engine.node_index + engine.num_nodes - 1} (SGLang --nnodes "
                         f"{engine.num_nodes}; node-rank 0 serves HTTP), GPUs {list(engine.gpu_ids)} of each")
            else:
                nodes = f"node {engine.node_index}, GPUs {list(engine.gpu_ids)}"
            lines.append(
                f"    engine {engine.engine_index}: het group {engine.het_group}, {nodes}, port {engine.port}, "
                f"weight-group rank {engine.weight_group_rank_offset}"
            )
        if self.teacher is not None:
            lines.append(f"  teacher (on-policy distillation): het group {self.teacher.het_group}, GPUs "
                         f"{list(self.teacher.gpu_ids)}, port {self.teacher.port}; behind the job's engine key")
        if self.trainer_only:
            pass  # no engine to send weights to
        elif self.colocate:
            lines.append("  weights: /update_weights_from_tensor per bucket from each trainer rank to the engine on its "
                         "GPUs (CUDA IPC; no weight-update group; under PP each stage's parameters reach every stage "
                         "over the pipeline groups first); engines run with --enable-memory-saver")
        else:
            lines.append(f"  weight-update (NCCL) world size: {self.weight_update_world_size}")
        router = "" if self.trainer_only else f", router {self.router_port} (metrics {self.router_metrics_port})"
        lines.append(f"  ports: controller {self.controller_port}{router}")
        return "\n".join(lines)


def engine_nodes(engine_tp: int, gpus_per_node: int) -> int:
    """Nodes one engine spans: 1 when it fits on a node, else engine_tp / gpus_per_node whole nodes (SGLang
    splits its TP ranks evenly over `--nnodes`); ValueError when it is larger than a node but not whole nodes."""
    span = engine_span_problem(engine_tp, gpus_per_node)  # the rule validation checks too: one home
    if span is not None:
        raise ValueError(span.message)
    return 1 if engine_tp <= gpus_per_node else engine_tp // gpus_per_node


def plan_topology(cluster: ClusterConfig, *, base_port: int = DEFAULT_BASE_PORT) -> JobTopology:
    """Place trainer ranks and engines (and a distillation teacher, `opd_teacher_num_gpus` > 0); raises
    ValueError for shapes that cannot be placed."""
    engine_tp = cluster.rollout_num_gpus_per_engine
    for problem in engine_count_problems(cluster):  # the rule validation checks too: one home
        raise ValueError(str(problem))
    num_engines = 0 if cluster.debug_train_only else cluster.rollout_num_gpus // engine_tp
    gpus_per_node = cluster.actor_num_gpus_per_node if cluster.colocate else cluster.num_gpus_per_node
    nodes_per_engine = engine_nodes(engine_tp, gpus_per_node)
    trainer_world = cluster.trainer_world_size
    engine_port = base_port + 10

    def place(engines_per_node: int, het_group: int) -> list[EnginePlacement]:
        """Engines fill nodes in order, each on the next `engine_tp` GPUs of its node; an engine larger than a
        node on the next `nodes_per_engine` whole nodes."""
        placed = []
        for index in range(num_engines):
            if nodes_per_engine > 1:
                node, gpus = index * nodes_per_engine, tuple(range(gpus_per_node))
            else:
                node, slot = divmod(index, engines_per_node)
                gpus = tuple(range(slot * engine_tp, (slot + 1) * engine_tp))
            placed.append(EnginePlacement(
                engine_index=index, het_group=het_group, node_index=node, gpu_ids=gpus,
                port=engine_port + PORTS_PER_ENGINE * index * nodes_per_engine,
                weight_group_rank_offset=1 + index * engine_tp, num_nodes=nodes_per_engine,
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
        engines_per_node = max(1, gpus_per_node // engine_tp)
        rollout_nodes = math.ceil(num_engines / engines_per_node) * nodes_per_engine
        engines = place(engines_per_node, het_group=1)
        groups = (
            HetGroup(index=0, role="trainer", num_nodes=cluster.actor_num_nodes,
                     gpus_per_node=cluster.actor_num_gpus_per_node, tasks_per_node=cluster.actor_num_gpus_per_node),
            HetGroup(index=1, role="rollout", num_nodes=rollout_nodes,
                     gpus_per_node=min(gpus_per_node, cluster.rollout_num_gpus), tasks_per_node=engines_per_node),
        )
    teacher, teacher_gpus = None, cluster.opd_teacher_num_gpus
    if teacher_gpus > 0:
        if teacher_gpus > cluster.num_gpus_per_node:
            raise ValueError(f"a teacher engine of {teacher_gpus} GPUs does not fit on a node of "
                             f"{cluster.num_gpus_per_node}")
        teacher = EnginePlacement(engine_index=-1, het_group=len(groups), node_index=0,
                                  gpu_ids=tuple(range(teacher_gpus)), port=engine_port + PORTS_PER_ENGINE * num_engines,
                                  weight_group_rank_offset=-1)
        groups = (*groups, HetGroup(index=len(groups), role="teacher", num_nodes=1, gpus_per_node=teacher_gpus,
                                    tasks_per_node=1))
    return JobTopology(
        groups=groups,
        engines=tuple(engines),
        teacher=teacher,
        trainer_only=cluster.debug_train_only,
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


def plan_run_topology(config: RunConfig) -> JobTopology:
    """The run's topology: with external engines (rollout.rollout_external_engine_addrs) the job starts none and
    asks Slurm for no rollout nodes."""
    topology = plan_topology(config.cluster)
    if not config.rollout.rollout_external_engine_addrs:
        return topology
    groups, teacher = topology.groups[:1], topology.teacher
    if teacher is not None:  # the distillation teacher keeps a het group of its own, now the second
        teacher = dataclasses.replace(teacher, het_group=1)
        groups = (*groups, dataclasses.replace(topology.groups[-1], index=1))
    return dataclasses.replace(topology, engines=(), groups=groups, teacher=teacher, weight_update_world_size=0)
