"""Where and how a run's processes run: the cluster layout, Slurm, the controller, logging.

Owns: the `cluster`, `slurm`, `controller` and `logging` sections of `hpc_rl.config.schema.RunConfig` (field names,
defaults, types, each section's own invariants).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from hpc_rl.config.problems import raise_problems
from hpc_rl.config.typing_rules import literal_problems

Device = Literal["cuda", "cpu"]
WandbMode = Literal["online", "offline", "disabled"]
WANDB_MODES: tuple[str, ...] = get_args(WandbMode)
ContainerRuntime = Literal["pyxis", "apptainer"]
CONTAINER_RUNTIMES: tuple[str, ...] = get_args(ContainerRuntime)


@dataclass(kw_only=True)
class ClusterConfig:
    """Where the run's processes go: trainer GPUs, rollout GPUs, colocation."""

    actor_num_nodes: int = 1
    """Nodes for trainer ranks (het group 0)."""
    actor_num_gpus_per_node: int = 1
    """Trainer ranks per trainer node (one per GPU; on CPU, one per process)."""
    rollout_num_gpus: int = 1
    """GPUs for rollout engines in total (decoupled: on het group 1; colocated: shared with the trainer)."""
    rollout_num_gpus_per_engine: int = 1
    """GPUs per SGLang engine (its tensor-parallel size)."""
    num_gpus_per_node: int = 8
    """GPUs per node of the cluster (rollout nodes = rollout_num_gpus / this, rounded up)."""
    colocate: bool = False
    """Engines share the trainer's GPUs; memory is released/resumed around each train step."""
    device: Device = "cuda"
    """cuda (NCCL, SGLang) or cpu (gloo, hpc_rl's CPU engine): the single CPU switch."""
    debug_train_only: bool = False
    """A trainer-only job (slime's --debug-train-only): no engines and no router, rollout_num_gpus 0; what SFT
    (rollout_function_path slime.rollout.sft_rollout.generate_rollout) runs, and it sets this itself."""
    opd_teacher_num_gpus: int = 0
    """GPUs of the on-policy-distillation teacher engine the job starts (distillation.opd_teacher_hf_checkpoint;
    its tensor-parallel size, on a het group of its own); 0: no teacher component (1 when that path is set)."""
    gpu_memory_gib: float = 79.6
    """Memory of one GPU in GiB, for the per-GPU memory plan that `--dry-run` prints and submit checks
    (default: an H100 80GB, 81559 MiB as nvidia-smi reports it)."""

    def __post_init__(self) -> None:
        raise_problems(literal_problems(self, "cluster"))

    @property
    def trainer_world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        if self.debug_train_only:
            return 0
        return max(1, self.rollout_num_gpus // max(1, self.rollout_num_gpus_per_engine))


@dataclass(kw_only=True)
class LoggingConfig:
    """Run naming, TensorBoard and (optionally) Weights & Biases."""

    run_name: str = "hpc_rl"
    """Name of the run (run dir and TensorBoard)."""
    tensorboard_dir: str | None = None
    """TensorBoard event dir (default: <run_dir>/tensorboard)."""
    log_level: str = "INFO"
    """Python log level of every component."""
    use_wandb: bool = False
    """Also log the controller's per-rollout scalars to Weights & Biases (needs `pip install 'hpc_rl[wandb]'`)."""
    wandb_mode: WandbMode | None = None
    """online | offline | disabled (None: $WANDB_MODE, else online if the first node reaches the wandb host,
    else offline; an offline run is uploaded later with `wandb sync <wandb_dir>/wandb/offline-run-*`)."""
    wandb_project: str | None = None
    """W&B project (None: wandb's default)."""
    wandb_team: str | None = None
    """W&B entity (team or user)."""
    wandb_group: str | None = None
    """W&B run group (None: run_name)."""
    wandb_key: str | None = None
    """W&B API key for `wandb.login` (None: $WANDB_API_KEY or ~/.netrc; a key here is written into
    config.resolved.yaml)."""
    wandb_host: str | None = None
    """W&B server URL (None: https://api.wandb.ai)."""
    wandb_dir: str | None = None
    """Directory of the wandb files (default: <run_dir>/wandb)."""
    wandb_run_id: str | None = None
    """W&B run id (None: derived from the run dir, so a requeued or resumed run continues the same W&B run)."""
    tb_experiment_name: str | None = None
    """TensorBoard writes under <tensorboard_dir>/<tb_experiment_name> (slime's --tb-experiment-name)."""
    log_passrate: bool = False
    """Log pass@1, pass@2, pass@4, ... up to the group size for every rollout and eval dataset (a sample with
    reward 1 is correct; slime's --log-passrate)."""
    log_correct_samples: bool = False
    """Log the correct samples' length quartiles and mean negative log-prob per rollout (slime's
    --log-correct-samples)."""
    log_reward_category: str | None = None
    """Log the share of each value under this key of the reward object a custom reward or reward server returns
    (rollout/error_cat/<value>; slime's --log-reward-category)."""
    save_debug_rollout_data: str | None = None
    """Write every trained sample of each rollout (all its fields, one JSON object per line, group after group) to
    this path, `{rollout_id}` replaced (slime's --save-debug-rollout-data; JSON lines here, not a torch file)."""
    log_multi_turn: bool = False
    """Log response lengths with and without observation tokens and the round counts of a multi-turn generate
    function (sample.metadata["round_number"]; slime's --log-multi-turn)."""

    def __post_init__(self) -> None:
        raise_problems(literal_problems(self, "logging"))


@dataclass(kw_only=True)
class SlurmConfig:
    """Slurm submission options (ignored by the local executor)."""

    partition: str | None = None
    """--partition for every het group."""
    rollout_partition: str | None = None
    """--partition for the rollout group (default: partition)."""
    account: str | None = None
    """--account."""
    qos: str | None = None
    """--qos."""
    time: str = "04:00:00"
    """--time (HH:MM:SS or minutes)."""
    constraint: str | None = None
    """--constraint."""
    cpus_per_task: int | None = None
    """--cpus-per-task for every task of every component (overrides cpus_per_gpu)."""
    cpus_per_gpu: int = 8
    """GPU runs: CPUs per GPU of a task (trainer rank: this; engine: this x its GPUs); the driver,
    router and reward grading use what the trainer ranks leave on the first node. CPU runs: 1 per task."""
    mem: str | None = None
    """--mem per node."""
    gres_per_node: bool = True
    """Request --gpus-per-node (false on clusters without GPU gres)."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Extra `#SBATCH` option lines, e.g. ['--exclusive', '--reservation=rl']."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before the job (module loads, source venv, container env)."""
    requeue_signal_seconds: int = 120
    """Seconds before the time limit at which USR2 asks for checkpoint + requeue."""
    max_num_timeout: int = 3
    """How many times a timed-out/preempted job is requeued."""
    # -- GPU placement and containers (hpc_rl.launch.step_plan, srun_launcher) --
    gpus_for_cpu_runs: bool = False
    """CPU runs (cluster.device cpu) ask Slurm for GPUs as a GPU run would and place every step on them:
    the local test cluster's fake GPUs check Slurm's GPU placement without CUDA."""
    container_image: str | None = None
    """Run every srun step (engines, trainer) in this image: Pyxis/enroot (`--container-image`, e.g.
    'nvcr.io#nvidia/pytorch:25.01-py3' or a .sqsh) or Apptainer (a .sif). The driver stays on the host."""
    container_runtime: ContainerRuntime = "pyxis"
    """pyxis (srun --container-image/--container-mounts) | apptainer (srun ... apptainer exec --nv)."""
    container_mounts: list[str] = field(default_factory=list)
    """Extra 'SRC:DST[:FLAGS]' mounts; the run dir and the working directory are always mounted."""

    def __post_init__(self) -> None:
        raise_problems(literal_problems(self, "slurm"))


@dataclass(kw_only=True)
class ControllerConfig:
    """The asyncio controller: addresses and timeouts."""

    port: int = 0
    """TCP port of the controller (0: pick a free one)."""
    registration_timeout: float = 600.0
    """Seconds to wait for every trainer rank and engine to register."""
    engine_health_interval: float = 5.0
    """Seconds between engine health checks (slime's --rollout-health-check-interval)."""
    engine_health_timeout: float = 10.0
    """Seconds an engine has to answer a health check before it is failed and restarted (slime's
    --rollout-health-check-timeout)."""
    engine_health_first_wait: float = 0.0
    """Seconds after an engine registers (at start and after each restart) before its first health check: room
    for compilation and warm-up (slime's --rollout-health-check-first-wait; raise it for DeepGEMM)."""
    engine_request_timeout: float = 600.0
    """Seconds before a generate request is considered hung."""
    engine_admin_timeout: float = 300.0
    """Seconds an admin call (pause, a weight-update bucket, memory release/resume) may go without an answer
    before it fails, and its engine with it. A call unanswered for 5 s is logged, and an engine that answers
    neither the call nor /health is failed sooner, by the health check (restart path)."""
    max_engine_restarts: int = 3
    """Restarts of a failed engine before the run fails."""
    trainer_command_timeout: float = 600.0
    """Seconds a trainer rank may stay silent (no heartbeat: stopped, frozen) while a command runs before the run
    fails naming it; named in the log and status after min(30 s, half of this). A long step that computes keeps
    beating: this bounds silence, not a step's length (default: NCCL's 10 min collective watchdog)."""
    max_restarts: int = 0
    """Restarts of the whole run from its last checkpoint after a trainer rank dies (0: fail at once)."""
    frame_signer_min_bytes: int | None = 1 << 20
    """Frames to the job's processes whose payload (a train batch) has at least this many bytes get their HMAC
    computed in a frame signer process of the controller (protocol/frame_signer.py; the same bytes on the wire);
    smaller ones in the controller. None: every MAC in the controller."""
    max_logprob_mismatch: float | None = None
    """Fail the run when, right after a weight sync, the engines' log-probs differ from the trainer's by more
    than this per token (mean |trainer - rollout|); None: 1e-4 on cpu, 0.1 on cuda, 0.1 with FP8 engines (an FP8
    hf_checkpoint); 0: never fail."""
