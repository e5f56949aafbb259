"""FP8 rollouts: what a Qwen3-30B-A3B weight sync moves in FP8 against bf16, and the tiny run's FP8 log-prob
mismatch with and without TIS.

bytes: builds Qwen3-30B-A3B's Megatron model (configs/models/qwen3_30B_A3B.yaml) on the meta device (no memory)
and plans its weight sync exactly as a trainer does (`WeightSender.plan_buckets`, slime's default
update_weight_buffer_size 512 MiB) twice: bf16 (today's sync), and as its FP8 release (Qwen3-30B-A3B-FP8:
quantization_config fp8/e4m3/dynamic, 128x128 blocks) makes it, each linear weight e4m3 + float32
weight_scale_inv, experts included; norms, embeddings, lm_head and router gates stay bf16, the expert bias
float32. Prints the bytes of each, split into routed experts and the rest.

mismatch: the tiny run (configs/tiny_cpu.yaml) with an FP8 engine checkpoint (the tiny Qwen3 in 48x48 blocks,
`hpc_rl.weights.fp8_checkpoint`), N rollouts each without and with TIS (and, as the floor, the bf16 engine
checkpoint); prints train_rollout_logprob_abs_diff (mean |trainer - rollout| per token right after each sync)
and the reward, per rollout and averaged.

    python benchmarks/bench_fp8_sync.py bytes
    python benchmarks/bench_fp8_sync.py mismatch [--rollouts 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hpc_rl.training.local_ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
SYNC_BUFFER_BYTES = 512 * 1024**2


def plan_rank(model_file: str) -> dict:
    import torch

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.config.fp8_scheme import Fp8Blocks
    from hpc_rl.weights.fp8_blocks import FP8_DTYPE
    from hpc_rl.weights.sender import WeightSender

    arch = ModelArchitecture.from_yaml(model_file)
    init_parallel(TrainingConfig())
    with torch.device("meta"):  # real Megatron parameter shapes, no memory
        model = build_gpt_model(arch, TrainingConfig(), params_dtype=torch.bfloat16)
    out = {}
    for label, fp8 in (("bf16", None), ("fp8", Fp8Blocks(block=(128, 128)))):
        sender = WeightSender(model, arch, tp_group=None, tp_size=1, dp_rank=0, rank=0,
                              bucket_bytes=SYNC_BUFFER_BYTES, dtype=torch.bfloat16, fp8=fp8)
        plan = sender.plan_buckets()
        rows = [(name, dtype, shape) for bucket in plan for name, dtype, shape in
                zip(bucket.names, bucket.dtypes, bucket.shapes)]
        itemsize = {"bfloat16": 2, "float32": 4, str(FP8_DTYPE).removeprefix("torch."): 1}

        def size(row: tuple) -> int:
            count = 1
            for dim in row[2]:
                count *= dim
            return count * itemsize[row[1]]

        out[label] = {"bytes": sum(b.num_bytes for b in plan), "buckets": len(plan), "tensors": len(rows),
                      "experts": sum(size(r) for r in rows if ".mlp.experts." in r[0]),
                      "scales": sum(size(r) for r in rows if r[0].endswith("_scale_inv")),
                      "quantized": sum(1 for r in rows if r[1].startswith("float8"))}
    shutdown_parallel()
    return out


def bench_bytes() -> None:
    model_file = REPO / "configs/models/qwen3_30B_A3B.yaml"
    out = run_ranks(plan_rank, 1, str(model_file), timeout=1800)[0]
    bf16, fp8 = out["bf16"], out["fp8"]
    print(f"Qwen3-30B-A3B, one weight sync (buckets of <= {SYNC_BUFFER_BYTES // 1024**2} MiB):")
    for label, row in (("bf16", bf16), ("FP8 128x128", fp8)):
        print(f"  {label:<12} {row['bytes'] / 1e9:7.2f} GB ({row['bytes'] / 1024**3:.2f} GiB) in {row['buckets']} "
              f"buckets, {row['tensors']} HF tensors; routed experts {row['experts'] / 1e9:.2f} GB, the rest "
              f"{(row['bytes'] - row['experts']) / 1e9:.2f} GB")
    print(f"  FP8: {fp8['quantized']} e4m3 weights + as many float32 weight_scale_inv ({fp8['scales'] / 1e6:.1f} MB);"
          f" {fp8['bytes'] / bf16['bytes']:.3f} of bf16's bytes ({(bf16['bytes'] - fp8['bytes']) / 1e9:.2f} GB less)")


def _run(run_dir: Path, checkpoint: str, rollouts: int, *flags: str) -> list[dict]:
    argv = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "local", "--run-dir",
            str(run_dir), "--num-rollout", str(rollouts), "--hf-checkpoint", checkpoint,
            "--eval-interval", str(rollouts), *flags]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if result.returncode:
        sys.exit(result.stdout[-2000:] + result.stderr[-2000:])
    return [json.loads(line)["metrics"] for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]


def bench_mismatch(rollouts: int) -> None:
    from hpc_rl.config.fp8_scheme import Fp8Blocks
    from hpc_rl.weights.fp8_checkpoint import write_fp8_checkpoint

    gap, reward = "train/train_rollout_logprob_abs_diff", "rollout/reward_mean"
    with tempfile.TemporaryDirectory() as tmp:
        fp8 = write_fp8_checkpoint(REPO / "assets/tiny_qwen3", Path(tmp) / "fp8", Fp8Blocks(block=(48, 48)))
        runs = {"bf16 engines": (str(REPO / "assets/tiny_qwen3"), ()), "FP8 engines, no TIS": (str(fp8), ()),
                "FP8 engines, TIS": (str(fp8), ("--use-tis",))}
        print(f"tiny run (configs/tiny_cpu.yaml), {rollouts} rollouts each; {gap} after each sync "
              "(rollout 0 precedes any sync), reward:")
        for label, (checkpoint, flags) in runs.items():
            rows = _run(Path(tmp) / label.replace(" ", "_").replace(",", ""), checkpoint, rollouts, *flags)
            gaps = [row[gap] for row in rows[1:]]
            rewards = [row[reward] for row in rows]
            tenth = max(1, rollouts // 10)
            print(f"  {label:<20} gap mean {statistics.mean(gaps):.2e} median {statistics.median(gaps):.2e} "
                  f"max {max(gaps):.2e}; reward first {tenth} {statistics.mean(rewards[:tenth]):.3f} -> last "
                  f"{tenth} {statistics.mean(rewards[-tenth:]):.3f}")
            print("    gaps " + " ".join(f"{g:.1e}" for g in gaps))
            print("    rewards " + " ".join(f"{r:.2f}" for r in rewards))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["bytes", "mismatch"])
    parser.add_argument("--rollouts", type=int, default=30)
    args = parser.parse_args()
    if args.what == "bytes":
        bench_bytes()
    else:
        bench_mismatch(args.rollouts)


if __name__ == "__main__":
    main()
