"""Trainer levers at the tiny run's shape: old log-probs pass, micro-batch layout, micro-batch size.

One gloo rank trains GRPO rollouts (no KL, as configs/tiny_cpu.yaml) of the tiny Qwen3 from
assets/tiny_qwen3, and times `RolloutTrainer.train_rollout` (the trainer's whole share of a step:
old log-probs, advantages, forward/backward, optimizer) for each variant, interleaved rollout by
rollout so machine load hits every variant alike. Shapes: the tiny run's (128 samples of a 7-token
prompt + 1..4 response tokens) and a long, uneven one (16 samples of 16..256 tokens), where
packing should win. Prints the median seconds per rollout and the ratio to the first variant
(the trainer before issue 11's levers: separate old-log-prob pass, packed thd, micro-batch 32).

    python benchmarks/bench_train_layout.py [--rollouts 15]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

from hpc_rl.training.local_ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
# label -> (old log-probs from their own pass, qkv_format, micro_batch_size)
VARIANTS = {
    "before: own old pass, thd, mbs 32": (True, "thd", 32),
    "fused old pass, thd, mbs 32": (False, "thd", 32),
    "fused old pass, bshd, mbs 32": (False, "bshd", 32),
    "fused old pass, auto, mbs 32": (False, "auto", 32),
    "fused old pass, auto, mbs 128": (False, "auto", 128),
}
SHAPES = {  # name -> (samples, min tokens, max tokens, response tokens max)
    "tiny run (128 x 8-11 tokens)": (128, 8, 11, 4),
    "long uneven (16 x 16-256 tokens)": (16, 16, 256, 64),
}


def _batch(rng: random.Random, samples: int, low: int, high: int, response_max: int):
    from hpc_rl.training.train_batch import TrainBatch

    lengths = [rng.randint(low, high) for _ in range(samples)]
    responses = [rng.randint(1, min(response_max, n - 1)) for n in lengths]
    return TrainBatch(tokens=[[rng.randrange(24) for _ in range(n)] for n in lengths], response_lengths=responses,
                      loss_masks=[[1] * r for r in responses], rewards=[rng.gauss(0, 1) for _ in lengths])


def bench_rank(shape: tuple[int, int, int, int], rollouts: int) -> dict[str, list[float]]:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.training.step import RolloutTrainer

    samples = shape[0]
    base = TrainingConfig(global_batch_size=samples)
    info = init_parallel(base)
    arch = ModelArchitecture.from_yaml(REPO / "configs/models/tiny_qwen3.yaml")
    algorithm = AlgorithmConfig(advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28)
    parts = build_trainer(arch=arch, training=base, algorithm=algorithm,
                          optimizer_config=OptimizerConfig(lr=5e-4, clip_grad=1.0, weight_decay=0.0), info=info,
                          checkpoints=CheckpointConfig(hf_checkpoint=str(REPO / "assets/tiny_qwen3")))
    trainers = {label: RolloutTrainer(actor=parts.actor, optimizer=parts.optimizer, ref_model=None, arch=arch,
                                      training=TrainingConfig(global_batch_size=samples, qkv_format=layout,
                                                              micro_batch_size=size),
                                      algorithm=algorithm, info=info, separate_old_logprob_pass=own_pass)
                for label, (own_pass, layout, size) in VARIANTS.items()}
    rng = random.Random(0)
    seconds: dict[str, list[float]] = {label: [] for label in VARIANTS}
    for rollout in range(rollouts + 1):
        batch = _batch(rng, *shape)
        for label, trainer in trainers.items():
            start = time.perf_counter()
            trainer.train_rollout(batch)
            if rollout:  # the first rollout warms up
                seconds[label].append(time.perf_counter() - start)
    shutdown_parallel()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=15)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; median of {args.rollouts} rollouts")
    for name, shape in SHAPES.items():
        seconds = run_ranks(bench_rank, 1, shape, args.rollouts, timeout=1800)[0]
        first = statistics.median(next(iter(seconds.values())))
        print(f"{name}:")
        for label, values in seconds.items():
            median = statistics.median(values)
            print(f"  {label:<36} {median * 1e3:8.1f} ms/rollout  x{median / first:.2f}")


if __name__ == "__main__":
    main()
