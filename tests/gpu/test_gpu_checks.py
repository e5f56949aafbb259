"""Every GPU-only path of hpc_rl on this node's GPUs (issue 22 item 7). Without CUDA each test skips with its
reason; `bash tools/run_tests.sh gpu` prints what ran and what did not.

    Transformer Engine layer spec   == Megatron's local spec == transformers, on the tiny checkpoint
    optimizer.py                    Megatron's distributed optimizer steps a bf16 model
    bf16 export                     the weight export the engines receive, in their dtype
    NCCL weight-update group        2 GPUs: trainer rank 0 broadcasts to an engine rank; wait() returns at once
    colocated tiny run on SGLang    CUDA IPC /update_weights_from_tensor, memory saver release/resume, trainer
                                    offload/onload, engine log-probs equal the trainer's after every sync
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.gpu.conftest import need

REPO = Path(__file__).resolve().parents[2]


def in_ranks(name: str, world_size: int = 1, *args: object) -> list[dict]:
    from hpc_rl.training.local_ranks import run_ranks
    from tests.gpu import rank_checks

    return run_ranks(getattr(rank_checks, name), world_size, *args, timeout=600)


def test_transformer_engine_spec_equals_the_local_spec_and_transformers() -> None:
    need(modules=("transformer_engine", "megatron.core"))
    result = in_ranks("te_local_and_transformers_log_probs")[0]
    assert result["te_vs_local"] < 1e-3, result
    assert result["te_vs_transformers"] < 1e-3, result


def test_the_megatron_distributed_optimizer_trains_a_bf16_model() -> None:
    need(modules=("transformer_engine", "megatron.core"))
    result = in_ranks("megatron_optimizer_steps")[0]
    assert result["dtype"] == "torch.bfloat16" and result["finite"] and result["steps"] == 2, result
    assert result["end"] > result["start"] and result["changed"] == result["params"], result
    assert result["state_keys"] == ["adam_step", "tensors"], result  # ActorOptimizer.sharded_state


def test_the_weight_export_is_bfloat16_and_equals_the_checkpoint() -> None:
    need(modules=("transformer_engine", "megatron.core"))
    result = in_ranks("bf16_export")[0]
    assert result["dtypes"] == ["torch.bfloat16"] and not result["missing"], result
    assert result["worst"] == 0.0, result  # float32 checkpoint -> bf16 is the same rounding on both sides


def test_an_nccl_weight_group_broadcasts_between_two_gpus_without_blocking_the_cpu() -> None:
    need(gpus=2)
    from hpc_rl.process.child_process import free_port

    results = in_ranks("nccl_weight_group", 2, free_port())
    assert all(r["equal"] for r in results), results
    assert results[0]["wait_s"] < 1.0, results  # NCCL's wait() orders the stream; the CPU moves on


def test_a_colocated_tiny_run_on_sglang_learns_with_the_engines_serving_the_trainers_weights(tmp_path: Path) -> None:
    need(modules=("sglang", "transformer_engine", "megatron.core", "torch_memory_saver"))
    run_dir = tmp_path / "colocated-gpu"
    command = [sys.executable, "-m", "hpc_rl.submit", "configs/tiny_cpu.yaml", "--executor", "local",
               "--run-dir", str(run_dir), "--colocate", "--num-rollout", "20", "--eval-interval", "1000",
               "--set", "cluster.device=cuda", "--set", "rollout.engine=sglang",
               "--sglang-mem-fraction-static", "0.3"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 20
    for row in rows:  # CUDA IPC updates reached the engine: its log-probs are the trainer's (bf16 kernels)
        metrics = row["metrics"]
        assert metrics["train/first_step_train_rollout_logprob_abs_diff"] < 0.05, (row["rollout_id"], metrics)
        assert metrics["weight_sync/buckets"] >= 1 and metrics["time/trainer_offload_weights"] >= 0
    engine_log = (run_dir / "logs" / "engine-0.log").read_text()
    assert "server_args=" in engine_log and "enable_memory_saver=True" in engine_log
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert controller_log.count("through /update_weights_from_tensor") >= 20
