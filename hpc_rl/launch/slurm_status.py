"""What Slurm says about a run: the job id recorded in its run dir, and the state of each het component.

Owns the `slurm_job_id` file of a run dir and the questions to Slurm about it: `sacct` (accounting:
also answers for jobs that ended) and, when sacct has nothing, `squeue`. Het components appear as
`ID+0`, `ID+1` in both. `hpc_rl.status` calls `describe_slurm_status(run_dir)`.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

JOB_ID_FILE = "slurm_job_id"


@dataclass(frozen=True, kw_only=True)
class ComponentState:
    """One het component (or the whole job, when it is not a het job) as Slurm reports it."""

    job_id: str
    """`ID+<g>` for a het component, `ID` for a plain job."""
    state: str
    nodes: str
    elapsed: str
    exit_code: str = ""


def record_job_id(run_dir: str | Path, job_id: str) -> Path:
    """Write the run's (latest) Slurm job id to `<run_dir>/slurm_job_id`."""
    path = Path(run_dir) / JOB_ID_FILE
    path.write_text(f"{job_id}\n")
    return path


def read_job_id(run_dir: str | Path) -> str | None:
    path = Path(run_dir) / JOB_ID_FILE
    if not path.exists():
        return None
    text = path.read_text().strip()
    return text or None


def parse_sacct(text: str) -> list[ComponentState]:
    """`sacct -X -P -o JobID,State,NodeList,Elapsed,ExitCode` output (with header) -> allocations."""
    rows = [line.split("|") for line in text.strip().splitlines()]
    if len(rows) < 2:
        return []
    header = rows[0]
    states = []
    for row in rows[1:]:
        fields = dict(zip(header, row))
        job_id = fields.get("JobID", "")
        if not job_id or "." in job_id:
            continue
        states.append(ComponentState(job_id=job_id, state=fields.get("State", "").split(" ")[0],
                                     nodes=fields.get("NodeList", ""), elapsed=fields.get("Elapsed", ""),
                                     exit_code=fields.get("ExitCode", "")))
    return states


def parse_squeue(text: str) -> list[ComponentState]:
    """`squeue -h -o %i|%T|%N|%M` output -> one state per job / het component."""
    states = []
    for line in text.strip().splitlines():
        parts = line.split("|")
        if len(parts) >= 4:
            states.append(ComponentState(job_id=parts[0], state=parts[1], nodes=parts[2], elapsed=parts[3]))
    return states


def component_states(job_id: str) -> list[ComponentState]:
    """Ask sacct, then squeue; [] when Slurm knows nothing of the job (or cannot be reached)."""
    try:
        sacct = subprocess.run(["sacct", "-X", "-P", "-j", job_id, "-o", "JobID,State,NodeList,Elapsed,ExitCode"],
                               check=False, capture_output=True, text=True, timeout=30)
        if sacct.returncode == 0:
            states = parse_sacct(sacct.stdout)
            if states:
                return states
        squeue = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i|%T|%N|%M"],
                                check=False, capture_output=True, text=True, timeout=30)
        return parse_squeue(squeue.stdout) if squeue.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        return []


def job_state(states: list[ComponentState]) -> str:
    """The job's state: that of its first component (the het leader), UNKNOWN when none."""
    if not states:
        return "UNKNOWN"
    for state in states:
        if state.job_id.endswith("+0") or "+" not in state.job_id:
            return state.state
    return states[0].state


def describe_slurm_status(run_dir: str | Path) -> str:
    """Lines for `python -m hpc_rl.status`: the job id and each component's state, nodes and time."""
    job_id = read_job_id(run_dir)
    if job_id is None:
        return f"slurm: no job recorded in {Path(run_dir) / JOB_ID_FILE} (not submitted to Slurm)"
    states = component_states(job_id)
    if not states:
        return f"slurm: job {job_id}: Slurm has no record of it (sacct/squeue answered nothing)"
    lines = [f"slurm: job {job_id}: {job_state(states)}"]
    for state in states:
        exit_code = f", exit {state.exit_code}" if state.exit_code else ""
        lines.append(f"  {state.job_id}: {state.state} on {state.nodes or '-'} ({state.elapsed}{exit_code})")
    return "\n".join(lines)
