"""`bound_torchrun --fork-preloaded-ranks` (CPU trainers, issue 23): ranks fork from the launcher after its
`preload()`, get torchrun's environment and their arguments, and die of SIGTERM as spawned ranks do
(torchrun then names the rank and the signal, which the driver's failure message reads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl.config.loading import load_config
from hpc_rl.process.child_process import planned_port
from hpc_rl.launch.bound_torchrun import FORK_FLAG, STORE_ADDRESS_ENV
from hpc_rl.launch.step_plan import trainer_command
from hpc_rl.launch.trainer_exit import root_cause

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE = "tests.integration.forked_rank_probe"


def test_the_driver_forks_preloaded_ranks_on_cpu_only(tmp_path: Path) -> None:
    cpu = load_config([REPO_ROOT / "configs/tiny_cpu.yaml"])
    cuda = load_config([REPO_ROOT / "configs/tiny_cpu.yaml"], ["--set", "cluster.device=cuda"])
    assert FORK_FLAG in trainer_command(cpu, tmp_path, "127.0.0.1:1", local=True)
    assert FORK_FLAG not in trainer_command(cuda, tmp_path, "127.0.0.1:1")


def run_probe(*probe_args: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    argv = [sys.executable, "-m", "hpc_rl.launch.bound_torchrun", FORK_FLAG,
            "--local-addr=127.0.0.1", "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{planned_port()}", "--rdzv-id=probe", "--max-restarts=0",
            "-m", PROBE, *probe_args]
    env = {**os.environ, STORE_ADDRESS_ENV: "127.0.0.1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = done.communicate(timeout=300)
    result = subprocess.CompletedProcess(argv, done.returncode, out, err)
    result.pid = done.pid  # type: ignore[attr-defined]
    return result, [json.loads(line[len("PROBE "):]) for line in out.splitlines() if line.startswith("PROBE ")]


@pytest.mark.slow
def test_ranks_fork_from_the_preloaded_launcher_and_die_of_sigterm(tmp_path: Path) -> None:
    done, probes = run_probe("x", "--flag")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert sorted(p["rank"] for p in probes) == [0, 1]
    launcher = done.pid  # type: ignore[attr-defined]
    for probe in probes:
        assert probe["parent"] == launcher and probe["preloaded_in"] == launcher  # forked after preload()
        # (plain torchrun: parent is the launcher too, but preloaded_in is None: each rank imports itself)
        assert probe["world_size"] == 2 and probe["argv"] == ["x", "--flag"] and probe["sigterm_default"]

    died, probes = run_probe("die", str(tmp_path / "rank0-printed"))  # rank 1 dies once rank 0 has printed
    assert died.returncode != 0 and len(probes) == 2
    failure = root_cause(died.stderr + died.stdout)
    assert failure is not None and (failure.rank, failure.exitcode) == (1, -15), died.stderr[-3000:]
