"""Trainer throughput on CPU: tokens/s of GRPO steps of a tiny Qwen3 at TP=1, TP=2 (+SP), DP=2, CP=2 and PP=2.

Each layout starts its own gloo ranks (hpc_rl.training.local_ranks), builds actor + reference
model from a tiny HF checkpoint, and trains rollouts of random samples (KL loss on, entropy on).
Reported: median over the measured steps of the step's tokens/s and step time (forward for
ref/old log-probs is outside the step time, as in slime's train-step timer), one intra-op thread
per rank, on a machine shared with other processes: compare layouts within one run.

    python benchmarks/bench_training.py [--samples 32] [--length 64] [--hidden-size 64] [--rollouts 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from hpc_rl.training.local_ranks import run_ranks


def train_rank(hf_dir: str, arch_fields: dict, tp: int, sp: bool, args: argparse.Namespace,
               cp: int = 1, pp: int = 1) -> dict | None:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.training.train_batch import TrainBatch

    training = TrainingConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, context_parallel_size=cp,
                              pipeline_model_parallel_size=pp,
                              global_batch_size=args.samples, micro_batch_size=args.micro_batch_size)
    info = init_parallel(training)
    parts = build_trainer(arch=ModelArchitecture(**arch_fields), training=training,
                          algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.01, entropy_coef=0.001),
                          optimizer_config=OptimizerConfig(lr=1e-4), info=info,
                          checkpoints=CheckpointConfig(hf_checkpoint=hf_dir, ref_load=hf_dir))
    rng = random.Random(info.dp_rank)
    share = args.samples // info.dp_size
    steps, rollout_seconds = [], []
    for rollout in range(args.rollouts + 1):
        lengths = [rng.randint(args.length // 2, args.length) for _ in range(share)]
        batch = TrainBatch(tokens=[[rng.randrange(24) for _ in range(n)] for n in lengths],
                           response_lengths=[n // 2 for n in lengths], loss_masks=[[1] * (n // 2) for n in lengths],
                           rewards=[rng.gauss(0, 1) for _ in lengths])
        start = time.perf_counter()
        metrics = parts.trainer.train_rollout(batch)
        if rollout:  # the first rollout warms up
            steps.extend(metrics)
            rollout_seconds.append(time.perf_counter() - start)
    rank = info.rank
    shutdown_parallel()
    if rank:
        return None
    return {"tokens_per_second": statistics.median(m["tokens_per_second"] for m in steps),
            "step_time": statistics.median(m["step_time"] for m in steps),
            "rollout_time": statistics.median(rollout_seconds), "tokens": steps[0]["tokens_per_second"] * steps[0]["step_time"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32, help="samples per rollout (= global batch)")
    parser.add_argument("--length", type=int, default=64, help="max tokens per sample")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--rollouts", type=int, default=4)
    args = parser.parse_args()

    from hpc_rl.tiny_model import TinyModelSpec, make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size)
        hf_dir = str(make_tiny_model(Path(tmp) / "hf", spec))
        arch = {"family": "qwen3", "num_layers": spec.num_hidden_layers, "hidden_size": spec.hidden_size,
                    "ffn_hidden_size": spec.intermediate_size, "num_attention_heads": spec.num_attention_heads,
                    "num_query_groups": spec.num_key_value_heads, "kv_channels": spec.head_dim, "vocab_size": 24,
                    "rotary_base": spec.rope_theta, "norm_epsilon": spec.rms_norm_eps, "tie_word_embeddings": True,
                    "qk_layernorm": True, "max_position_embeddings": spec.max_position_embeddings}
        print(f"tiny Qwen3 hidden {args.hidden_size}, {args.samples} samples x <= {args.length} tokens per step, "
              f"micro-batch {args.micro_batch_size}, median of {args.rollouts} steps")
        for label, world, tp, sp, *cp_pp in (("TP=1", 1, 1, False), ("TP=2", 2, 2, False),
                                             ("TP=2 +SP", 2, 2, True), ("DP=2", 2, 1, False),
                                             ("CP=2", 2, 1, False, 2), ("PP=2", 2, 1, False, 1, 2)):
            result = run_ranks(train_rank, world, hf_dir, arch, tp, sp, args, *cp_pp, timeout=600)[0]
            print(f"  {label:<9} {result['tokens_per_second']:9.0f} tokens/s  step {result['step_time'] * 1e3:7.1f} ms"
                  f"  rollout (with ref/old log-probs) {result['rollout_time'] * 1e3:7.1f} ms")


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - t0:.1f} s")
