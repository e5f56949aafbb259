"""Make the tiny distillation teacher (assets/tiny_qwen3_teacher): the tiny GRPO run, longer, then to HF.

    python tools/make_tiny_teacher.py [--num-rollout 300] [--output assets/tiny_qwen3_teacher]

Runs `configs/tiny_cpu.yaml` (the embedded default: GRPO on "copy the digit", from assets/tiny_qwen3) for
--num-rollout rollouts on this machine, saving at the end, converts the last torch_dist checkpoint to an HF
directory with tools/convert_torch_dist_to_hf.py (tokenizer and config from assets/tiny_qwen3, so teacher
and student share a tokenizer), and writes `teacher_eval.json` beside it: the run's last greedy eval
reward on data/tiny_copy_eval.jsonl, what configs/tiny_opd_cpu.yaml's student distils toward. Seeded, so a
second run on the same machine makes the same teacher up to float and scheduling noise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=300)
    parser.add_argument("--output", default=str(ROOT / "assets" / "tiny_qwen3_teacher"))
    parser.add_argument("--keep-run-dir", default=None, help="run the tiny run here and keep it (default: a temp dir)")
    args = parser.parse_args(argv)
    run_dir = Path(args.keep_run_dir or tempfile.mkdtemp(prefix="tiny_teacher_"))
    subprocess.run([sys.executable, "-m", "hpc_rl.submit", str(ROOT / "configs" / "tiny_cpu.yaml"), "--executor",
                    "local", "--run-dir", str(run_dir), "--num-rollout", str(args.num_rollout),
                    "--eval-interval", str(args.num_rollout), "--save", str(run_dir / "checkpoints")],
                   check=True, cwd=ROOT)
    output = Path(args.output)
    if output.exists():
        shutil.rmtree(output)
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert_torch_dist_to_hf.py"), "--input-dir",
                    str(run_dir / "checkpoints"), "--output-dir", str(output), "--origin-hf-dir",
                    str(ROOT / "assets" / "tiny_qwen3"), "--model", str(ROOT / "configs" / "models" / "tiny_qwen3.yaml")],
                   check=True, cwd=ROOT)
    for path in output.iterdir():
        path.chmod(0o644)  # the converter writes weights owner-only; an asset is for everyone
    last = json.loads((run_dir / "rollouts.jsonl").read_text().strip().splitlines()[-1])["metrics"]
    evaluation = {"num_rollout": args.num_rollout, "eval_data": "data/tiny_copy_eval.jsonl", "temperature": 0.0,
                  "reward_mean": last.get("eval/tiny_copy/reward_mean"),
                  "train_reward_mean_last_rollout": last.get("rollout/reward_mean")}
    (output / "teacher_eval.json").write_text(json.dumps(evaluation, indent=1) + "\n")
    print(json.dumps(evaluation))
    if not args.keep_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
