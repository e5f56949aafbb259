"""One run per run dir: a lock file that holds on a shared filesystem, and whether its holder still lives.

Owns `<run_dir>/run.lock`: who holds the run dir (Slurm job id, host, pid and its start time, role, when
taken), its heartbeat (the file's mtime, touched every HEARTBEAT_INTERVAL_S by a thread of the holder:
`os.utime` needs no free block, so a full disk does not stop it), taking it (`acquire`), taking over
from a dead holder or from an earlier attempt of the same Slurm job, releasing it, and judging a
holder alive or dead (`holder_liveness`), which `hpc_rl.status` reads too.

Why not `flock`: on NFS and Lustre it is unreliable or off. The file is created with `link(2)` of a
private temporary file (atomic on NFS, unlike O_EXCL on old clients), and taken over by renaming the
stale file away first (one of two racing takers wins the rename).

A holder is judged, in this order:
  1. it names a Slurm job: Slurm's state decides (PENDING, RUNNING, REQUEUED...: alive; COMPLETED,
     FAILED, CANCELLED...: dead); Slurm not knowing the job falls through;
  2. it ran on this host: its pid is alive with the same start time (a reused pid is not it);
  3. otherwise its heartbeat: alive while younger than STALE_AFTER_S.

A local run removes its lock when it ends; a Slurm job's stays (the job may be requeued and run again:
its next attempt takes it over) and Slurm's state of the job says when it has ended for good.
Not here: what submit, the driver and status print around it (they call `acquire` / `holder_liveness`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
HEARTBEAT_INTERVAL_S = 5.0
"""How often the holder touches the lock file."""
STALE_AFTER_S = 90.0
"""A holder on another host (and unknown to Slurm) is dead once its heartbeat is older than this: 18
missed beats, room for NFS attribute caching (up to 60 s) and clock skew between hosts."""
SLURM_ACTIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                       "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "PREEMPTED")
"""A job in one of these states holds its run dir (PREEMPTED: Slurm requeues it, or is about to end it)."""


class RunDirLocked(RuntimeError):
    """The run dir is held by a live run; the message names it and what to do."""


@dataclass(frozen=True, kw_only=True)
class LockHolder:
    """What the lock file says about who holds the run dir."""

    job_id: str | None
    """Slurm job id (None: a run on this machine without Slurm)."""
    host: str
    pid: int
    pid_start: str | None
    """The pid's start time (/proc/<pid>/stat field 22): a reused pid is not the holder."""
    role: str
    """What took it: "submit" (queueing a Slurm job), "driver" (running the run), "prepare_run"."""
    started_at: float
    heartbeat_at: float = 0.0
    """The file's mtime when read (not stored in the file)."""

    def stop_command(self) -> str:
        """How a user stops this holder: `scancel <job>` for a Slurm job, else `kill <pid>` (on its host)."""
        if self.job_id:
            return f"scancel {self.job_id}"
        here = self.host in ("", socket.gethostname())
        return f"kill {self.pid}" if here else f"kill {self.pid} on {self.host}"

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started_at))
        job = f"Slurm job {self.job_id}, " if self.job_id else ""
        return f"{job}{self.role} pid {self.pid} on {self.host}, since {when}"


@dataclass(frozen=True)
class Liveness:
    alive: bool
    why: str
    """e.g. "Slurm job 12 is RUNNING", "pid 4242 on h1 is gone", "last heartbeat 3 s ago"."""


def lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOCK_FILE


def process_start_time(pid: int) -> str | None:
    """The start time of `pid` on this host (clock ticks since boot), None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name in (...) may hold spaces


def read_lock(run_dir: str | Path) -> LockHolder | None:
    """The holder named by the run dir's lock file; None without one."""
    return _read(lock_path(run_dir))


def _read(path: Path) -> LockHolder | None:
    """A lock file's holder (None if missing). A file that cannot be parsed (cut short by a crash) names an
    unknown holder on no host, judged by its heartbeat."""
    try:
        text = path.read_text()
        mtime = path.stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        data = json.loads(text)
        return LockHolder(job_id=data.get("job_id"), host=str(data["host"]), pid=int(data["pid"]),
                          pid_start=data.get("pid_start"), role=str(data.get("role", "?")),
                          started_at=float(data["started_at"]), heartbeat_at=mtime)
    except (ValueError, KeyError, TypeError):
        return LockHolder(job_id=None, host="?", pid=0, pid_start=None, role="unreadable lock", started_at=mtime,
                          heartbeat_at=mtime)


def slurm_job_state(job_id: str) -> str | None:
    """Slurm's state of the job (its het leader), None when Slurm is absent or knows nothing of it."""
    from hpc_rl.launch.slurm_status import component_states, job_state

    states = component_states(job_id)
    return job_state(states) if states else None


