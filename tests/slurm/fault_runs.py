"""Fault scenarios on the local Slurm cluster, measured the same way by the tests and the reliability report.

Each scenario submits the embedded default as a real het job (trainer ranks on 2 virtual nodes, the
CPU engine on a third), injects one fault into a live run, waits for the job to end, and returns a
`FaultOutcome`: samples lost and duplicated (from rollouts.jsonl: every rollout's trained sample
indices), time from the fault to the next completed rollout, the job's exit, and the processes of
the run left behind. `tests/slurm/test_faults_slurm.py` asserts on it; `benchmarks/bench_faults.py`
prints the table.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hpc_rl.controller.fault_hooks import KILL_CONTROLLER_AFTER_SAVE
from tests.integration.run_helpers import processes_mentioning, records, trainer_rank_pids, wait_for

REPO = Path(__file__).resolve().parents[2]


@dataclass
class FaultOutcome:
    fault: str
    exit_code: int
    output: str
    num_rollout: int
    rollout_ids: list[int]
    samples_lost: int
    samples_duplicated: int
    recover_seconds: float | None
    """From the fault to the next rollout completed after it (None: none completed)."""
    left_behind: list[str] = field(default_factory=list)
    status: str = ""
    fault_node: str = ""
    """The virtual node the killed process ran on (SLURMD_NODENAME), when known."""
    detected_seconds: float | None = None
    """Node death: from the kill to the driver's log line naming the lost node."""
    slurm_down_seconds: float | None = None
    """Node death: from the kill to Slurm marking the node DOWN."""

    def row(self) -> str:
        recover = "-" if self.recover_seconds is None else f"{self.recover_seconds:.1f}"
        return (f"| {self.fault} | {self.exit_code} | {len(set(self.rollout_ids))}/{self.num_rollout} | "
                f"{self.samples_lost} | {self.samples_duplicated} | {recover} | {len(self.left_behind)} |")


TABLE_HEADER = ("| fault | exit | rollouts done | samples lost | samples duplicated | recover s | processes left |\n"
                "|---|---|---|---|---|---|---|")


