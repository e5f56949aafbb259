"""MoE on CPU: a training step at EP1 vs EP2, and what a Qwen3-30B-A3B weight sync moves.

step: a small Qwen3-MoE (4 layers, hidden 128, 8 experts of 256, top-2; made by transformers, random) trains
GRPO rollouts of 64 samples x 32-64 tokens; `RolloutTrainer.train_rollout` (forward, backward, AdamW) is
timed at EP1 (one gloo rank, the whole batch) and at EP2 (two ranks, DP 2 for dense weights, EP 2 for
experts, half the batch each; the alltoall dispatcher, slime's: allgather needs equal token counts on every EP
rank), in alternating rounds so machine load hits each layout alike. Prints the median seconds per rollout of each.

sync: builds Qwen3-30B-A3B's Megatron model (configs/models/qwen3_30B_A3B.yaml) on the meta device (no memory),
plans the weight sync exactly as a trainer does (`WeightSender.plan_buckets`, bf16, slime's default
update_weight_buffer_size 512 MiB) and prints the bytes and buckets one sync moves, split into routed experts
and the rest, and what slime's 8-GPU layout (TP 4, EP 8, ETP 1) makes each rank receive while gathering.

    python benchmarks/bench_moe.py step [--rounds 5]
    python benchmarks/bench_moe.py sync
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hpc_rl.training.local_ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
SAMPLES, MIN_TOKENS, MAX_TOKENS = 64, 32, 64
STEP_ARCH = {"family": "qwen3_moe", "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 256,
             "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 32, "vocab_size": 24,
             "rotary_base": 1_000_000.0, "norm_epsilon": 1e-6, "tie_word_embeddings": False, "qk_layernorm": True,
             "max_position_embeddings": 512, "num_moe_experts": 8, "moe_ffn_hidden_size": 256, "moe_router_topk": 2}
LAYOUTS = {"EP1 (1 rank)": (1, "alltoall"), "EP2 alltoall (2 ranks)": (2, "alltoall")}
SYNC_BUFFER_BYTES = 512 * 1024**2


def _batch(seed: int, share: int, rank: int):
    from hpc_rl.training.train_batch import TrainBatch

    rng = random.Random(seed)
    lengths = [rng.randint(MIN_TOKENS, MAX_TOKENS) for _ in range(SAMPLES)]
    responses = [rng.randint(8, n // 2) for n in lengths]
    batch = TrainBatch(tokens=[[rng.randrange(24) for _ in range(n)] for n in lengths], response_lengths=responses,
                       loss_masks=[[1] * r for r in responses], rewards=[rng.gauss(0, 1) for _ in lengths])
    return batch.select(range(rank * share, (rank + 1) * share))


def step_rank(hf_dir: str, dispatcher: str, rollouts: int) -> list[float]:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel

    ranks = int(os.environ["WORLD_SIZE"])
    training = TrainingConfig(global_batch_size=SAMPLES, micro_batch_size=SAMPLES // ranks,
                              expert_model_parallel_size=ranks, moe_token_dispatcher_type=dispatcher)
    info = init_parallel(training)
    arch = ModelArchitecture(**STEP_ARCH)
    parts = build_trainer(arch=arch, training=training, algorithm=AlgorithmConfig(), info=info,
                          optimizer_config=OptimizerConfig(lr=1e-4), checkpoints=CheckpointConfig(hf_checkpoint=hf_dir))
    seconds = []
    for rollout in range(rollouts + 1):
        batch = _batch(rollout, SAMPLES // ranks, info.dp_rank)
        start = time.perf_counter()
        parts.trainer.train_rollout(batch)
        if rollout:  # the first rollout warms up
            seconds.append(time.perf_counter() - start)
    shutdown_parallel()
    return seconds


def bench_step(rounds: int, rollouts: int) -> None:
    from hpc_rl.tiny_model import TinyMoeSpec, make_tiny_moe_model

    with tempfile.TemporaryDirectory() as scratch:
        spec = TinyMoeSpec(hidden_size=128, intermediate_size=256, num_hidden_layers=4, head_dim=32, num_experts=8,
                           moe_intermediate_size=256)
        hf_dir = str(make_tiny_moe_model(Path(scratch) / "moe", spec))
        seconds: dict[str, list[float]] = {label: [] for label in LAYOUTS}
        loads = []
        for _ in range(rounds):
            for label, (ranks, dispatcher) in LAYOUTS.items():
                loads.append(os.getloadavg()[0])
                seconds[label] += run_ranks(step_rank, ranks, hf_dir, dispatcher, rollouts, timeout=1800)[0]
    print(f"load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores; {SAMPLES} samples of "
          f"{MIN_TOKENS}-{MAX_TOKENS} tokens per rollout; median of {rounds} rounds x {rollouts} rollouts")
    first = statistics.median(seconds[next(iter(LAYOUTS))])
    for label, values in seconds.items():
        median = statistics.median(values)
        print(f"  {label:<26} {median * 1e3:8.1f} ms/rollout  x{median / first:.2f}")


def sync_rank(model_file: str) -> dict:
    import torch

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.weights import hf_mapping
    from hpc_rl.weights.sender import WeightSender

    arch = ModelArchitecture.from_yaml(model_file)
    init_parallel(TrainingConfig())
    with torch.device("meta"):  # real Megatron parameter shapes, no memory
        model = build_gpt_model(arch, TrainingConfig(), params_dtype=torch.bfloat16)
    sender = WeightSender(model, arch, tp_group=None, tp_size=1, dp_rank=0, rank=0, bucket_bytes=SYNC_BUFFER_BYTES,
                          dtype=torch.bfloat16)
    plan = sender.plan_buckets()
    params = sender.params
    expert_bytes = sum(p.numel() * 2 for name, p in params.items() if hf_mapping.is_expert_param(name))
    tp_split_bytes = sum(p.numel() * 2 for name, p in params.items()
                         if not hf_mapping.is_expert_param(name) and hf_mapping.tp_split(name).dim is not None)
    expert_tensors = sum(1 for name in params if hf_mapping.is_expert_param(name))
    shutdown_parallel()
    return {"bytes": sum(b.num_bytes for b in plan), "buckets": len(plan),
            "hf_tensors": sum(len(b.names) for b in plan),
            "expert_bytes": expert_bytes, "expert_tensors": expert_tensors, "tp_split_bytes": tp_split_bytes,
            "parameters": sum(p.numel() for p in params.values())}


def bench_sync() -> None:
    model_file = REPO / "configs/models/qwen3_30B_A3B.yaml"
    if not model_file.is_file():
        sys.exit(f"{model_file} is missing (the Qwen3-30B-A3B architecture file)")
    out = run_ranks(sync_rank, 1, str(model_file), timeout=1800)[0]
    gib = 1024**3
    rest = out["bytes"] - out["expert_bytes"]
    print(f"Qwen3-30B-A3B: {out['parameters'] / 1e9:.2f} B parameters; one weight sync (bf16, expert bias float32) "
          f"moves {out['bytes'] / 1e9:.2f} GB ({out['bytes'] / gib:.2f} GiB) as {out['hf_tensors']} HF tensors in "
          f"{out['buckets']} buckets of <= {SYNC_BUFFER_BYTES // 1024**2} MiB")
    print(f"  routed experts: {out['expert_bytes'] / 1e9:.2f} GB in {out['expert_tensors']} Megatron tensors "
          f"(fc1 = gate+up, fc2 = down); the rest: {rest / 1e9:.2f} GB")
    print(f"  slime's 8-GPU layout (TP 4, EP 8, ETP 1), per rank while gathering: experts of the 7 other EP ranks "
          f"{out['expert_bytes'] * 7 / 8 / 1e9:.2f} GB through {out['expert_tensors']} EP broadcasts, dense TP shards "
          f"of the 3 other TP ranks {out['tp_split_bytes'] * 3 / 4 / 1e9:.2f} GB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["step", "sync"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rollouts", type=int, default=3, help="timed rollouts per layout per round")
    args = parser.parse_args()
    if args.what == "step":
        bench_step(args.rounds, args.rollouts)
    else:
        bench_sync()


if __name__ == "__main__":
    main()