def holder_liveness(holder: LockHolder, *, slurm_state: Callable[[str], str | None] = slurm_job_state,
                    now: float | None = None) -> Liveness:
    """Whether the holder still runs (see the module docstring for the order of the checks)."""
    now = time.time() if now is None else now
    if holder.job_id:
        state = slurm_state(holder.job_id)
        if state:
            base = state.split()[0].upper()
            return Liveness(base in SLURM_ACTIVE_STATES, f"Slurm job {holder.job_id} is {base}")
    if holder.host == socket.gethostname() and holder.pid > 0:
        start = process_start_time(holder.pid)
        if start is not None and (holder.pid_start is None or start == holder.pid_start):
            return Liveness(True, f"pid {holder.pid} on {holder.host} is running")
        return Liveness(False, f"pid {holder.pid} on {holder.host} is gone")
    age = max(0.0, now - holder.heartbeat_at)
    return Liveness(age < STALE_AFTER_S, f"last heartbeat {age:.0f} s ago")


def _this_holder(role: str, job_id: str | None) -> LockHolder:
    pid = os.getpid()
    return LockHolder(job_id=job_id or None, host=socket.gethostname(), pid=pid, pid_start=process_start_time(pid),
                      role=role, started_at=time.time())


def _encode(holder: LockHolder) -> str:
    data: dict[str, Any] = asdict(holder)
    data.pop("heartbeat_at")
    return json.dumps(data) + "\n"


def _same_holder(a: LockHolder, b: LockHolder) -> bool:
    return (a.job_id, a.host, a.pid, a.started_at) == (b.job_id, b.host, b.pid, b.started_at)


def _is_ours(holder: LockHolder, job_id: str | None) -> bool:
    """The holder is this process, or an earlier attempt (or the submitter) of this Slurm job."""
    if job_id and holder.job_id == job_id:
        return True
    return holder.host == socket.gethostname() and holder.pid == os.getpid()


class RunLock:
    """The run dir, held by this process until `release()`; `start_heartbeat()` keeps it fresh."""

    def __init__(self, run_dir: Path, holder: LockHolder) -> None:
        self.run_dir = run_dir
        self.holder = holder
        self.taken_over: tuple[LockHolder, str] | None = None
        """The dead (or same-job) holder this lock replaced, and why it was judged so."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handed_over = False

    @property
    def path(self) -> Path:
        return lock_path(self.run_dir)

    def start_heartbeat(self, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, args=(interval_s,), name="run-lock heartbeat",
                                            daemon=True)
            self._thread.start()

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                os.utime(self.path)
            except OSError as error:  # gone (someone removed it) or the filesystem is away: say so, go on
                log.warning("cannot touch %s: %s", self.path, error)

    def hand_to_job(self, job_id: str) -> None:
        """The Slurm job queued for this run holds the run dir from now on (submit, after sbatch): Slurm's
        state of the job says whether it lives, its driver takes the lock over, `release` leaves it."""
        self.holder = LockHolder(job_id=job_id, host=self.holder.host, pid=self.holder.pid,
                                 pid_start=self.holder.pid_start, role="submit", started_at=self.holder.started_at)
        _replace(self.path, _encode(self.holder))
        self._handed_over = True

    def keep(self) -> None:
        """Leave the lock in place at `release` (a run stopped for a Slurm requeue: the next attempt of
        the same job takes it over; its Slurm state says it lives meanwhile)."""
        self._handed_over = True

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still ours and was not handed on."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._handed_over:
            return
        current = read_lock(self.run_dir)
        if current is not None and _same_holder(current, self.holder):
            self.path.unlink(missing_ok=True)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _create(path: Path, text: str) -> bool:
    """Create `path` holding `text` if it does not exist (atomically, NFS included); False if it exists."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def acquire(run_dir: str | Path, *, role: str, job_id: str | None = None,
            slurm_state: Callable[[str], str | None] = slurm_job_state) -> RunLock:
    """Take the run dir for this process (and Slurm job `job_id`). A dead holder's lock, or one of this
    job's (a requeued attempt, the submitter), is taken over; a live holder's raises RunDirLocked."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = lock_path(run_dir)
    me = _this_holder(role, job_id)
    for _ in range(10):  # a race with another taker: look again
        if _create(path, _encode(me)):
            return RunLock(run_dir, me)
        holder = read_lock(run_dir)
        if holder is None:
            continue
        if _is_ours(holder, job_id):
            lock = RunLock(run_dir, me)
            lock.taken_over = (holder, "an earlier attempt of this job" if job_id else "this process")
            _replace(path, _encode(me))
            return lock
        liveness = holder_liveness(holder, slurm_state=slurm_state)
        if liveness.alive:
            raise RunDirLocked(
                f"{run_dir} is in use by a live run ({holder.describe()}; {liveness.why}). One run per run dir: "
                f"wait for it to end or stop it ({holder.stop_command()}), "
                "or pass another --run-dir")
        stale = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(path, stale)
        except FileNotFoundError:
            continue  # another taker moved it first
        moved = _read(stale)
        if moved is not None and not _same_holder(moved, holder):  # replaced between our read and rename
            try:
                os.link(stale, path)  # put it back (fails if a third taker already created one)
            except FileExistsError:
                pass
            stale.unlink(missing_ok=True)
            continue
        stale.unlink(missing_ok=True)
        if _create(path, _encode(me)):
            lock = RunLock(run_dir, me)
            lock.taken_over = (holder, liveness.why)
            return lock
    raise RunDirLocked(f"{run_dir}: could not take {path} (other processes keep taking it); try again")

