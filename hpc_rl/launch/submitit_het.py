"""submitit's Slurm executor, extended for heterogeneous jobs, and the driver callable it submits.

Owns the three fixes of notes/slurm.md on top of submitit 1.5.4 (which has no het jobs):
(1) submitit is told `nodes=1` (its result bookkeeping counts one task); the real options are rendered
    by `sbatch_render` through `additional_parameters` and `setup` (`#SBATCH hetjob` + component 1);
(2) `HetSlurmInfoWatcher` maps sacct's `ID+0` (the het leader's first component) to `ID`, so
    `job.state`, `job.done()` and `job.wait()` see RUNNING / COMPLETED / CANCELLED / TIMEOUT;
(3) the batch script runs `exec <python>` (through `hpc_rl.launch.batch_guard`, which forwards every
    signal to the driver and notices a driver that dies) and asks for `--signal=B:USR2@<s>`, so the
    driver receives the time-limit / preemption warning.
Checkpoint-and-requeue stays submitit's: `HetJobDriver.checkpoint` returns the submission to re-run;
the USR2 handler is only deferred until the driver has saved (see `HetJobDriver.__call__`).
"""

from __future__ import annotations

import importlib
import shlex
import signal
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from submitit.core.utils import DelayedSubmission
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

DEFAULT_DRIVER = "hpc_rl.launch.driver:run_driver"
WATCHER_MAX_DELAY_S = 30


class HetSlurmInfoWatcher(SlurmInfoWatcher):
    """sacct reader that also knows het jobs: `ID+0` answers for `ID`; `ID+<g>` stays available."""

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        info = super().read_info(string)
        for job_id, stats in list(info.items()):
            leader, plus, component = job_id.partition("+")
            if plus and component == "0":
                info[leader] = stats
        return info


class HetSlurmJob(SlurmJob[Any]):
    """A submitit Slurm job whose state is read with the het-aware watcher."""

    watcher = HetSlurmInfoWatcher(delay_s=WATCHER_MAX_DELAY_S)


class HetSlurmExecutor(SlurmExecutor):
    """submitit's Slurm executor whose batch step `exec`s Python (the driver gets Slurm's signals)."""

    job_class = HetSlurmJob

    def __init__(self, folder: str | Path, *, max_num_timeout: int = 3, python: str | None = None) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout, python=python or exec_python())


def exec_python(executable: str | None = None) -> str:
    """`exec <python>`: the batch shell is replaced by the driver, so `B:USR2` reaches it."""
    return f"exec {shlex.quote(executable or sys.executable)}"


def guarded_python(run_dir: str | Path, executable: str | None = None) -> str:
    """`exec <python> -m hpc_rl.launch.batch_guard RUN_DIR -- <python>`: the batch step's process is the
    guard (it gets Slurm's signals and forwards them); the driver is its child, so a driver that dies is
    noticed and the job requeued or ended (see `hpc_rl.launch.batch_guard`)."""
    python = shlex.quote(executable or sys.executable)
    return f"exec {python} -m hpc_rl.launch.batch_guard {shlex.quote(str(run_dir))} -- {python}"


def _resolve(path: str) -> Callable[..., Any]:
    module_name, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module_name), attribute)  # type: ignore[no-any-return]


def _last_error(run_dir: str) -> str:
    """': <the run's last error>' from its status.json (what `--wait` then prints), or ''."""
    import json

    try:
        error = json.loads((Path(run_dir) / "status.json").read_text()).get("last_error") or ""
    except (OSError, ValueError, AttributeError):
        return ""
    return f": {str(error).splitlines()[0]}" if error else ""


@dataclass
class HetJobDriver:
    """The callable submitit runs in the batch step: the driver of the run in `run_dir`.

    `driver` names `run_driver(run_dir, launcher, *, local) -> int`; its module may define
    `request_checkpoint()` (called on USR2: save and return soon) and `EXIT_REQUEUE` (the code
    run_driver returns after saving for a requeue). Resuming needs no state here: everything is in the
    run dir, so the requeued submission is this same object.
    """

    run_dir: str
    driver: str = DEFAULT_DRIVER
    cpus_per_task: int | None = None

    def __call__(self) -> int:
        from hpc_rl.launch.srun_launcher import SrunStepLauncher

        run_driver = _resolve(self.driver)
        module = sys.modules[run_driver.__module__]
        request_checkpoint: Callable[[], None] | None = getattr(module, "request_checkpoint", None)
        exit_requeue: int | None = getattr(module, "EXIT_REQUEUE", None)
        # submitit's USR2 handler checkpoints, requeues and exits at once; the driver needs time to
        # save first. Hold submitit's handler back and call it once the driver has returned.
        submitit_handler = signal.getsignal(signal.SIGUSR2)

        def on_usr2(signum: int, frame: types.FrameType | None) -> None:
            if request_checkpoint is not None:
                request_checkpoint()

        signal.signal(signal.SIGUSR2, on_usr2)
        try:
            code = int(run_driver(self.run_dir, SrunStepLauncher(cpus_per_task=self.cpus_per_task), local=False))
        finally:
            signal.signal(signal.SIGUSR2, submitit_handler)
        wants_requeue = exit_requeue is not None and code == exit_requeue
        if wants_requeue and callable(submitit_handler):
            submitit_handler(signal.SIGUSR2, None)  # checkpoint() + scontrol requeue + exit; or raises
        if code != 0:
            raise RuntimeError(f"the driver of {self.run_dir} exited with status {code}{_last_error(self.run_dir)}")
        return code

    def checkpoint(self) -> DelayedSubmission:
        """What submitit re-runs after a requeue: the same driver on the same run dir (it resumes)."""
        return DelayedSubmission(HetJobDriver(self.run_dir, self.driver, self.cpus_per_task))