def submit(run_dir: Path, num_rollout: int, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`env`: added to this process's environment (the job gets it: sbatch exports the submitter's)."""
    argv = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "slurm",
            "--run-dir", str(run_dir), "--actor-num-nodes", "2", "--num-rollout", str(num_rollout),
            "--rollout-max-response-len", "24", "--eval-interval", "100000",
            "--save", str(run_dir / "ckpt"), "--save-interval", "1", *flags, "--wait"]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def pids_of(run_dir: Path, marker: str, environ: dict[str, str] | None = None) -> list[int]:
    """Live processes whose command line has the run dir and `marker` (and the given environment)."""
    found = []
    for line in processes_mentioning(str(run_dir)):
        pid_text, _, cmdline = line.partition(": ")
        if marker not in cmdline:
            continue
        pid = int(pid_text)
        if environ:
            try:
                env = dict(item.split("=", 1) for item in
                           Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
            except OSError:
                continue
            if any(env.get(key) != value for key, value in environ.items()):
                continue
        found.append(pid)
    return found


def trainer_rank_pid(run_dir: Path, rank: int) -> int:
    """The trainer rank's own process (torchrun's child, not torchrun or srun), as it registered."""
    pid = trainer_rank_pids(run_dir).get(rank)
    assert pid is not None and Path(f"/proc/{pid}").exists(), f"no live process of trainer rank {rank} ({pid})"
    return pid


def measure(fault: str, run_dir: Path, process: subprocess.Popen[str], num_rollout: int, fault_at: float,
            timeout_s: float = 600) -> FaultOutcome:
    """Wait for the submit process (--wait) to end, then read what the run wrote."""
    try:
        output, _ = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            job_id = run_dir / "slurm_job_id"
            if job_id.exists():
                subprocess.run(["scancel", job_id.read_text().strip()], check=False)
    rows = records(run_dir)
    ids = [r["rollout_id"] for r in rows]
    indices = Counter(i for r in rows for i in r["sample_indices"])
    per_rollout = max((len(r["sample_indices"]) for r in rows), default=0)
    # lost: a rollout missing below one that was recorded, or missing from a run that says it finished
    # (a failed run's rollouts after the failure were not run, not lost: "rollouts done" shows them)
    expected = range(num_rollout) if process.returncode == 0 else range(max(ids, default=-1) + 1)
    missing_rollouts = set(expected) - set(ids)
    recover = _first_rollout_after(run_dir, fault_at)
    deadline = time.monotonic() + 60  # Slurm's KillWait is 5 s: what is still alive after 60 s was left behind
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    try:  # what a user would see (slow to start on a loaded machine: it is reported, not asserted, here)
        status = subprocess.run([sys.executable, "-m", "hpc_rl.status", str(run_dir)], cwd=REPO, capture_output=True,
                                text=True, timeout=300)
        status_text = status.stdout + status.stderr
    except subprocess.TimeoutExpired:
        status_text = "python -m hpc_rl.status did not answer within 300 s"
    return FaultOutcome(fault=fault, exit_code=process.returncode, output=output, num_rollout=num_rollout,
                        rollout_ids=ids, samples_lost=len(missing_rollouts) * per_rollout,
                        samples_duplicated=sum(n - 1 for n in indices.values() if n > 1),
                        recover_seconds=recover, left_behind=processes_mentioning(str(run_dir)),
                        status=status_text)


def _log_time(line: str) -> float | None:
    try:
        return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def _first_rollout_after(run_dir: Path, fault_at: float) -> float | None:
    """Seconds from the fault to the first rollout generated by the attempt that resumed after it
    (controller log: "resuming at rollout", then "rollout N generated"); None if nothing resumed."""
    log = run_dir / "logs" / "controller.log"
    if not log.exists():
        return None
    resumed = False
    for line in log.read_text(errors="replace").splitlines():
        stamp = _log_time(line)
        if stamp is None or stamp <= fault_at:
            continue
        resumed = resumed or "resuming at rollout" in line
        if resumed and " generated in " in line:
            return stamp - fault_at
    return None


def kill_trainer_rank(run_dir: Path, *, rank: int = 1, max_restarts: int = 1, num_rollout: int = 5,
                      after_rollouts: int = 2) -> FaultOutcome:
    """SIGKILL one trainer rank after `after_rollouts` rollouts; the run restarts from its last checkpoint."""
    process = submit(run_dir, num_rollout, "--set", f"controller.max_restarts={max_restarts}")
    wait_for(lambda: len(records(run_dir)) >= after_rollouts or process.poll() is not None, 600,
             f"{after_rollouts} rollouts")
    pid = trainer_rank_pid(run_dir, rank)
    node = node_of(pid)
    fault_at = time.time()
    os.kill(pid, signal.SIGKILL)
    outcome = measure(f"trainer rank {rank} SIGKILL, max_restarts={max_restarts}", run_dir, process, num_rollout,
                      fault_at)
    outcome.fault_node = node
    return outcome


def node_of(pid: int) -> str:
    """The virtual node a job step's process runs on (torchrun may put rank 0 on either trainer node)."""
    for item in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0"):
        if item.startswith("SLURMD_NODENAME="):
            return item.partition("=")[2]
    return ""


def job_state(job_id: str) -> str:
    """'PENDING None', 'RUNNING None', ... of the job's first component ('' once Slurm has forgotten it)."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True, timeout=30)
    return out.stdout.splitlines()[0].strip() if out.stdout.strip() else ""


def let_requeued_job_finish(job_id: str, *, time_limit_minutes: int | None = None) -> None:
    """Once the job is requeued: optionally give it a longer limit, and start it without backfill's delay.

    Slurm 22.05 leaves a requeued het job PENDING (reason None) ~100 s after its BeginTime
    (cred_expire + 1 = 11 s) before backfill looks at it again; an update of its start time makes it
    look at once. A longer limit makes the next allocation's length independent of machine speed.
    """
    wait_for(lambda: job_state(job_id).startswith("PENDING"), 300, "the job to be requeued")
    if time_limit_minutes is not None:
        subprocess.run(["scontrol", "update", f"jobid={job_id}", f"timelimit={time_limit_minutes}"], check=True,
                       timeout=30)
    start_pending_job(job_id)


def job_begin_time(job_id: str) -> datetime.datetime | None:
    """When the job's first component may start (`scontrol show job`'s EligibleTime: its begin time;
    None when Slurm gives none)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    for field_ in out.stdout.split():
        name, _, value = field_.partition("=")
        if name == "EligibleTime" and value[:1].isdigit():
            return datetime.datetime.fromisoformat(value)
    return None


