"""Weight export end to end: TP=2 trainer ranks run a SyncWeightsCommand through the command loop
(gather, WeightPlan, broadcast of flattened buckets on the SGLang-style group); a receiver process
(rank 1 of that group, as an engine would be) rebuilds an HF model from the received tensors, and
its logits equal the trainer's."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch

from hpc_rl.protocol.messages import StopCommand, SyncWeightsCommand, WeightPlan
from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
ARCH_FILE = str(Path(__file__).resolve().parents[2] / "configs/models/tiny_qwen3.yaml")
TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2], [1, 4, 9, 16, 23, 0, 8, 6]])


class FakeControllerCommands:
    """A hand-written stand-in for ControllerLink: one SyncWeightsCommand, then Stop; the plan goes to a file."""

    def __init__(self, plan_file: str, rank: int) -> None:
        self.plan_file, self.rank = plan_file, rank
        self.commands = iter([SyncWeightsCommand(seq=0, weight_version=7, new_group=True, world_size=2,
                                                 group_name="weight_update_group", backend="gloo",
                                                 bucket_bytes=20_000),
                              StopCommand(seq=1)])
        self.metrics: list[dict] = []

    def next_command(self):
        return next(self.commands)

    def done(self, seq: int, metrics: dict | None = None) -> None:
        self.metrics.append(metrics or {})

    def failed(self, seq: int, error: str) -> None:
        raise AssertionError(error)

    def join_verdict(self, seq: int) -> str:
        """Rank 0 asks while the engines join the group (every 0.5 s, so only when the join is slow): keep waiting."""
        return ""

    def send_weight_plan(self, plan: WeightPlan) -> None:
        assert self.rank == 0
        tmp = Path(self.plan_file + ".tmp")
        tmp.write_text(json.dumps({"master_address": plan.master_address, "master_port": plan.master_port,
                                   "load_format": plan.load_format, "weight_version": plan.weight_version,
                                   "buckets": plan.buckets}))
        tmp.rename(self.plan_file)


def trainer_rank(hf_dir: str, plan_file: str) -> torch.Tensor | None:
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.commands import TrainerCommands
    from hpc_rl.training.model_provider import forward_logits
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from hpc_rl.training.sync_address import TRAINER_NODE_ADDRESSES_ENV

    os.environ[TRAINER_NODE_ADDRESSES_ENV] = "127.0.0.1"  # as the driver passes it
    training = TrainingConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    info = init_parallel(training)
    arch = ModelArchitecture.from_yaml(ARCH_FILE)
    parts = build_trainer(arch=arch, training=training, algorithm=AlgorithmConfig(), optimizer_config=OptimizerConfig(),
                          checkpoints=CheckpointConfig(hf_checkpoint=hf_dir), info=info)
    torch.manual_seed(123)  # move away from the HF file: the receiver must get the *current* weights
    with torch.no_grad():
        for param in parts.actor.parameters():
            param.add_(0.05 * torch.randn_like(param))
    source = FakeControllerCommands(plan_file, info.rank)
    TrainerCommands(parts, arch=arch, info=info, source=source, save_dir=None).run()
    assert source.metrics[0]["buckets"] > 2
    tp_group = parallel_state.get_tensor_model_parallel_group()
    parts.actor.eval()
    with torch.no_grad():
        local = forward_logits(parts.actor, TOKENS)
    shards = [torch.empty_like(local) for _ in range(info.tp_size)]
    dist.all_gather(shards, local.contiguous(), group=tp_group)
    rank = info.rank
    shutdown_parallel()
    return torch.cat(shards, dim=-1)[..., : arch.vocab_size] if rank == 0 else None


def receiver(hf_dir: str, plan_file: str, results: mp.Queue) -> None:
    """What an engine does on /update_weights_from_distributed with load_format=flattened_bucket."""
    try:
        import torch.distributed as dist
        from transformers import AutoConfig, AutoModelForCausalLM

        from hpc_rl.weights.bucket_layout import compute_layout, unpack_bucket
        from hpc_rl.weights.process_group import init_weight_update_group

        torch.set_num_threads(1)
        deadline = time.monotonic() + 120
        while not Path(plan_file).exists():
            if time.monotonic() > deadline:
                raise TimeoutError("no plan")
            time.sleep(0.05)
        plan = json.loads(Path(plan_file).read_text())
        assert plan["load_format"] == "flattened_bucket" and plan["weight_version"] == 7
        group = init_weight_update_group(master_address=plan["master_address"], master_port=plan["master_port"],
                                         rank=1, world_size=2)
        state: dict[str, torch.Tensor] = {}
        for bucket in plan["buckets"]:
            layout = compute_layout(bucket["names"], bucket["dtypes"], bucket["shapes"])
            buffer = torch.empty(layout.total_bytes, dtype=torch.uint8)
            dist.broadcast(buffer, src=0, group=group)
            state.update({name: tensor.clone() for name, tensor in unpack_bucket(buffer, layout)})
        dist.destroy_process_group(group)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), dtype=torch.float32)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
        assert all("lm_head" in name for name in missing), missing  # tied embeddings
        model.tie_weights()
        with torch.no_grad():
            # numpy, not a torch tensor: torch shares tensors through a file descriptor that dies with this process
            results.put(("ok", model.eval()(TOKENS).logits.numpy()))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        import traceback

        results.put(("error", f"{error}\n{traceback.format_exc()}"))


def export_and_receive(trainer_fn, world_size: int, logits_rank: int, tmp_path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `trainer_fn(hf_dir, plan_file)` on `world_size` ranks next to a receiver process; return the
    trainer's logits (from rank `logits_rank`) and the receiver's rebuilt model's logits."""
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = str(make_tiny_model(tmp_path / "hf"))
    plan_file = str(tmp_path / "plan.json")
    context = mp.get_context("spawn")
    results = context.Queue()
    proc = context.Process(target=receiver, args=(hf_dir, plan_file, results))
    proc.start()
    try:
        trainer_logits = run_ranks(trainer_fn, world_size, hf_dir, plan_file, timeout=240)[logits_rank]
        status, received = results.get(timeout=120)
        assert status == "ok", received
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    return trainer_logits, torch.from_numpy(received)


def test_weight_export_reproduces_trainer_logits(tmp_path: Path) -> None:
    trainer_logits, received = export_and_receive(trainer_rank, 2, 0, tmp_path)
    assert (trainer_logits - received).abs().max().item() < 1e-4
