"""The stand-in trainer: every trainer rank as a thread on the real trainer channel, no model.

Owns `python -m hpc_rl.sim.trainer RUN_DIR ...`: each rank connects with `ControllerLink` (the real
protocol, Hello with dp_rank/dp_size as a Megatron rank sends), and answers the controller's commands:

    TrainCommand        sleep train_gpu_s_per_sample x samples / trainer GPUs (simulated, scaled to
                        real time), record the sample indices received (received-<rank>.jsonl)
    SyncWeightsCommand  rank 0 sends the WeightPlan of the real model's HF tensors in buckets of
                        `bucket_bytes` (flattened_bucket) and joins no group: there is no broadcast,
                        the simulated engines only take their simulated time per call
    SaveCommand         done at once (AbortWeightGroupCommand too: no real group);  StopCommand: leave

It stands in for hpc_rl.training so the controller's side of a run can be measured at scale; it is
named a stand-in everywhere it is used. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.protocol.messages import (AbortWeightGroupCommand, SaveCommand, StopCommand, SyncWeightsCommand,
                                      TrainCommand, WeightPlan)
from hpc_rl.training.controller_link import ControllerLink

BF16_BYTES = 2


def qwen3_hf_tensors(arch: ModelArchitecture) -> list[tuple[str, list[int]]]:
    """HF names and shapes of a Qwen3/GLM-style dense decoder (what the engines receive)."""
    hidden, ffn, heads = arch.hidden_size, arch.ffn_hidden_size, arch.num_attention_heads
    head_dim = arch.kv_channels or hidden // heads
    kv = (arch.num_query_groups or heads) * head_dim
    tensors: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [arch.vocab_size, hidden])]
    for layer in range(arch.num_layers):
        prefix = f"model.layers.{layer}."
        tensors += [
            (prefix + "input_layernorm.weight", [hidden]),
            (prefix + "self_attn.q_proj.weight", [heads * head_dim, hidden]),
            (prefix + "self_attn.k_proj.weight", [kv, hidden]),
            (prefix + "self_attn.v_proj.weight", [kv, hidden]),
            (prefix + "self_attn.o_proj.weight", [hidden, heads * head_dim]),
            (prefix + "post_attention_layernorm.weight", [hidden]),
            (prefix + "mlp.gate_proj.weight", [ffn, hidden]),
            (prefix + "mlp.up_proj.weight", [ffn, hidden]),
            (prefix + "mlp.down_proj.weight", [hidden, ffn]),
        ]
        if getattr(arch, "qk_layernorm", False):
            tensors += [(prefix + "self_attn.q_norm.weight", [head_dim]), (prefix + "self_attn.k_norm.weight", [head_dim])]
    tensors.append(("model.norm.weight", [hidden]))
    if not getattr(arch, "tie_word_embeddings", False):
        tensors.append(("lm_head.weight", [arch.vocab_size, hidden]))
    return tensors


def plan_buckets(tensors: list[tuple[str, list[int]]], bucket_bytes: int) -> list[dict[str, Any]]:
    """Tensors in order, a new bucket when the next one would overflow `bucket_bytes` (as WeightSender)."""
    buckets: list[dict[str, Any]] = []
    current: dict[str, Any] = {"names": [], "dtypes": [], "shapes": [], "num_bytes": 0}
    for name, shape in tensors:
        size = BF16_BYTES
        for dim in shape:
            size *= dim
        if current["names"] and current["num_bytes"] + size > bucket_bytes:
            buckets.append(current)
            current = {"names": [], "dtypes": [], "shapes": [], "num_bytes": 0}
        current["names"].append(name)
        current["dtypes"].append("bfloat16")
        current["shapes"].append(list(shape))
        current["num_bytes"] += size
    if current["names"]:
        buckets.append(current)
    return buckets


class StandInRank:
    """One trainer rank's command loop (a thread)."""

    def __init__(self, run_dir: Path, *, rank: int, world_size: int, dp_size: int, args: argparse.Namespace,
                 tensors: list[tuple[str, list[int]]]) -> None:
        self.run_dir, self.rank, self.args, self.tensors = run_dir, rank, args, tensors
        tp = world_size // dp_size
        self.link = ControllerLink(run_dir, rank=rank, world_size=world_size,
                                   info={"dp_rank": rank // tp, "dp_size": dp_size, "tp_rank": rank % tp,
                                         "stand_in": True})
        # TP ranks of one DP group receive the same share: only the first of each records it.
        self.received = open(run_dir / f"received-{rank}.jsonl", "a") if rank % tp == 0 else None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while True:
                command = self.link.next_command()
                if isinstance(command, StopCommand):
                    self.link.done(command.seq)
                    return
                self.link.done(command.seq, self.execute(command))
        except BaseException as error:  # reported by main()
            self.error = error
        finally:
            if self.received is not None:
                self.received.close()
            self.link.close()

    def execute(self, command: Any) -> dict[str, Any]:
        if isinstance(command, TrainCommand):
            indices = [int(i) for i in command.batch["sample_indices"]]
            if self.received is not None:
                self.received.write(json.dumps({"rollout_id": command.rollout_id, "sample_indices": indices}) + "\n")
                self.received.flush()
            samples = len(indices) * self.args.dp_size  # every DP rank gets a share of the same size
            simulated = self.args.train_gpu_s_per_sample * samples / self.args.trainer_gpus
            time.sleep(simulated * self.args.time_scale_ms / 1000.0)
            return {"stand_in/simulated_train_s": simulated, "loss": 0.0}
        if isinstance(command, SyncWeightsCommand):
            if self.rank == 0:
                self.link.send_weight_plan(WeightPlan(
                    weight_version=command.weight_version, master_address="127.0.0.1", master_port=1,
                    buckets=plan_buckets(self.tensors, command.bucket_bytes), load_format="flattened_bucket"))
            return {}
        if isinstance(command, (SaveCommand, AbortWeightGroupCommand)):  # (no group: nothing to abort; an engine
            return {}  # left or failed while in it, bench_scale.py --leave)
        raise RuntimeError(f"the stand-in trainer cannot run {type(command).__name__}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_rl.sim.trainer", description="stand-in trainer ranks")
    parser.add_argument("run_dir")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--dp-size", type=int, required=True)
    parser.add_argument("--model", required=True, help="architecture file (configs/models/*.yaml)")
    parser.add_argument("--train-gpu-s-per-sample", type=float, required=True)
    parser.add_argument("--trainer-gpus", type=int, required=True, help="GPUs the simulated trainer has")
    parser.add_argument("--time-scale-ms", type=float, required=True)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    tensors = qwen3_hf_tensors(ModelArchitecture.from_yaml(args.model))
    ranks = [StandInRank(run_dir, rank=r, world_size=args.world_size, dp_size=args.dp_size, args=args,
                         tensors=tensors) for r in range(args.world_size)]
    threads = [threading.Thread(target=r.run, name=f"rank-{r.rank}") for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [r.error for r in ranks if r.error is not None]
    for error in errors:
        print(f"stand-in trainer: {type(error).__name__}: {error}", flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
