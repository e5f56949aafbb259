"""Submitting a run as one heterogeneous Slurm job through submitit, and `--dry-run` for Slurm.

Owns: building the `HetSlurmExecutor` from the config (options rendered by `sbatch_render`, submitit's
folder inside the run dir), submitting `HetJobDriver`, recording the job id in the run dir, printing
where everything goes, and `--wait` (block until the job ends, exit with its status). Called by
`hpc_rl.submit` after validation and after `config.resolved.yaml` is written.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from submitit.core.utils import FailedJobError, UncompletedJobError

from hpc_rl.config.schema import RunConfig
from hpc_rl.launch.sbatch_render import engine_cpus_per_task, render_batch_script, submitit_folder, submitit_parameters
from hpc_rl.launch.slurm_status import JOB_ID_FILE, record_job_id
from hpc_rl.launch.srun_launcher import srun_argv
from hpc_rl.launch.step_plan import engine_step, teacher_step, trainer_step
from hpc_rl.launch.steps import StepSpec
from hpc_rl.launch.submitit_het import (
    DEFAULT_DRIVER,
    HetJobDriver,
    HetSlurmExecutor,
    HetSlurmJob,
    guarded_python,
)
from hpc_rl.launch.run_lock import RunLock
from hpc_rl.launch.run_plan import run_topology
from hpc_rl.launch.topology import JobTopology, plan_run_topology
from hpc_rl.protocol.secret import create_secret, secret_path
from hpc_rl.telemetry.scalars import tensorboard_dir

EXIT_OK, EXIT_FAILED, EXIT_NOT_FINISHED, EXIT_INTERRUPTED = 0, 1, 3, 130


def make_executor(config: RunConfig, topology: JobTopology) -> HetSlurmExecutor:
    """A submitit executor whose batch script is `render_batch_script(config, topology, ...)`."""
    executor = HetSlurmExecutor(submitit_folder(config.run_dir), max_num_timeout=config.slurm.max_num_timeout,
                                python=guarded_python(config.run_dir))
    executor.update_parameters(**submitit_parameters(config, topology))
    return executor


def submit_job(config: RunConfig, *, driver: str = DEFAULT_DRIVER, lock: RunLock | None = None) -> HetSlurmJob:
    """Submit the run in `config.run_dir` (already holding config.resolved.yaml); returns the job. With
    `lock` (the run dir's, taken by submit), the queued job holds the run dir from then on."""
    run_dir = Path(config.run_dir)
    if not secret_path(run_dir).exists():
        create_secret(secret_path(run_dir))
    topology, note = run_topology(run_dir, config)  # submit's plan (an older run dir: planned now)
    if note:
        print(f"hpc_rl: {note}", file=sys.stderr, flush=True)
    executor = make_executor(config, topology)
    job = executor.submit(HetJobDriver(str(run_dir), driver, engine_cpus_per_task(config, topology)))
    record_job_id(run_dir, job.job_id)
    if lock is not None:
        lock.hand_to_job(job.job_id)
    return job  # type: ignore[return-value]


def submission_summary(config: RunConfig, job: HetSlurmJob) -> str:
    run_dir = Path(config.run_dir)
    tensorboard = tensorboard_dir(config, run_dir)
    return "\n".join([
        f"submitted Slurm job {job.job_id} ({config.logging.run_name})",
        f"  run dir:      {run_dir}",
        f"  driver log:   {job.paths.stdout}  (stderr: {job.paths.stderr})",
        f"  step logs:    {run_dir / 'logs'}/{{controller,router,engine-<i>,trainer}}.log",
        f"  job id file:  {run_dir / JOB_ID_FILE}",
        f"  status:       python -m hpc_rl.status {run_dir}",
        f"  cancel:       scancel {job.job_id}",
        f"  tensorboard:  tensorboard --logdir {tensorboard}",
    ])


ACTIVE_STATES = ("", "UNKNOWN", "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING",
                 "SUSPENDED", "REQUEUE_HOLD", "REQUEUE_FED", "STAGE_OUT", "SIGNALING")
UNFINISHED_STATES = ("CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "DEADLINE", "BOOT_FAIL", "OUT_OF_MEMORY")


def final_state(job: HetSlurmJob, *, timeout: float = 20.0) -> str:
    """Slurm's final state of the job (the result file can appear before Slurm has finished the job)."""
    deadline = time.monotonic() + timeout
    state = "UNKNOWN"
    while time.monotonic() < deadline:
        state = job.watcher.get_state(job.job_id, mode="force").split(" ")[0]
        if state.upper() not in ACTIVE_STATES:
            return state
        time.sleep(1.0)
    return state


REQUEUED_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


class RequeueTracker:
    """Whether a job whose result file exists is still going: an attempt ended (a node failed, the driver
    was interrupted) and Slurm requeued the job; the earlier attempt's result file is stale until the
    next attempt ends and writes it again. Once a requeue was seen, wait for a final Slurm state."""

    def __init__(self, job: HetSlurmJob) -> None:
        self.job = job
        self.seen_requeue = False

    def still_going(self) -> bool:
        state = self.job.watcher.get_state(self.job.job_id, mode="force").split(" ")[0].upper()
        if state in REQUEUED_STATES:
            self.seen_requeue = True
            return True
        return self.seen_requeue and state in ACTIVE_STATES and state not in ("", "UNKNOWN")


def wait_for_job(job: HetSlurmJob, *, poll_seconds: float = 2.0, out=sys.stderr) -> int:  # type: ignore[no-untyped-def]
    """Block until the job ends (requeues included); 0 only when Slurm says COMPLETED and the driver succeeded."""
    last_state = ""
    requeue = RequeueTracker(job)
    try:
        while not job.done() or requeue.still_going():
            state = job.state
            if state != last_state:
                print(f"job {job.job_id}: {state}", file=out, flush=True)
                last_state = state
            time.sleep(poll_seconds)
        state = final_state(job)
    except KeyboardInterrupt:
        print(f"\nstopped waiting; job {job.job_id} keeps running (scancel {job.job_id} stops it)", file=out)
        return EXIT_INTERRUPTED
    if state.upper().startswith(UNFINISHED_STATES):
        print(f"job {job.job_id}: {state}: ended before the run finished; log: {job.paths.stderr}", file=out)
        return EXIT_NOT_FINISHED
    try:
        job.result()
    except FailedJobError as error:
        errors = [line for line in str(error).splitlines() if "Error:" in line and not line.startswith(" ")]
        print(f"job {job.job_id}: {state}: {errors[-1] if errors else 'the driver failed'}; log: {job.paths.stderr}",
              file=out)
        return EXIT_FAILED
    except UncompletedJobError as error:
        print(f"job {job.job_id}: {state}: ended before the run finished ({str(error).splitlines()[0]})", file=out)
        return EXIT_NOT_FINISHED
    print(f"job {job.job_id}: {state}", file=out)
    return EXIT_OK if state.upper() in ("COMPLETED", "UNKNOWN") else EXIT_FAILED


def submit_slurm(config: RunConfig, wait: bool = False, lock: RunLock | None = None) -> int:
    """`python -m hpc_rl.submit ... --executor slurm`: submit, print the summary, optionally wait."""
    job = submit_job(config, lock=lock)
    print(submission_summary(config, job), flush=True)
    return wait_for_job(job) if wait else EXIT_OK


def planned_steps(config: RunConfig, topology: JobTopology, run_dir: Path) -> list[StepSpec]:
    """The steps the driver starts (`launch.step_plan`, as the driver builds them), for `--dry-run`."""
    from hpc_rl.launch.ports import PortPlan

    ports = PortPlan.for_job(topology, local=False)
    steps = []
    for placement in topology.engines:
        node_ports, dist_init_port = ports.engine_node_ports(placement)
        hosts = [f"<node {placement.node_index + rank} of het group {placement.het_group}>"
                 for rank in range(placement.num_nodes)]
        steps.append(engine_step(config, topology, placement.engine_index, run_dir=run_dir, env={}, local=False,
                                 host=hosts[0], port=ports.engines[placement.engine_index], node_hosts=hosts,
                                 node_ports=node_ports, dist_init_port=dist_init_port))
    if topology.teacher is not None:  # on-policy distillation's teacher engine (its own het group)
        steps.append(teacher_step(config, topology, host=f"<node 0 of het group {topology.teacher.het_group}>",
                                  port=ports.teacher or topology.teacher.port, run_dir=run_dir, env={}, local=False))
    steps.append(trainer_step(config, run_dir, f"<first trainer node>:{ports.rendezvous}", env={}, local=False))
    return steps


def render_slurm_dry_run(config: RunConfig) -> str:
    """The exact sbatch script submitit would submit, then the srun command of every step."""
    topology = plan_run_topology(config)
    run_dir = Path(config.run_dir or "<run_dir>")
    folder = submitit_folder(run_dir)
    lines = [f"# sbatch script submitit would write to {folder}/ and submit (a dry run writes nothing)",
             render_batch_script(config, topology, folder=folder, python=guarded_python(run_dir)).rstrip("\n"),
             "", "# job steps the driver starts inside the allocation (ports shift by job id % 300 * 50; any in use on the driver's node are replaced)"]
    het_job = len(topology.groups) > 1
    for spec in planned_steps(config, topology, run_dir):
        nodelist = ([f"<node {spec.node_index + rank} of het group {spec.het_group}>" for rank in range(spec.num_nodes)]
                    if spec.node_index is not None else None)
        argv = srun_argv(spec, het_job=het_job, nodelist=nodelist, cpus_per_task=engine_cpus_per_task(config, topology))
        lines.append(f"# {spec.name} -> {spec.log_path}")
        lines.append(" ".join(argv))
    return "\n".join(lines) + "\n"
