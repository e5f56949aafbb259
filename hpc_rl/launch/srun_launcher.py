"""Placing job steps with `srun` inside a (heterogeneous) Slurm allocation: `SrunStepLauncher`.

Owns: turning a `StepSpec` into an `srun` command line (`srun_argv`, pure), starting it as its own
process group with its own log (the `StepLauncher` protocol of `hpc_rl.launch.steps`), stopping it
without leaving tasks behind, and the node names of each het component
(`SLURM_JOB_NODELIST_HET_GROUP_<g>` expanded by `scontrol show hostnames`). It does not decide what
runs (the driver does) nor what the allocation is (`sbatch_render`).

Facts behind the flags (measured on Slurm 22.05, notes/slurm.md and tests/slurm):
- srun inside the batch step inherits SLURM_NTASKS / SLURM_GPUS_PER_NODE of the allocation, so every
  step states `--ntasks` and, when it wants GPUs, `--gpus-per-node` explicitly.
- Without `--exact` a step takes every CPU of its nodes and sibling steps on the same node queue up
  behind it ("step creation temporarily disabled"): engines pinned to a node use `--exact` (their own
  GPUs, their own CPUs); colocated engines use `--overlap` (they share the trainer's GPUs on purpose).
- `--het-group` is only valid in a het job (SLURM_HET_SIZE set); colocated runs are plain jobs.
- Containers (`slurm.container_image`): Pyxis/enroot takes `--container-image`, `--container-mounts`
  (SRC:DST[:FLAGS],...) and `--container-workdir` as srun options; Apptainer runs inside the task:
  `srun ... -- apptainer exec --nv --bind SRC:DST,... --pwd DIR IMAGE argv`. Both pass the step's
  environment in (Slurm's GPU variables included).
- A step's GPUs are what it asks for (`--gpus-per-node`; Slurm then sets `CUDA_VISIBLE_DEVICES`,
  `SLURM_STEP_GPUS` in it). `--overlap` with `--gpus-per-node=1` gives every such step the node's
  FIRST GPU (measured: two overlapping steps both got GPU 0), so a colocated engine asks for the GPUs
  of its node that the trainer's step holds and picks its own by SGLang's `--base-gpu-id`.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Mapping

from hpc_rl.process.child_process import start_process_group
from hpc_rl.launch.steps import ContainerSpec, LocalStep, StepSpec


def srun_argv(
    spec: StepSpec,
    *,
    het_job: bool,
    nodelist: list[str] | None = None,
    cpus_per_task: int | None = None,
) -> list[str]:
    """The full `srun ... -- argv` command of a step (`nodelist`: the nodes it is pinned to)."""
    argv = ["srun"]
    if het_job:
        argv.append(f"--het-group={spec.het_group}")
    argv += [
        f"--job-name={spec.name}",
        f"--nodes={spec.num_nodes}",
        f"--ntasks={spec.num_nodes * spec.tasks_per_node}",
        f"--ntasks-per-node={spec.tasks_per_node}",
    ]
    if nodelist:
        argv.append(f"--nodelist={','.join(nodelist)}")
    if spec.gpus_per_node:  # with --overlap too: a step that asks for no GPUs may see none (ConstrainDevices)
        argv.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.overlap:
        argv.append("--overlap")
    elif spec.node_index is not None:
        argv.append("--exact")
        if cpus_per_task:
            argv.append(f"--cpus-per-task={cpus_per_task}")
    if spec.num_nodes * spec.tasks_per_node > 1:
        argv.append("--label")
    container = spec.container
    if container is not None and container.runtime == "pyxis":
        argv += pyxis_options(container)
    argv += ["--kill-on-bad-exit=1", "--unbuffered", "--"]
    if container is not None and container.runtime == "apptainer":
        return argv + apptainer_prefix(container) + list(spec.argv)
    return argv + list(spec.argv)


def pyxis_options(container: ContainerSpec) -> list[str]:
    """Pyxis/enroot's srun options: the image, the bind mounts, the working directory."""
    options = [f"--container-image={container.image}"]
    if container.mounts:
        options.append(f"--container-mounts={','.join(container.mounts)}")
    if container.workdir:
        options.append(f"--container-workdir={container.workdir}")
    return options


def apptainer_prefix(container: ContainerSpec) -> list[str]:
    """What each task runs before the step's argv: `apptainer exec [--nv] --bind ... [--pwd DIR] IMAGE`."""
    prefix = ["apptainer", "exec"]
    if container.gpus:
        prefix.append("--nv")
    if container.mounts:
        prefix += ["--bind", ",".join(container.mounts)]
    if container.workdir:
        prefix += ["--pwd", container.workdir]
    return prefix + [container.image]


