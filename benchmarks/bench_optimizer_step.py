"""Milliseconds of one optimizer step on the tiny model, one CPU rank: Megatron's optimizer as the trainer
builds it (`training.optimizer.ActorOptimizer`) against the floor of a bare fused torch AdamW with the same
clipping.

    python benchmarks/bench_optimizer_step.py [--steps 200] [--model configs/models/tiny_qwen3.yaml]

Rows: Megatron's distributed optimizer over fp32 parameters (the CPU trainer's default), its unsharded
FP32Optimizer, the distributed optimizer over bf16 parameters with fp32 main copies (the GPU's structure), and
`torch.optim.AdamW(fused=True)` stepping on `main_grad` after a foreach-norm clip (what the CPU trainer ran
before issue 29). Each step gets fresh random gradients in the DDP buffers; the time is the median of `--steps`
steps after 10 warm-up steps (CPU time of this process, so a loaded machine moves it less than wall time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _median_ms(step, steps: int) -> float:
    times = []
    for index in range(steps + 10):
        start = time.process_time()
        step()
        if index >= 10:
            times.append((time.process_time() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", default=str(REPO / "configs/models/tiny_qwen3.yaml"))
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import OptimizerConfig, TrainingConfig
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.training.optimizer import ActorOptimizer, wrap_ddp
    from hpc_rl.training.parallel import init_parallel

    training = TrainingConfig(global_batch_size=8, micro_batch_size=8)
    init_parallel(training, device="cpu")
    arch = ModelArchitecture.from_yaml(args.model)
    config = OptimizerConfig(lr=1e-4, clip_grad=1.0)
    generator = torch.Generator().manual_seed(0)

    def fill(params: list[torch.nn.Parameter]) -> None:
        for param in params:
            param.main_grad.copy_(torch.randn(param.shape, generator=generator))

    rows = {}
    cases = (("Megatron distributed optimizer, fp32 params (CPU default)", torch.float32, True),
             ("Megatron FP32Optimizer (unsharded), fp32 params", torch.float32, False),
             ("Megatron distributed optimizer, bf16 params + fp32 main", torch.bfloat16, True))
    for name, dtype, distributed in cases:
        ddp = wrap_ddp(build_gpt_model(arch, training, params_dtype=dtype), distributed_optimizer=distributed)
        optimizer = ActorOptimizer(ddp, config)

        def megatron_step(optimizer: ActorOptimizer = optimizer) -> None:
            fill(optimizer.params)
            optimizer.step()

        rows[name] = _median_ms(megatron_step, args.steps)
    ddp = wrap_ddp(build_gpt_model(arch, training), distributed_optimizer=False)
    params = [p for p in ddp.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                               {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                              lr=config.lr, fused=True)

    def fused_step() -> None:
        fill(params)
        grads = [p.main_grad for p in params]
        norm = float(torch.stack(torch._foreach_norm(grads)).double().square().sum().sqrt())
        scale = config.clip_grad / (norm + 1e-6)
        if scale < 1.0:
            torch._foreach_mul_(grads, scale)
        for param in params:
            param.grad = param.main_grad
        adamw.step()
        ddp.zero_grad_buffer()

    rows["torch fused AdamW on main_grad (the CPU path before issue 29)"] = _median_ms(fused_step, args.steps)
    count = sum(p.numel() for p in params)
    print(f"optimizer step, {arch.num_layers}-layer model, {count} parameters in {len(params)} tensors, "
          f"median of {args.steps} steps (CPU ms of this process):")
    for name, ms in rows.items():
        print(f"  {ms:7.2f} ms  {name}")


if __name__ == "__main__":
    main()
