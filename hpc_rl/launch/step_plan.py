"""The job's steps as the driver starts them (and `--dry-run` prints them): each engine's and the trainer's.

Owns: what every step asks Slurm for and runs. GPUs come from Slurm, never from an environment variable
the driver sets (Slurm's GPU plugin overwrites `CUDA_VISIBLE_DEVICES` in a step that holds GPUs, and under
`ConstrainDevices=yes` a step that asked for none sees none):

    trainer step        --gpus-per-node=G on each trainer node; rank LOCAL_RANK uses position LOCAL_RANK
    distillation teacher  --exact --gpus-per-node=T on its own het group (opd_teacher_num_gpus), the engine
                        command on the teacher's checkpoint, `--base-gpu-id 0` (no placement report: no weights
                        are ever sent to it)
    colocated engine    --overlap --gpus-per-node=G: the same G GPUs of its node as the trainer's step
                        (in the same order), and SGLang `--base-gpu-id` = its first GPU's position there
    decoupled engine    --exact --gpus-per-node=T: T GPUs of its own, `--base-gpu-id 0`
    multi-node engine   one step over its N nodes, one task per node, each holding its node's GPUs (colocated:
                        --overlap, the trainer's); SGLang `--nnodes N --dist-init-addr <node 0>:<port>`, and each
                        task's `--node-rank`, `--host`, `--port` filled in by gpu_step from its task rank
    local run           no Slurm: positions on this machine (decoupled engines after the trainer's GPUs); an
                        engine that spans nodes needs Slurm (`hpc_rl.launch.local` refuses it)

Every engine step starts through `hpc_rl.engines.gpu_step`, which reads back what Slurm gave the step,
checks the planned positions exist, reports the engine's device identities to
`<run_dir>/placement/engine-<i>.json`, and execs the engine (the CPU engine or `sglang.launch_server`).
Also owns whether a run asks Slurm for GPUs at all (`asks_slurm_for_gpus`), and the container every
Slurm step runs in (`slurm.container_image`): the image's `python3` runs hpc_rl from the run's source
checkout (mounted at the same path, on PYTHONPATH) or, for an installed hpc_rl, the image's own copy;
the run dir and the working directory are mounted at their paths. The driver itself stays on the host.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from hpc_rl.config.lora import engine_lora_options
from hpc_rl.config.precision import trainer_dtype_name
from hpc_rl.config.schema import RunConfig
from hpc_rl.config.sglang_options import engine_kind
from hpc_rl.engines.engine_process import cpu_engine_command
from hpc_rl.engines.gpu_step import engine_report_path
from hpc_rl.engines.sglang_launch import (
    ROUTED_EXPERTS_FLAG,
    SGLANG_PYTHON_ENV,
    SglangLaunchSpec,
    build_sglang_command,
    render_option,
    sglang_device_options,
)
from hpc_rl.launch.bound_torchrun import FORK_FLAG
from hpc_rl.launch.steps import ContainerSpec, StepSpec
from hpc_rl.launch.topology import EnginePlacement, JobTopology

SGLANG_API_KEY_FILE = "sglang_api_key.yaml"
"""In the run dir, 0600: the engine key for SGLang's `--config` (written by the driver)."""


def asks_slurm_for_gpus(config: RunConfig) -> bool:
    """GPU runs (unless slurm.gres_per_node is false), and CPU runs with slurm.gpus_for_cpu_runs (the
    local test cluster's fake GPUs: Slurm's placement checked without CUDA)."""
    wanted = config.cluster.device == "cuda" or config.slurm.gpus_for_cpu_runs
    return wanted and config.slurm.gres_per_node


def sglang_api_key_path(config: RunConfig) -> Path:
    """Where SGLang engines read the engine key from (`--config`)."""
    return Path(config.run_dir or "<run_dir>") / SGLANG_API_KEY_FILE


def engine_base_gpu_id(config: RunConfig, topology: JobTopology, placement: EnginePlacement, *, local: bool) -> int:
    """The position of the engine's first GPU in the GPU list its step sees (SGLang's `--base-gpu-id`)."""
    if placement.num_nodes > 1 and not local:
        return 0  # whole nodes: every GPU of each node the step holds
    if topology.colocate:
        return placement.gpu_ids[0]  # the step holds its node's GPUs, as the trainer's step does
    if local:  # one machine: the trainer's ranks take the first GPUs
        return topology.trainer_procs_per_node + placement.gpu_ids[0]
    return 0  # Slurm gave the step exactly its own GPUs


def engine_gpus_asked(config: RunConfig, topology: JobTopology, placement: EnginePlacement) -> int:
    """`--gpus-per-node` of an engine step: the node's trainer GPUs when colocated, else its own."""
    if not asks_slurm_for_gpus(config):
        return 0
    return topology.trainer_procs_per_node if topology.colocate else len(placement.gpu_ids)


def in_container(config: RunConfig, *, local: bool) -> bool:
    """Slurm steps run in slurm.container_image; a local run ignores it (no srun to wrap)."""
    return bool(config.slurm.container_image) and not local


