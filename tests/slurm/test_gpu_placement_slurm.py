"""Slurm places the GPUs (issue 22 items 1-2), on the local cluster's fake GPUs (GRES `gpu` with device
files, so Slurm itself sets SLURM_STEP_GPUS / CUDA_VISIBLE_DEVICES in every step that asks for GPUs).

Colocated across two nodes named node9 and node10 (partition `sortorder`): torchrun numbers nodes by
their sorted names (node10 first), Slurm lists node9 first, so trainer rank 0 and engine 0 are on different
nodes. Rank arithmetic sent rank 0's weights to node9's engine, which refuses a share from a GPU it cannot
see and dies (SGLang's `Invalid device_uuid`); paired by device identity every update reaches the engine
on the sender's own node and GPU, and the engines serve exactly the trainer's weights after each sync.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.run_helpers import placement, processes_mentioning, records

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]


def test_colocated_across_nodes_named_out_of_sorted_order_pairs_ranks_with_the_engine_on_their_gpu(run_dir: Path) -> None:
    num_rollout = 4
    argv = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "slurm", "--run-dir",
            str(run_dir), "--partition", "sortorder", "--colocate", "--actor-num-nodes", "2",
            "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "4", "--num-rollout", str(num_rollout),
            "--eval-interval", "1000", "--set", "slurm.gpus_for_cpu_runs=true", "--set", "slurm.time=10", "--wait"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trainers, engines, reports = placement(run_dir)
    # Slurm's order: engines 0, 1 on node9 (its first node), on GPUs 0 and 1 of the two it gave each step
    assert engines == {0: ["node9/gpu0"], 1: ["node9/gpu1"], 2: ["node10/gpu0"], 3: ["node10/gpu1"]}
    assert [(r["node"], r["step_gpus"], r["base_gpu_id"]) for _, r in sorted(reports.items())] == [
        ("node9", ["0", "1"], 0), ("node9", ["0", "1"], 1), ("node10", ["0", "1"], 0), ("node10", ["0", "1"], 1)]
    # torchrun's order: rank 0 on node10 (sorted names), each rank on the GPU at its LOCAL_RANK
    assert trainers == {0: "node10/gpu0", 1: "node10/gpu1", 2: "node9/gpu0", 3: "node9/gpu1"}
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == list(range(num_rollout))
    for row in rows:  # every update reached its engine: each serves exactly the trainer's weights
        assert row["metrics"]["train/first_step_train_rollout_logprob_abs_diff"] < 1e-5, row["metrics"]
    status = json.loads((run_dir / "status.json").read_text())
    assert all(info["restarts"] == 0 for info in status["components"]["engines"].values()), status["engine_events"]
    assert processes_mentioning(str(run_dir)) == []
