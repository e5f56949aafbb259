"""Helpers for tests that run whole local runs: start `python -m hpc_rl.submit`, read what a run wrote."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpc_rl.status import StatusUnavailable, live_status

REPO_ROOT = Path(__file__).resolve().parents[2]


def submit_argv(run_dir: Path, *flags: str, config: str = "configs/tiny_cpu.yaml") -> list[str]:
    return [sys.executable, "-m", "hpc_rl.submit", config, "--executor", "local", "--run-dir", str(run_dir), *flags]


def start_run(run_dir: Path, *flags: str) -> subprocess.Popen[str]:
    """A local run in the background (its own session, so the test can signal it like a terminal would)."""
    log = open(run_dir.parent / f"{run_dir.name}.out", "w")
    return subprocess.Popen(submit_argv(run_dir, *flags), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def run_to_end(run_dir: Path, *flags: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(submit_argv(run_dir, *flags), cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


def records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's rollout records so far. A line is one write(2) (`run_files.append_line`), but a reader can meet one
    half copied (the kernel extends the file page by page): a last line without its newline is not a record yet."""
    path = run_dir / "rollouts.jsonl"
    if not path.is_file():
        return []
    lines = path.read_text().split("\n")[:-1]  # what follows the last newline is a line still being written
    return [json.loads(line) for line in lines if line.strip()]


# Rollouts of the short runs that check a mode or a model family serves the trainer's weights: each sync's
# log-prob equality shows from the first rollout on. Learning (reward +0.3 over 100 rollouts) is shown once, by
# test_run_local.py::test_tiny_default_run_learns; SFT, OPD and PPO show theirs in test_training_modes_runs.py.
SHORT_RUN_ROLLOUTS = 3


def run_tiny_recipe_in_sync(run_dir: Path, config: str, *flags: str, num_rollout: int = SHORT_RUN_ROLLOUTS,
                            max_logprob_abs_diff: float = 1e-4) -> list[dict[str, Any]]:
    """Run a tiny recipe for `num_rollout` rollouts; check the engine's log-probs equal the trainer's after every
    sync (< 1e-4, float32 both sides; FP8 engines: their own bound) and weight versions 1, 2, ...; return its
    rollout records."""
    result = subprocess.run(submit_argv(run_dir, "--num-rollout", str(num_rollout), *flags, config=config),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == list(range(num_rollout))
    for version, row in enumerate(rows, start=1):
        metrics = row["metrics"]
        assert metrics["train/train_rollout_logprob_abs_diff"] < max_logprob_abs_diff, (row["rollout_id"], metrics)
        assert metrics["rollout/weight_version"] == float(version)
    return rows


def placement(run_dir: Path) -> tuple[dict[int, str], dict[int, list[str]], dict[int, dict[str, Any]]]:
    """Where a run's processes were: trainer rank -> GPU and engine -> its TP ranks' GPUs, as the controller
    registered them (`<node>/gpu<id>`), and each engine step's own report of what it was given."""
    folder = run_dir / "placement"
    trainers = {int(rank): device for rank, device in json.loads((folder / "trainers.json").read_text()).items()}
    components = json.loads((run_dir / "status.json").read_text())["components"]
    engines = {int(index): info["devices"] for index, info in components["engines"].items()}
    reports = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in folder.glob("engine-*.json")
               if ".node" not in p.stem}  # node-rank 0's (a multi-node engine's others: engine-<i>.node<k>.json)
    return trainers, engines, reports


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (e.g. a run dir or a port)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def interrupt(process: subprocess.Popen[str], timeout_s: float = 60) -> int:
    """Ctrl-C the run (SIGINT to its process group) and wait for it to finish shutting down."""
    os.killpg(process.pid, signal.SIGINT)
    return process.wait(timeout_s)


def engine_pids(run_dir: Path, count: int = 2, timeout_s: float = 60.0) -> dict[int, int]:
    """Engine index -> pid, once status.json (which can lag the first rollout record) lists `count` engines
    and each has a live process."""
    deadline = time.monotonic() + timeout_s
    while len(pids := engine_pids_now(run_dir)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine processes after {timeout_s} s: {pids}")
        time.sleep(0.2)
    return pids


def engine_pids_now(run_dir: Path) -> dict[int, int]:
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    engines = status.get("components", {}).get("engines", {})
    ports = {int(i): int(e["url"].rsplit(":", 1)[1]) for i, e in engines.items() if e.get("url")}
    pids = {}
    for line in processes_mentioning("hpc_rl.engines.cpu"):
        pid, cmd = line.split(":", 1)
        for index, port in ports.items():
            if f"--port {port} " in cmd + " ":
                pids[index] = int(pid)
    return pids


_RANK_REGISTERED = re.compile(r"trainer rank (\d+)/\d+ \(host \S+ pid (\d+)\)")


def trainer_rank_pids(run_dir: Path) -> dict[int, int]:
    """Each trainer rank's process id, as the rank itself told the controller (controller.log; the latest
    registration of each rank). Works however the ranks were started: a rank forked from a preloaded
    torchrun (CPU) has torchrun's command line and environment, not `-m hpc_rl.training` and RANK."""
    log = run_dir / "logs" / "controller.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    return {int(rank): int(pid) for rank, pid in _RANK_REGISTERED.findall(text)}


def processes_of_run(run_dir: Path) -> list[str]:
    """Live processes of a run: those naming its run dir on their command line, and those started with it in
    their environment (`HPC_RL_RUN_DIR`: torchrun's agent, its ranks and every process they start, such as
    the multiprocessing helpers of Megatron's checkpoint writer, whose command lines name nothing)."""
    marker = f"HPC_RL_RUN_DIR={run_dir}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (str(run_dir).encode() in cmdline or marker in environ):
            shown = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
            found.append(f"{pid}: {shown}")
    return found


def live(run_dir: Path) -> dict:
    """The controller's live status; {} while it has none to say (no address yet, or a status call that timed out
    on a loaded machine: StatusUnavailable)."""
    try:
        return live_status(run_dir) or {}
    except StatusUnavailable:
        return {}


def controller_version(run_dir: Path) -> int:
    """The controller's weight version now (live: status.json is written every 2 s, several rollouts here)."""
    deadline = time.monotonic() + 60
    while "weight_version" not in (status := live(run_dir)):
        assert time.monotonic() < deadline, "the controller gave no live status for 60 s"
        time.sleep(0.2)
    return int(status["weight_version"])


@contextmanager
def held(gate: Path | None) -> Iterator[None]:
    """Inside, the CPU engines started with `faults.HOLD_GENERATION` naming `gate` decode nothing: their running
    requests keep their rows and tokens until the block ends. None (an engine without a gate: real SGLang): a no-op."""
    if gate is None:
        yield
        return
    gate.touch()
    try:
        yield
    finally:
        gate.unlink()