def step_python(config: RunConfig, *, local: bool = False) -> str:
    """The interpreter of every step: this one, or the container image's `python3`."""
    return "python3" if in_container(config, local=local) else sys.executable


def source_checkout() -> Path | None:
    """The directory holding the `hpc_rl` package when it is a source checkout (not an installed copy)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "setup.cfg").is_file() or (root / "pyproject.toml").is_file() else None


def container_spec(config: RunConfig, run_dir: Path, *, workdir: str | None = None) -> ContainerSpec | None:
    """The container of every Slurm step (None without slurm.container_image): the run dir, the working
    directory, the source checkout and slurm.container_mounts mounted; GPUs passed in on cuda runs."""
    slurm = config.slurm
    if not slurm.container_image:
        return None
    workdir = workdir or os.getcwd()
    paths = [str(run_dir), workdir] + ([str(source_checkout())] if source_checkout() else [])
    mounts = [f"{path}:{path}" for path in dict.fromkeys(paths)] + list(slurm.container_mounts)
    return ContainerSpec(image=slurm.container_image, runtime=slurm.container_runtime, mounts=tuple(mounts),
                         workdir=workdir, gpus=config.cluster.device == "cuda")


def step_environment(config: RunConfig, env: dict[str, str], *, local: bool) -> dict[str, str]:
    """`env` plus, in a container, PYTHONPATH to the source checkout (the driver's hpc_rl, not the image's)."""
    checkout = source_checkout()
    if in_container(config, local=local) and checkout is not None:
        return {**env, "PYTHONPATH": str(checkout)}
    return env


def multi_node_options(placement: EnginePlacement, dist_init_addr: str) -> list[str]:
    """SGLang's multi-node flags every node-rank shares (`--node-rank`, `--host`, `--port` are each task's:
    `hpc_rl.engines.gpu_step` fills them in); none for an engine on one node."""
    if placement.num_nodes == 1:
        return []
    return ["--nnodes", str(placement.num_nodes), "--dist-init-addr", dist_init_addr]


def engine_command(config: RunConfig, placement: EnginePlacement, host: str, port: int, *, base_gpu_id: int = 0,
                   local: bool = False, dist_init_addr: str = "") -> list[str]:
    """The engine's own argv: hpc_rl's CPU engine (key in `API_KEY_ENV`) or sglang.launch_server (key in
    the run dir's `SGLANG_API_KEY_FILE`). No key on either. A multi-node engine's argv is node-rank 0's."""
    tp_size = config.cluster.rollout_num_gpus_per_engine
    dtype = trainer_dtype_name(config.cluster.device)
    options = config.sglang.server_options()
    spanning = multi_node_options(placement, dist_init_addr)
    if engine_kind(config.rollout.engine, config.cluster.device) == "cpu":
        extra = ["--base-gpu-id", str(base_gpu_id), "--dtype", str(options.get("dtype") or dtype), *spanning]
        if config.training.use_rollout_routing_replay:
            extra.append(ROUTED_EXPERTS_FLAG)
        for key, value in engine_lora_options(config.lora).items():  # --enable-lora etc., as SGLang's (issue 33)
            extra += render_option(key, value)
        return cpu_engine_command(config.checkpoint.hf_checkpoint, host=host, port=port,
                                  max_running_requests=config.sglang.server_concurrency, weight_version="0",
                                  extra_args=extra + (["--enable-memory-saver"] if config.cluster.colocate else []),
                                  python=step_python(config, local=local))
    options = {**sglang_device_options(config.cluster.device, options), **engine_lora_options(config.lora)}
    options.setdefault("dtype", dtype)  # validation refuses another one
    python = None if in_container(config, local=local) else os.environ.get(SGLANG_PYTHON_ENV)
    # On device cpu SGLang reads its gpu id as a NUMA node (OpenMP thread binding; 0.5.23 exits with "NUMA index
    # 1 ... is out of range for 1 numa nodes" for the second GPU position): no --base-gpu-id there.
    sglang_base_gpu_id = None if config.cluster.device == "cpu" else base_gpu_id
    spec = SglangLaunchSpec(hf_checkpoint=config.checkpoint.hf_checkpoint, host=host, port=port,
                            rollout_num_gpus_per_engine=tp_size, api_key_file=str(sglang_api_key_path(config)),
                            sglang_options=options, python=python or step_python(config, local=local),
                            colocated=config.cluster.colocate, base_gpu_id=sglang_base_gpu_id,
                            return_routed_experts=config.training.use_rollout_routing_replay)
    return build_sglang_command(spec) + spanning


def engine_step(config: RunConfig, topology: JobTopology, index: int, *, host: str, port: int, run_dir: Path,
                env: dict[str, str], local: bool, node_hosts: list[str] | None = None,
                node_ports: list[int] | None = None, dist_init_port: int | None = None) -> StepSpec:
    """Engine `index`'s step: its argv behind the placement check, and what it asks Slurm for. A multi-node
    engine gets the address and port of each of its node-ranks (`node_hosts`, `node_ports`; node-rank 0's are
    `host`, `port`) and node-rank 0's distributed-init port."""
    placement = topology.engines[index]
    base = engine_base_gpu_id(config, topology, placement, local=local)
    check = [step_python(config, local=local), "-m", "hpc_rl.engines.gpu_step", "--base-gpu-id", str(base),
             "--tp-size", str(len(placement.gpu_ids)), "--report", str(engine_report_path(run_dir, index))]
    dist_init_addr = ""
    if placement.num_nodes > 1:
        hosts = node_hosts or [host] * placement.num_nodes
        ports = node_ports or placement.node_ports()
        check += ["--nnodes", str(placement.num_nodes), "--node-hosts", ",".join(hosts),
                  "--node-ports", ",".join(map(str, ports))]
        dist_init_addr = f"{host}:{dist_init_port or placement.dist_init_port}"
    argv = [*check, "--", *engine_command(config, placement, host, port, base_gpu_id=base, local=local,
                                          dist_init_addr=dist_init_addr)]
    return StepSpec(name=f"engine-{index}", argv=argv,
                    env=step_environment(config, env, local=local), het_group=placement.het_group,
                    node_index=placement.node_index, num_nodes=placement.num_nodes, tasks_per_node=1,
                    gpus_per_node=engine_gpus_asked(config, topology, placement), overlap=topology.colocate,
                    log_path=run_dir / "logs" / f"engine-{index}.log",
                    container=None if local else container_spec(config, run_dir))


def teacher_engine_config(config: RunConfig) -> RunConfig:
    """The config an engine command reads, for the distillation teacher: its checkpoint and GPUs, never colocated,
    no routed experts in its answers (only the policy's engines feed rollout routing replay), no LoRA."""
    return dataclasses.replace(
        config, checkpoint=dataclasses.replace(config.checkpoint,
                                               hf_checkpoint=config.distillation.opd_teacher_hf_checkpoint or ""),
        cluster=dataclasses.replace(config.cluster, colocate=False,
                                    rollout_num_gpus_per_engine=config.cluster.opd_teacher_num_gpus),
        training=dataclasses.replace(config.training, use_rollout_routing_replay=False),
        lora=dataclasses.replace(config.lora, lora_rank=0))  # the teacher serves its own weights, no adapter


def teacher_step(config: RunConfig, topology: JobTopology, *, host: str, port: int, run_dir: Path,
                 env: dict[str, str], local: bool) -> StepSpec:
    """On-policy distillation's teacher engine (topology.teacher): GPUs of its own (locally: after the trainer's
    and the decoupled engines')."""
    placement = topology.teacher
    assert placement is not None
    taken = topology.trainer_procs_per_node + (0 if topology.colocate else sum(len(e.gpu_ids) for e in topology.engines))
    base = taken if local else 0
    return StepSpec(name="teacher", argv=engine_command(teacher_engine_config(config), placement, host, port,
                                                         base_gpu_id=base, local=local),
                    env=step_environment(config, env, local=local), het_group=placement.het_group,
                    node_index=placement.node_index, num_nodes=1, tasks_per_node=1,
                    gpus_per_node=len(placement.gpu_ids) if asks_slurm_for_gpus(config) else 0, overlap=False,
                    log_path=run_dir / "logs" / "teacher.log",
                    container=None if local else container_spec(config, run_dir))


def trainer_command(config: RunConfig, run_dir: Path, rendezvous: str, *, local: bool = False) -> list[str]:
    """torchrun over every trainer node (one torchrun per node; it forks the ranks); in a local run its
    stores listen on loopback only (bound_torchrun, with STORE_ADDRESS_ENV set by the driver). On CPU its
    ranks fork from it with their imports done (bound_torchrun's FORK_FLAG, issue 23)."""
    fork = [FORK_FLAG] if config.cluster.device == "cpu" else []
    return [step_python(config, local=local), "-m", "hpc_rl.launch.bound_torchrun", *fork,
            *(["--local-addr=127.0.0.1"] if local else []),
            f"--nnodes={config.cluster.actor_num_nodes}",
            f"--nproc-per-node={config.cluster.actor_num_gpus_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}", f"--rdzv-id={os.environ.get('SLURM_JOB_ID', 'local')}",
            "--max-restarts=0", "-m", "hpc_rl.training", str(run_dir)]


def trainer_step(config: RunConfig, run_dir: Path, rendezvous: str, *, env: dict[str, str], local: bool) -> StepSpec:
    """The torchrun step over every trainer node, holding each node's trainer GPUs."""
    cluster = config.cluster
    return StepSpec(name="trainer", argv=trainer_command(config, run_dir, rendezvous, local=local),
                    env=step_environment(config, env, local=local), het_group=0, num_nodes=cluster.actor_num_nodes,
                    tasks_per_node=1, gpus_per_node=cluster.actor_num_gpus_per_node if asks_slurm_for_gpus(config) else 0,
                    log_path=run_dir / "logs" / "trainer.log", container=None if local else container_spec(config, run_dir))
