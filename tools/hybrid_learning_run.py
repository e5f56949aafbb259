"""A learning run of a hybrid linear-attention family on this machine (not a timed test): the tiny GRPO recipe with
experts (configs/tiny_moe_cpu.yaml) on a tiny Qwen3.5-MoE (or --family qwen3_next / qwen3_5 with its model file),
served by the CPU engine on its batched state cache; prints reward and the engine/trainer log-prob gap of
the first and last rollouts.

    python tools/hybrid_learning_run.py /tmp/hybrid_run --num-rollout 40 [--family qwen3_5_moe]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="a new folder: the tiny checkpoint and the run go there")
    parser.add_argument("--family", default="qwen3_5_moe", choices=["qwen3_5_moe", "qwen3_next"])
    parser.add_argument("--num-rollout", type=int, default=40)
    parser.add_argument("--lr", type=float, default=None, help="the optimizer's lr (the recipe's: 5e-4)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from hpc_rl.models.registry import family

    hf_dir = family(args.family).make_tiny(args.out / f"tiny_{args.family}")
    run_dir = args.out / "run"
    command = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_moe_cpu.yaml", "--executor", "local",
               "--run-dir", str(run_dir), "--num-rollout", str(args.num_rollout), "--model",
               str(ROOT / "configs" / "models" / f"tiny_{args.family}.yaml"), "--hf-checkpoint", str(hf_dir),
               "--eval-interval", str(args.num_rollout)]
    if args.lr is not None:
        command += ["--lr", str(args.lr)]
    result = subprocess.run(command, cwd=ROOT)
    rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    rewards = [row["metrics"]["rollout/reward_mean"] for row in rows]
    gaps = [row["metrics"]["train/train_rollout_logprob_abs_diff"] for row in rows]
    k = min(5, len(rewards))
    print(f"{args.family}: {len(rows)} rollouts, exit {result.returncode}; reward mean of first {k} "
          f"{sum(rewards[:k]) / k:.3f} -> last {k} {sum(rewards[-k:]) / k:.3f} (first {rewards[0]:.3f}, last "
          f"{rewards[-1]:.3f}); engine/trainer log-prob gap max {max(gaps):.2g}")
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