def expand_hostnames(nodelist: str) -> list[str]:
    """'node[1-2],gpu07' -> ['node1', 'node2', 'gpu07'] (Slurm's own expansion)."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True, timeout=30,
    )
    return out.stdout.split()


class SrunStep(LocalStep):
    """A step started through srun; `stop` ends its tasks on every node, not only the local srun
    (SIGTERM to srun forwards to every task; if srun hangs on, slurmctld cancels the step)."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], job_id: str | None) -> None:
        super().__init__(name, process)
        self.job_id = job_id
        """The id of the step's component (a het component has its own: `SLURM_JOB_ID_HET_GROUP_<g>`)."""

    def on_stop_timeout(self) -> None:
        self._cancel_step()

    def _cancel_step(self) -> None:
        """srun did not end in time: have slurmctld kill the step's tasks (found by the step's name)."""
        if not self.job_id:
            return
        listing = subprocess.run(
            ["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"], check=False, capture_output=True, text=True, timeout=30,
        )
        for line in listing.stdout.splitlines():
            step_id, _, step_name = line.strip().partition(" ")
            if step_name == self.name:
                subprocess.run(["scancel", "--signal=KILL", step_id], check=False, capture_output=True, timeout=30)


class SrunStepLauncher:
    """Runs each step with `srun` in the current Slurm allocation (the driver is the batch step)."""

    def __init__(self, *, environ: Mapping[str, str] | None = None, cpus_per_task: int | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        if "SLURM_JOB_ID" not in self.environ:
            raise RuntimeError("SrunStepLauncher needs a Slurm allocation (SLURM_JOB_ID is not set)")
        self.het_job = "SLURM_HET_SIZE" in self.environ
        self.cpus_per_task = cpus_per_task
        self._hostnames: dict[int, list[str]] = {}

    @property
    def job_id(self) -> str:
        return self.environ["SLURM_JOB_ID"]

    def hostnames(self, het_group: int) -> list[str]:
        """Every node of a het component, in Slurm's order."""
        if het_group not in self._hostnames:
            key = f"SLURM_JOB_NODELIST_HET_GROUP_{het_group}" if self.het_job else "SLURM_JOB_NODELIST"
            if key not in self.environ:
                raise RuntimeError(f"het group {het_group} is not part of this job ({key} is not set)")
            self._hostnames[het_group] = expand_hostnames(self.environ[key])
        return self._hostnames[het_group]

    def node_address(self, het_group: int, node_index: int) -> str:
        """The node's IP address (servers such as sglang-router bind and are reached by address, not name).

        A name that resolves to loopback (Debian maps a host's own name to 127.0.1.1) is replaced by
        this host's address toward the job's other nodes when any of them resolves elsewhere."""
        nodes = self.hostnames(het_group)
        if not 0 <= node_index < len(nodes):
            raise IndexError(f"het group {het_group} has {len(nodes)} node(s); node {node_index} asked for")
        every_node = [name for group in self._het_groups() for name in self.hostnames(group)]
        return reachable_address(nodes[node_index], every_node)

    def _het_groups(self) -> list[int]:
        if not self.het_job:
            return [0]
        return list(range(int(self.environ["SLURM_HET_SIZE"])))

    def command(self, spec: StepSpec) -> list[str]:
        """The srun command line this launcher runs for `spec`."""
        nodelist = None
        if spec.node_index is not None:
            nodes = self.hostnames(spec.het_group)
            nodelist = nodes[spec.node_index:spec.node_index + spec.num_nodes]
        return srun_argv(spec, het_job=self.het_job, nodelist=nodelist, cpus_per_task=self.cpus_per_task)

    def start(self, spec: StepSpec) -> SrunStep:
        # srun itself is the step's leader here; it forwards signals to the tasks on every node.
        process = start_process_group(self.command(spec), env={**self.environ, **spec.env}, log_path=spec.log_path,
                                      tie_to_parent=False)
        component_job_id = self.environ.get(f"SLURM_JOB_ID_HET_GROUP_{spec.het_group}", self.job_id)
        return SrunStep(spec.name, process, component_job_id if self.het_job else self.job_id)


def resolve(name: str) -> str:
    """`name`'s IPv4 address, or the name itself when it does not resolve."""
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def route_source(peer: str) -> str:
    """This host's address on the route to `peer` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


def reachable_address(node: str, job_nodes: list[str], *, resolver: Callable[[str], str] | None = None,
                      source_toward: Callable[[str], str] | None = None) -> str:
    """The address other nodes of the job reach `node` at.

    Loopback stays loopback only when every node of the job resolves to loopback (one machine, as on
    the local test cluster); otherwise a loopback answer can only be this host's own name, and the
    address of its interface toward another node is used instead."""
    resolver = resolver or resolve
    source_toward = source_toward or route_source
    address = resolver(node)
    if not address.startswith("127."):
        return address
    remote = [peer for peer in (resolver(name) for name in job_nodes) if not peer.startswith("127.")]
    if not remote:
        return address
    try:
        return source_toward(remote[0])
    except OSError:
        return address
