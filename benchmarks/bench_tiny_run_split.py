"""Where the time of the embedded default goes: a short tiny run, split per rollout step.

Runs `python -m hpc_rl.submit configs/tiny_cpu.yaml --executor local` for N rollouts (real
controller, router, CPU engine, torchrun rank) and prints, from its rollouts.jsonl: start-up time,
per-step medians of generation / train / weight sync / other, samples/s, and the share of the step
spent outside the engines and the trainer (controller, router, batching, protocol). Bounded: ~1 min.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROLLOUTS = 30


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "local",
                                 "--run-dir", str(run_dir), "--num-rollout", str(ROLLOUTS), "--eval-interval", "1000"],
                                cwd=REPO, capture_output=True, text=True, timeout=900)
        total = time.monotonic() - start
        if result.returncode != 0:
            raise SystemExit(result.stdout[-2000:] + result.stderr[-2000:])
        rows = [json.loads(line)["metrics"] for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    steps = [r["time/step"] for r in rows]
    generation = [r["time/rollout"] for r in rows]
    train = [r["time/train"] for r in rows]
    sync = [r.get("time/weight_sync", 0.0) for r in rows]
    other = [s - g - t - w for s, g, t, w in zip(steps, generation, train, sync)]
    samples = 16 * 8
    print(f"tiny run: {ROLLOUTS} rollouts x {samples} samples, wall {total:.1f} s, "
          f"start-up + shutdown {total - sum(steps):.1f} s")
    median = statistics.median
    print(f"per step (median): total {median(steps) * 1000:.0f} ms = generation {median(generation) * 1000:.0f} ms "
          f"+ train {median(train) * 1000:.0f} ms + weight sync {median(sync) * 1000:.0f} ms "
          f"+ other {median(other) * 1000:.0f} ms")
    print(f"throughput: {samples / median(steps):.0f} samples/s end to end, "
          f"{samples / median(generation):.0f} samples/s in generation")
    print(f"share of the step outside generation, training and sync (controller bookkeeping): "
          f"{median(other) / median(steps):.1%}")


if __name__ == "__main__":
    main()
