"""Reliability report: faults injected into real het jobs on the local Slurm cluster, one table row each.

For each fault: the job's exit, rollouts done, samples lost and duplicated (rollouts.jsonl: each
rollout's trained sample indices), seconds from the fault to the next rollout generated, and the
processes of the run still alive after the job ended; for a node's death also how soon the driver
named the node and when Slurm marked it DOWN. Needs a cluster (`tools/local_slurm.sh up`);
each scenario is one job of a few minutes on 2 loaded cores (the same scenarios are asserted by
tests/slurm/test_faults_slurm.py).

    python benchmarks/bench_faults.py [SCENARIO ...]     # default: all
"""

from __future__ import annotations

import shutil
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.slurm.fault_runs import (  # noqa: E402
    TABLE_HEADER,
    FaultOutcome,
    kill_controller,
    kill_engine_node,
    kill_trainer_rank,
)

SCENARIOS: dict[str, Callable[[Path], FaultOutcome]] = {
    "trainer-rank-restart": lambda run_dir: kill_trainer_rank(run_dir, rank=1, max_restarts=1, num_rollout=5),
    "trainer-rank-no-restart": lambda run_dir: kill_trainer_rank(run_dir, rank=0, max_restarts=0, num_rollout=30,
                                                                 after_rollouts=1),
    "controller-requeue": lambda run_dir: kill_controller(run_dir, max_restarts=1, num_rollout=5),
    "controller-no-restart": lambda run_dir: kill_controller(run_dir, max_restarts=0, num_rollout=30,
                                                             after_rollouts=1),
    # a whole node (slurmd + every process on it) of the rollout component dies; the local cluster's
    # SlurmdTimeout is 10 s (tools/local_slurm.sh), a real cluster's is often 300 s
    "engine-node-requeue": lambda run_dir: kill_engine_node(run_dir, max_restarts=1, num_rollout=16),
    "engine-node-no-restart": lambda run_dir: kill_engine_node(run_dir, max_restarts=0, num_rollout=30),
}


def main(names: list[str]) -> None:
    if shutil.which("sinfo") is None:
        raise SystemExit("no Slurm cluster: tools/local_slurm.sh up")
    rows = []
    for name in names or list(SCENARIOS):
        run_dir = REPO / "runs" / "bench-faults" / f"{name}-{uuid.uuid4().hex[:6]}"
        run_dir.mkdir(parents=True)
        outcome = SCENARIOS[name](run_dir)
        rows.append(outcome.row())
        print(outcome.row(), flush=True)
        print(f"    status: {outcome.status.strip().splitlines()[-1] if outcome.status.strip() else '-'}", flush=True)
        if outcome.slurm_down_seconds is not None:
            named = "-" if outcome.detected_seconds is None else f"{outcome.detected_seconds:.1f}"
            print(f"    node {outcome.fault_node}: named by the driver {named} s after the kill; Slurm marked it "
                  f"DOWN after {outcome.slurm_down_seconds:.1f} s", flush=True)
    print()
    print(TABLE_HEADER)
    print("\n".join(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
