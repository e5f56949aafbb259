"""The run dir's lock (`hpc_rl.launch.run_lock`) with real processes as holders: a live one refuses a second
run (naming it), a dead one's lock is taken over, a reused pid is not the holder, Slurm's word beats the pid,
a holder on another host is judged by its heartbeat, racing takers leave exactly one winner, and `status`
says "dead since" with the last log line once the holder is gone."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl import status as status_cli
from hpc_rl.launch.run_lock import (
    LOCK_FILE,
    STALE_AFTER_S,
    RunDirLocked,
    acquire,
    holder_liveness,
    process_start_time,
    read_lock,
)
from tests.unit.waiting import wait_until_blocking


def write_lock(run_dir: Path, *, pid: int, host: str | None = None, job_id: str | None = None,
               pid_start: str | None = "auto", role: str = "driver") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    start = process_start_time(pid) if pid_start == "auto" else pid_start
    (run_dir / LOCK_FILE).write_text(json.dumps({"job_id": job_id, "host": host or socket.gethostname(), "pid": pid,
                                                 "pid_start": start, "role": role, "started_at": time.time()}))


@pytest.fixture
def live_process():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def no_slurm(job_id: str) -> None:
    return None


def test_a_live_holder_refuses_a_second_run_and_a_dead_one_is_taken_over(tmp_path: Path, live_process) -> None:
    run_dir = tmp_path / "run"
    write_lock(run_dir, pid=live_process.pid)
    with pytest.raises(RunDirLocked) as refused:
        acquire(run_dir, role="submit", slurm_state=no_slurm)
    assert f"driver pid {live_process.pid} on {socket.gethostname()}" in str(refused.value)
    assert "is running" in str(refused.value) and "another --run-dir" in str(refused.value)

    live_process.kill()
    live_process.wait()
    lock = acquire(run_dir, role="submit", slurm_state=no_slurm)
    assert lock.taken_over is not None
    assert lock.taken_over[0].pid == live_process.pid and "is gone" in lock.taken_over[1]
    assert read_lock(run_dir).pid == os.getpid()
    lock.release()
    assert not (run_dir / LOCK_FILE).exists()
    assert [p.name for p in run_dir.iterdir()] == []  # no temporary or stale file left


def test_a_reused_pid_is_not_the_holder(tmp_path: Path, live_process) -> None:
    write_lock(tmp_path, pid=live_process.pid, pid_start="1")  # that pid, but started at another time
    liveness = holder_liveness(read_lock(tmp_path), slurm_state=no_slurm)
    assert not liveness.alive and "is gone" in liveness.why


def fake_slurm(states: dict[str, str]):
    """A fake `slurm_job_state` (Slurm's answer per job id) for these unit tests."""
    return lambda job_id: states.get(job_id)


def test_slurm_state_decides_for_a_job_and_the_same_job_takes_over(tmp_path: Path, live_process) -> None:
    write_lock(tmp_path, pid=live_process.pid, job_id="41")
    holder = read_lock(tmp_path)
    assert not holder_liveness(holder, slurm_state=fake_slurm({"41": "CANCELLED by 0"})).alive  # pid alive or not
    assert holder_liveness(holder, slurm_state=fake_slurm({"41": "PENDING"})).alive
    with pytest.raises(RunDirLocked, match="Slurm job 41 is RUNNING"):
        acquire(tmp_path, role="driver", job_id="42", slurm_state=fake_slurm({"41": "RUNNING"}))
    requeued = acquire(tmp_path, role="driver", job_id="41", slurm_state=fake_slurm({"41": "RUNNING"}))
    assert requeued.taken_over is not None and requeued.taken_over[1] == "an earlier attempt of this job"
    requeued.hand_to_job("41")
    requeued.release()
    assert read_lock(tmp_path).job_id == "41"  # handed to the job: release leaves it


def test_a_holder_on_another_host_lives_by_its_heartbeat(tmp_path: Path) -> None:
    write_lock(tmp_path, pid=1, host="elsewhere", pid_start=None)
    assert holder_liveness(read_lock(tmp_path), slurm_state=no_slurm).alive
    old = time.time() - STALE_AFTER_S - 5
    os.utime(tmp_path / LOCK_FILE, (old, old))
    liveness = holder_liveness(read_lock(tmp_path), slurm_state=no_slurm)
    assert not liveness.alive and "last heartbeat" in liveness.why


def test_the_heartbeat_touches_the_lock(tmp_path: Path) -> None:
    lock = acquire(tmp_path, role="driver", slurm_state=no_slurm)
    old = time.time() - 1000
    os.utime(lock.path, (old, old))
    lock.start_heartbeat(interval_s=0.05)
    wait_until_blocking(lambda: lock.path.stat().st_mtime > old + 500, what="the heartbeat's touch")
    assert time.time() - lock.path.stat().st_mtime < 30
    lock.release()


def _race(run_dir: str, results, everyone_looked) -> None:
    try:
        acquire(run_dir, role="submit", slurm_state=no_slurm)
        results.put("won")
        # hold it (alive) until every taker has looked: one that came after the winner's exit would take the
        # lock over, rightly (a fixed hold of 1 s let that happen on a loaded machine)
        everyone_looked.wait(60)
    except RunDirLocked:
        results.put("refused")


def test_racing_takers_leave_exactly_one_winner(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    everyone_looked = context.Event()
    takers = [context.Process(target=_race, args=(str(tmp_path), results, everyone_looked)) for _ in range(4)]
    for taker in takers:
        taker.start()
    try:
        outcomes = sorted(results.get(timeout=60) for _ in takers)
    finally:
        everyone_looked.set()
        for taker in takers:
            taker.join(10)
    assert outcomes == ["refused", "refused", "refused", "won"]


def test_status_says_dead_since_with_the_last_log_line(tmp_path: Path, live_process, capsys) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.resolved.yaml").write_text("{}\n")
    (run_dir / "logs" / "controller.log").write_text("x INFO started\n2026 INFO rollout 7 generated in 0.1 s\n\n")
    (run_dir / "status.json").write_text(json.dumps({"state": "running", "rollout_id": 7, "updated_at": time.time()}))
    write_lock(run_dir, pid=live_process.pid)
    assert status_cli.collect_status(run_dir)["state"] == "running"  # its holder lives

    live_process.kill()
    live_process.wait()
    assert status_cli.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "run: dead since " in out and f"pid {live_process.pid}" in out and "is gone" in out
    assert "last log line: 2026 INFO rollout 7 generated in 0.1 s" in out
    assert json.loads((run_dir / "status.json").read_text())["state"] == "dead"  # corrected on disk too

    (run_dir / LOCK_FILE).unlink()  # no holder at all (a run that ended on a full disk): still dead
    (run_dir / "status.json").write_text(json.dumps({"state": "running", "updated_at": 1.0}))
    got = status_cli.collect_status(run_dir)
    assert got["state"] == "dead" and "status.json was not updated at its end" in got["dead_why"]


def test_a_slurm_run_that_ended_and_said_so_is_not_called_dead(tmp_path: Path) -> None:
    """A Slurm job's lock stays after it ends (a requeue would run it again): its recorded end is the truth."""
    (tmp_path / "status.json").write_text(json.dumps({"state": "finished"}))
    write_lock(tmp_path, pid=1, host="node9", job_id="77", pid_start=None)
    holder = read_lock(tmp_path)
    liveness = holder_liveness(holder, slurm_state=fake_slurm({"77": "COMPLETED"}))
    assert not liveness.alive
    assert status_cli.dead_run(tmp_path, {"state": "finished"}, holder, liveness) is None
    assert status_cli.dead_run(tmp_path, {"state": "running"}, holder, liveness) is not None