def start_pending_job(job_id: str) -> None:
    """A requeued job that is (or was) pending: start it once its begin time has passed, without backfill's delay.

    The begin time is read, not only the pending reason: right after a requeue the reason can still say
    None while BeginTime is 11 s ahead (the old attempt's credential expiry); a start forced before it
    is killed by slurmd ("Job credential revoked", seen once the run's shutdown got fast)."""
    wait_for(lambda: job_state(job_id) != "PENDING BeginTime", 60, "the requeued job's begin time")
    begin = job_begin_time(job_id)
    if begin is not None:
        wait_for(lambda: datetime.datetime.now() >= begin + datetime.timedelta(seconds=1), 60,
                 "the requeued job's begin time to pass")
    deadline = time.monotonic() + 60
    while job_state(job_id).startswith("PENDING") and time.monotonic() < deadline:
        subprocess.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"], check=False, timeout=30,
                       capture_output=True)
        time.sleep(3)


def driver_pid(run_dir: Path) -> int:
    """The driver (submitit's _submit running HetJobDriver: the controller is in it), not the batch guard."""
    pids = [pid for pid in pids_of(run_dir, "-m submitit.core._submit")
            if "batch_guard" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
    assert len(pids) == 1, f"expected one driver process, found {pids}"
    return pids[0]


def kill_controller(run_dir: Path, *, max_restarts: int = 1, num_rollout: int = 5,
                    after_rollouts: int = 2) -> FaultOutcome:
    """SIGKILL the driver (the controller's process) in the riskiest window of rollout `after_rollouts`: its
    checkpoint committed, its record not yet written (the controller's fault hook kills itself there, once: the
    window is hit every time, not by luck); the batch guard requeues the job (max_restarts > 0), which resumes
    from that checkpoint and must write the record the killed attempt could not (issue 37, case 7)."""
    marker = run_dir / "fault-controller-killed"
    process = submit(run_dir, num_rollout, "--set", f"controller.max_restarts={max_restarts}",
                     env={KILL_CONTROLLER_AFTER_SAVE: f"{after_rollouts}:{marker}"})
    wait_for(lambda: marker.exists() or process.poll() is not None, 600, f"the kill after rollout {after_rollouts}'s save")
    fault_at = marker.stat().st_mtime if marker.exists() else time.time()
    assert [r["rollout_id"] for r in records(run_dir)] == list(range(after_rollouts)), "killed before the record"
    if max_restarts:
        let_requeued_job_finish((run_dir / "slurm_job_id").read_text().strip())
    return measure(f"controller (driver) SIGKILL, max_restarts={max_restarts}", run_dir, process, num_rollout,
                   fault_at)


SLURM_STATE = Path(os.environ.get("HPC_RL_SLURM_STATE", "/var/lib/hpc-rl-slurm"))
"""tools/local_slurm.sh's state directory: slurmd pid files (run/slurmd-<node>.pid), spool (spool/<node>/)."""


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


OLD_STEP_KILL_RETRY_S = 70.0
"""Slurm 22.05 re-sends a kill that a non-responding node missed ~60 s later, by job and step id; a
requeued job reuses both, so its attempt must not start steps on that node before (see kill_engine_node)."""


def node_processes(node: str) -> list[int]:
    """Every process of a virtual node of the local cluster: its slurmd, the slurmstepd of each step on it
    (found by their sockets in the node's spool directory), every process with SLURMD_NODENAME=<node>,
    and all their descendants."""
    spool = f"{SLURM_STATE / 'spool' / node}/"
    sockets = {f"socket:[{parts[6]}]" for parts in (line.split() for line in
               Path("/proc/net/unix").read_text().splitlines()[1:]) if len(parts) >= 8 and parts[7].startswith(spool)}
    pids: set[int] = set()
    pid_file = SLURM_STATE / "run" / f"slurmd-{node}.pid"
    if pid_file.exists():
        pids.add(int(pid_file.read_text().strip()))
    everyone = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
    for pid in everyone:
        try:
            if f"SLURMD_NODENAME={node}\0".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                pids.add(pid)
            elif any(os.readlink(f"/proc/{pid}/fd/{fd}") in sockets for fd in os.listdir(f"/proc/{pid}/fd")):
                pids.add(pid)
        except OSError:
            continue
    grown = True
    while grown:
        children = {pid for pid in everyone if pid not in pids and _parent(pid) in pids}
        pids |= children
        grown = bool(children)
    return sorted(pids)


def kill_node(node: str) -> list[int]:
    """A node dies: stop every process of it at once (SIGSTOP, so none reacts to another's death), then
    SIGKILL them. Slurm notices only when its pings go unanswered (SlurmdTimeout in tools/local_slurm.sh)."""
    pids = node_processes(node)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    return pids


def only_job_on(node: str, job_id: str) -> bool:
    """Slurm runs nothing on `node` but (a component of) job `job_id`."""
    out = subprocess.run(["squeue", "-h", "-w", node, "-o", "%i"], capture_output=True, text=True, timeout=30)
    return all(line.strip().split("+")[0] == job_id for line in out.stdout.splitlines() if line.strip())


def node_state(node: str) -> str:
    """Slurm's full state of a node, lower case, e.g. 'down+completing+not_responding' (sinfo shows one word)."""
    out = subprocess.run(["scontrol", "show", "node", node, "-o"], capture_output=True, text=True, timeout=30)
    states = [word.partition("=")[2] for word in out.stdout.split() if word.startswith("State=")]
    return states[0].lower() if states else ""


def bring_node_back(node: str) -> None:
    """The node is repaired: `tools/local_slurm.sh up` starts its slurmd again (ReturnToService=2 makes it
    usable once it registers; the script waits until every node is idle or busy)."""
    subprocess.run(["bash", str(REPO / "tools" / "local_slurm.sh"), "up"], check=True, capture_output=True,
                   timeout=120)


def engine_node(run_dir: Path) -> tuple[int, str]:
    """The pid and virtual node of engine 0's process (found by the port it registered with)."""
    import re

    log = (run_dir / "logs" / "controller.log").read_text(errors="replace")
    port = re.findall(r"engine 0 registered at http://[^:]+:(\d+)", log)[-1]
    pids = [int(line.partition(": ")[0]) for line in processes_mentioning(f"--port {port}")
            if "hpc_rl.engines" in line and not line.partition(": ")[2].startswith("srun")]
    pids = [pid for pid in pids if node_of(pid)]
    assert len(pids) == 1, f"expected one engine process on port {port}, found {pids}"
    return pids[0], node_of(pids[0])


def kill_engine_node(run_dir: Path, *, max_restarts: int = 1, num_rollout: int = 16,
                     after_rollouts: int = 2) -> FaultOutcome:
    """The node running engine 0 (the rollout component's node) dies after `after_rollouts` rollouts:
    the driver names the node once Slurm finds it not answering, and requeues the job (max_restarts > 0;
    else the run fails); the node is brought back and the job resumes from its last checkpoint.
    `fault_node` is the node killed; `detected_seconds` when the driver named it."""
    process = submit(run_dir, num_rollout, "--set", f"controller.max_restarts={max_restarts}")
    try:
        wait_for(lambda: len(records(run_dir)) >= after_rollouts or process.poll() is not None, 600,
                 f"{after_rollouts} rollouts")
        _, node = engine_node(run_dir)
        job_id = (run_dir / "slurm_job_id").read_text().strip()
        wait_for(lambda: only_job_on(node, job_id), 600, f"{node} to run no other job (their steps would die too)")
        fault_at = time.time()
        assert kill_node(node), f"no process of {node} found"
        try:
            wait_for(lambda: "down" in node_state(node).split("+"), 120, f"Slurm to mark {node} DOWN")
            down_at = time.time()
            if max_restarts:
                wait_for(lambda: job_state(job_id).startswith("PENDING"), 120, "the job to be requeued")
                requeued_at = time.monotonic()
                # slurmctld re-sends the kill of the old attempt's steps that the dead node missed ~60 s
                # later, by job and step id; the requeued attempt reuses both: held until then, it does not
                # start a step on the returned node that this late kill would hit
                subprocess.run(["scontrol", "hold", job_id], check=True, capture_output=True, timeout=30)
        finally:
            bring_node_back(node)
    except BaseException:
        _cancel(run_dir, process)
        raise
    if max_restarts:
        time.sleep(max(0.0, requeued_at + OLD_STEP_KILL_RETRY_S - time.monotonic()))
        subprocess.run(["scontrol", "release", job_id], check=True, capture_output=True, timeout=30)
        start_pending_job(job_id)
    outcome = measure(f"node of engine 0 dies ({node}), max_restarts={max_restarts}", run_dir, process,
                      num_rollout, fault_at)
    outcome.fault_node = node
    outcome.slurm_down_seconds = down_at - fault_at
    outcome.detected_seconds = _first_log_after(run_dir, fault_at, f"node {node} is lost")
    return outcome


def _cancel(run_dir: Path, process: subprocess.Popen[str]) -> None:
    """A scenario that failed half-way: cancel its job, stop its submit process."""
    job_id = run_dir / "slurm_job_id"
    if job_id.exists():
        subprocess.run(["scancel", job_id.read_text().strip()], check=False, timeout=30)
    if process.poll() is None:
        process.kill()


def _first_log_after(run_dir: Path, fault_at: float, text: str) -> float | None:
    """Seconds from the fault to the first controller.log line containing `text` (None: none)."""
    log = run_dir / "logs" / "controller.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        stamp = _log_time(line)
        if stamp is not None and stamp > fault_at and text in line:
            return stamp - fault_at
    return None


def planned_ports(job_id: str) -> list[int]:
    """The controller, router and engine-0 ports the driver of `job_id` plans (before replacing busy ones)."""
    from hpc_rl.launch.ports import JOB_PORT_SLOTS
    from hpc_rl.launch.topology import DEFAULT_BASE_PORT

    base = DEFAULT_BASE_PORT + (int(job_id) % JOB_PORT_SLOTS) * 50
    return [base, base + 1, base + 10]


def two_jobs_and_a_port_squatter(run_dir: Path, *, num_rollout: int = 4) -> list[FaultOutcome]:
    """Two jobs on the same nodes at once, with a squatter listening on ports each one plans to use.

    Both are submitted held back (--begin=now+300), the squatter binds their planned ports, then both
    are released together (the test does not race the jobs' start-up)."""
    run_dirs = [run_dir / "job-a", run_dir / "job-b"]
    processes = []
    for path in run_dirs:
        path.mkdir()
        processes.append(submit(path, num_rollout, "--set", 'slurm.extra_sbatch=["--begin=now+300"]'))
    wait_for(lambda: all((p / "slurm_job_id").exists() for p in run_dirs), 120, "both submissions")
    job_ids = [(p / "slurm_job_id").read_text().strip() for p in run_dirs]
    squatters = []
    try:
        for port in [port for job_id in job_ids for port in planned_ports(job_id)]:
            squatter = socket.socket()
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            squatters.append(squatter)
        fault_at = time.time()
        for job_id in job_ids:
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"], check=True, timeout=30)
        wait_for(lambda: all(job_state(j).startswith("RUNNING") for j in job_ids), 180, "both jobs running at once")
        return [measure(f"two jobs at once + port squatter ({path.name})", path, process, num_rollout, fault_at)
                for path, process in zip(run_dirs, processes)]
    finally:
        for squatter in squatters:
            squatter.close()
        for process in processes:
            if process.poll() is None:
                process.kill()
