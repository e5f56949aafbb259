"""Benchmark: what the colocated start's extra weight push costs (slime's order: the engines release all their
memory before the trainer builds, then get its weights, v0, before the first rollout).

Runs the tiny colocated config (`configs/tiny_cpu.yaml --colocate`) locally for a few rollouts, then prints, from
the run's own records: the time of the v0 hand-back before the first rollout (`weights v0 given to the colocated
engines before the first rollout (S s)` in controller.log: engines resume their weights, the push, engines resume
their KV cache), the per-rollout colocated after-train step (`time/colocated_after_train`, which holds the same
moves plus the trainer's offloads) and the push alone (`weight_sync/seconds`), and the run's wall time to the end
of the first rollout. Bounded: one run of --rollouts rollouts. Usage:
    python benchmarks/bench_colocated_start_push.py [--rollouts 5] [--extra FLAG ...]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=5)
    parser.add_argument("--extra", nargs="*", default=[], help="more submit flags (e.g. --pipeline-model-parallel-size 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(scratch) / "run"
        argv = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "local", "--run-dir",
                str(run_dir), "--colocate", "--num-rollout", str(args.rollouts), "--eval-interval", "1000", *args.extra]
        began = time.perf_counter()
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - began
        if done.returncode != 0:
            raise SystemExit(f"the run failed:\n{done.stderr[-3000:]}")
        log = (run_dir / "logs" / "controller.log").read_text()
        start = re.search(r"weights v0 given to the colocated engines before the first rollout \(([0-9.]+) s\)", log)
        rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    after = [r["metrics"]["time/colocated_after_train"] for r in rows if "time/colocated_after_train" in r["metrics"]]
    pushes = [r["metrics"]["weight_sync/seconds"] for r in rows if "weight_sync/seconds" in r["metrics"]]
    print(f"tiny colocated run, {args.rollouts} rollouts {' '.join(args.extra)}: wall {wall:.1f} s")
    print(f"  v0 hand-back before the first rollout: {float(start.group(1)) if start else float('nan'):.3f} s")
    print(f"  per-rollout after-train step: median {statistics.median(after):.3f} s (min {min(after):.3f}, "
          f"max {max(after):.3f})")
    print(f"  per-rollout weight push alone: median {statistics.median(pushes):.3f} s")
    print(f"  the extra start push is {float(start.group(1)) / wall * 100 if start else float('nan'):.1f}% of this "
          f"run's wall time")


if __name__ == "__main__":
    main()
