"""A LoRA actor through the trainer's own path (issue 33): `build_trainer(lora=...)` trains a rollout with the real
loss and Megatron's optimizer at TP2 + SP (the base bit-identical), saves a torch_dist checkpoint and `--save-hf`'s
directory (a PEFT adapter); a TP1 trainer resumes the adapters (resharded) and their optimizer state, and another
starts from the PEFT directory (--lora-adapter-path); PEFT on the HF model gives the trainer's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks
from tests.integration.test_trainer_step import ARCH_FILE, LOGIT_TOKENS, make_batch

pytestmark = pytest.mark.slow
LORA = {"lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_type": "canonical_lora"}


def _trainer(hf_dir: str, tp: int, *, load: str | None = None, adapter: str | None = None):  # noqa: ANN202
    from hpc_rl.config.lora import LoraConfig
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.parallel import init_parallel

    training = TrainingConfig(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, global_batch_size=8,
                              micro_batch_size=4, qkv_format="thd")
    info = init_parallel(training, device="cpu")
    parts = build_trainer(arch=ModelArchitecture.from_yaml(ARCH_FILE), training=training,
                          algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1),
                          optimizer_config=OptimizerConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.0),
                          checkpoints=CheckpointConfig(hf_checkpoint=hf_dir, ref_load=hf_dir, load=load), info=info,
                          model_file=ARCH_FILE, lora=LoraConfig(**LORA, lora_adapter_path=adapter))
    return parts, info


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from hpc_rl.training.lora.peft_files import adapter_state_dict

    return adapter_state_dict(model)


def _logits(parts, info) -> torch.Tensor:  # noqa: ANN001
    import torch.distributed as dist

    from hpc_rl.training.model_provider import forward_logits

    with torch.no_grad():
        local = forward_logits(parts.actor, LOGIT_TOKENS)
    if info.tp_size > 1:
        shards = [torch.empty_like(local) for _ in range(info.tp_size)]
        dist.all_gather(shards, local.contiguous(), group=parts.trainer.tp_group)
        local = torch.cat(shards, dim=-1)
    return local[..., :24]


def train_and_save_rank(hf_dir: str, root: str) -> dict | None:
    from hpc_rl.training import checkpoint
    from hpc_rl.training.hf_save import save_hf_checkpoint
    from hpc_rl.training.lora.attach import is_adapter_param
    from hpc_rl.training.parallel import shutdown_parallel

    parts, info = _trainer(hf_dir, 2)
    base = {n: p.detach().clone() for n, p in parts.actor.named_parameters() if not is_adapter_param(n)}
    for rollout in range(2):
        parts.trainer.train_rollout(make_batch(rollout))
    moved = [n for n, p in parts.actor.named_parameters() if n in base and not torch.equal(p.detach(), base[n])]
    checkpoint.save_checkpoint(Path(root) / "ckpt", parts.actor, parts.optimizer, checkpoint.TrainerState(rollout_id=1))
    save_hf_checkpoint(parts.actor, parts.trainer.arch, Path(root) / "hf", reference_dir=hf_dir, info=info,
                       tp_group=parts.trainer.tp_group)
    out = {"base_moved": moved, "adapters": _adapters(parts.actor), "logits": _logits(parts, info),
           "steps": parts.optimizer.steps_done}
    rank = info.rank
    shutdown_parallel()
    return out if rank == 0 else None


def resume_rank(hf_dir: str, root: str) -> dict:
    from hpc_rl.training.parallel import shutdown_parallel

    resumed, info = _trainer(hf_dir, 1, load=str(Path(root) / "ckpt"))
    out = {"adapters": _adapters(resumed.actor), "steps": resumed.optimizer.steps_done,
           "resumed": resumed.resumed is not None, "logits": _logits(resumed, info)}
    started, _ = _trainer(hf_dir, 1, adapter=str(Path(root) / "hf"))
    out["from_peft_dir"] = _adapters(started.actor)
    shutdown_parallel()
    return out


def test_lora_trainer_trains_saves_resumes_and_exports_peft(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = str(make_tiny_model(tmp_path / "qwen3"))
    saved = run_ranks(train_and_save_rank, 2, hf_dir, str(tmp_path), timeout=300)[0]
    assert saved["base_moved"] == [] and saved["steps"] == 2
    assert any(name.endswith("lora_B.weight") and tensor.abs().max() > 0 for name, tensor in saved["adapters"].items())

    loaded = run_ranks(resume_rank, 1, hf_dir, str(tmp_path), timeout=300)[0]
    assert loaded["resumed"] and loaded["steps"] == 2
    for name, tensor in saved["adapters"].items():  # TP2 checkpoint -> TP1: each adapter matrix whole again
        assert torch.equal(loaded["adapters"][name], tensor), name
        assert torch.equal(loaded["from_peft_dir"][name], tensor), name
    assert (loaded["logits"] - saved["logits"]).abs().max().item() < 1e-5

    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "hf")).eval()
    with torch.no_grad():
        gap = (peft(LOGIT_TOKENS).logits - saved["logits"]).abs().max().item()
    print(f"--save-hf PEFT directory vs the TP2 trainer: max |logit diff| {gap:.2e}")
    assert gap < 1e-5
