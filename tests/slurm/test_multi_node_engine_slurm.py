"""An engine that spans nodes, colocated with a pipeline-parallel trainer, on the local cluster (issue 19: slime's
GLM-4.5 line runs 32-GPU engines over 4 nodes and a PP 4 trainer on the same GPUs).

Two nodes of one GPU each (node9, node10; torchrun numbers node10 first): one CPU engine of TP 2 over both
(SGLang's `--nnodes 2`: one srun step, a task per node, node-rank 0 serving the API, node-rank 1 holding TP rank
1's weights), and trainer ranks at PP 2, one stage per node. Each rank hands its bucket to the engine TP rank on
its own node and GPU (paired by identity), after each stage's parameters reached the other stage; node-rank 1
checks the shares of its TP rank came from its own GPU and that it holds the same weights as node-rank 0, and
the engine serves exactly the trainer's weights after every sync.
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


def test_a_colocated_engine_over_two_nodes_gets_each_nodes_shares_from_a_pp2_trainer(run_dir: Path) -> None:
    num_rollout = 3
    argv = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "slurm", "--run-dir",
            str(run_dir), "--partition", "sortorder", "--colocate", "--actor-num-nodes", "2",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
            "--pipeline-model-parallel-size", "2", "--num-rollout", str(num_rollout), "--eval-interval", "1000",
            "--set", "slurm.gpus_for_cpu_runs=true", "--set", "slurm.time=10", "--wait"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trainers, engines, reports = placement(run_dir)
    assert engines == {0: ["node9/gpu0", "node10/gpu0"]}  # TP rank 0 on node-rank 0's node (Slurm's first)
    follower = json.loads((run_dir / "placement" / "engine-0.node1.json").read_text())
    assert (reports[0]["node"], reports[0]["node_rank"], follower["node"], follower["node_rank"]) == (
        "node9", 0, "node10", 1)
    assert trainers == {0: "node10/gpu0", 1: "node9/gpu0"}  # torchrun's order: stage 0 on node10
    rows = records(run_dir)
    assert [r["rollout_id"] for r in rows] == list(range(num_rollout))
    for row in rows:  # both TP ranks got the whole model from the stage on their node (digests equal)
        assert row["metrics"]["train/first_step_train_rollout_logprob_abs_diff"] < 1e-5, row["metrics"]
    status = json.loads((run_dir / "status.json").read_text())
    assert all(info["restarts"] == 0 for info in status["components"]["engines"].values()), status["engine_events"]
    log = (run_dir / "logs" / "engine-0.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    assert processes_mentioning(str(run_dir)) == []
