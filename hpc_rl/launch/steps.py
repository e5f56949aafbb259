"""How the driver starts the job's processes: the `StepLauncher` interface and its local implementation.

Owns: the contract between the driver (which decides WHAT runs: engines, torchrun) and the
placement back-end (WHERE it runs): `LocalStepLauncher` starts processes on this machine;
`hpc_rl.launch.srun_launcher.SrunStepLauncher` wraps the same argv in `srun --het-group=...`.
Every step gets its own log file and process group, so stopping a step leaves no orphan.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from hpc_rl.process.child_process import start_process_group, stop_process_group


@dataclass(frozen=True, kw_only=True)
class ContainerSpec:
    """The container every task of a Slurm step runs in (rendered by `srun_launcher.srun_argv`)."""

    image: str
    """Pyxis: an enroot image reference or .sqsh file; Apptainer: a .sif file (or any URI it runs)."""
    runtime: str = "pyxis"
    """pyxis (srun --container-image ...) | apptainer (srun ... apptainer exec ...)."""
    mounts: tuple[str, ...] = ()
    """SRC:DST[:FLAGS] bind mounts (the run dir and working directory among them)."""
    workdir: str = ""
    """Working directory inside the container ("" : the runtime's default)."""
    gpus: bool = True
    """Apptainer: `--nv` (the host's NVIDIA driver and devices inside the container)."""


@dataclass(kw_only=True)
class StepSpec:
    """One job step: a command, where it runs, and where its output goes."""

    name: str
    """Unique short name (log file stem, e.g. 'engine-0', 'trainer')."""
    argv: list[str]
    """The command (for a multi-task step: what every task runs)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables on top of the driver's."""
    het_group: int = 0
    """Het-job component the step runs in (Slurm only)."""
    num_nodes: int = 1
    """Nodes of that component the step spans."""
    tasks_per_node: int = 1
    """Tasks per node (torchrun: 1 per node; it forks the ranks itself)."""
    node_index: int | None = None
    """Pin to the i-th node of the component (engines); None = the first num_nodes nodes."""
    gpus_per_node: int = 0
    """GPUs the step asks Slurm for on each of its nodes (0: none requested); what it got is read back in
    the step (`SLURM_STEP_GPUS`, `CUDA_VISIBLE_DEVICES`), never set by the driver (`launch.step_plan`)."""
    overlap: bool = False
    """Share resources with other steps (colocated engines on the trainer's GPUs, which they ask for too)."""
    log_path: Path | None = None
    """File receiving stdout+stderr."""
    container: ContainerSpec | None = None
    """Run the step's tasks in this container (Slurm steps only; `slurm.container_image`)."""


class StepHandle(Protocol):
    """A started step."""

    name: str

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def stop(self, grace_seconds: float = 10.0) -> int | None: ...


class StepLauncher(Protocol):
    """Places steps: locally, or with srun inside a Slurm allocation."""

    def start(self, spec: StepSpec) -> StepHandle: ...

    def node_address(self, het_group: int, node_index: int) -> str:
        """Host name / address of a node of a component (what servers there are reached at)."""
        ...


class LocalStep:
    """A step running as a local process group."""

    def __init__(self, name: str, process: subprocess.Popen[bytes]) -> None:
        self.name = name
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def stop(self, grace_seconds: float = 10.0) -> int | None:
        """SIGTERM the whole process group, then SIGKILL after `grace_seconds`."""
        return stop_process_group(self.process, grace_seconds, on_timeout=self.on_stop_timeout)

    def on_stop_timeout(self) -> None:
        """The leader ignored SIGTERM for the grace period (subclasses add cleanup; SIGKILL follows)."""


class LocalStepLauncher:
    """Runs every step on this machine (the local executor and tests)."""

    def __init__(self, *, address: str = "127.0.0.1") -> None:
        self.address = address

    def start(self, spec: StepSpec) -> LocalStep:
        process = start_process_group(spec.argv, env={**os.environ, **spec.env}, log_path=spec.log_path)
        return LocalStep(spec.name, process)

    def node_address(self, het_group: int, node_index: int) -> str:
        return self.address
