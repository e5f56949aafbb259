"""Issue 29: the model roles on a real gloo trainer rank (Megatron-core on CPU). The reference and a Megatron
teacher keep their weights in host memory and swap in for their pass: the swapped reference pass gives exactly
the log-probs of a separate, always-resident model built and loaded the same way, the actor's weights are out
of the device during it, and training after it starts from the actor's own weights (first-step KL 0). The
actor's weights are loaded before its optimizer is built (Megatron's mixed-precision optimizer copies them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks
from tests.integration.test_trainer_step import ARCH_FILE, make_batch

pytestmark = pytest.mark.slow
TEACHER = Path(__file__).resolve().parents[2] / "assets/tiny_qwen3_teacher"


def swapped_and_resident_rank(hf_dir: str) -> dict:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig, DistillationConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import _frozen, build_model, build_trainer, load_weights
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel

    from hpc_rl.training import actor as actor_module

    training = TrainingConfig(global_batch_size=8, micro_batch_size=4, qkv_format="thd")
    info = init_parallel(training, device="cpu")
    arch = ModelArchitecture.from_yaml(ARCH_FILE)
    at_optimizer_build: list[list[torch.Tensor]] = []
    real_optimized = actor_module._optimized

    def recording_optimized(model, config):  # what the model holds when its optimizer is built
        at_optimizer_build.append([p.detach().clone() for p in model.parameters()])
        return real_optimized(model, config)

    actor_module._optimized = recording_optimized
    parts = build_trainer(arch=arch, training=training, optimizer_config=OptimizerConfig(lr=1e-3),
                          algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1),
                          checkpoints=CheckpointConfig(hf_checkpoint=hf_dir, ref_load=hf_dir), info=info,
                          model_file=ARCH_FILE, distillation=DistillationConfig(
                              use_opd=True, opd_type="megatron", opd_teacher_load=str(TEACHER)))
    actor_module._optimized = real_optimized
    trainer = parts.trainer
    (before_optimizer,) = at_optimizer_build
    out_loaded = all(torch.equal(a, b) for a, b in zip(before_optimizer, parts.actor.parameters(), strict=True))
    resident = {}
    for name, path in (("ref", hf_dir), ("teacher", str(TEACHER))):
        model = build_model(arch, training)
        load_weights(model, path, arch, info, model_file=ARCH_FILE)
        resident[name] = _frozen(model)
    batch = make_batch(0)
    micros = trainer._step_microbatches(batch, range(len(batch)))
    actor_bytes: list[int] = []
    hook = parts.ref_model.register_forward_pre_hook(
        lambda *_: actor_bytes.append(sum(p.untyped_storage().nbytes() for p in parts.actor.parameters())))
    actor_before = [p.detach().clone() for p in parts.actor.parameters()]
    out = {"ref_swapped": trainer._frozen_logprobs(trainer.ref_weights, micros, "ref_"),
           "ref_resident": trainer._logprobs(resident["ref"], micros),
           "teacher_swapped": trainer._frozen_logprobs(trainer.teacher_weights, micros, "teacher_"),
           "teacher_resident": trainer._logprobs(resident["teacher"], micros)}
    hook.remove()
    out["actor_bytes_during_ref_pass"] = actor_bytes
    out["loaded_before_optimizer"] = out_loaded
    out["actor_back"] = all(torch.equal(p, b) for p, b in zip(parts.actor.parameters(), actor_before, strict=True))
    out["first_step"] = trainer.train_rollout(batch)[0]
    shutdown_parallel()
    return out


def test_reference_and_teacher_swap_in_from_host_memory_with_resident_log_probs(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = str(make_tiny_model(tmp_path / "hf"))
    (out,) = run_ranks(swapped_and_resident_rank, 1, hf_dir)
    assert out["actor_bytes_during_ref_pass"] and set(out["actor_bytes_during_ref_pass"]) == {0}
    assert out["actor_back"]
    assert out["loaded_before_optimizer"]  # the actor's weights were in before its optimizer was built
    for role in ("ref", "teacher"):
        swapped, resident = out[f"{role}_swapped"], out[f"{role}_resident"]
        assert sorted(swapped) == list(range(8))
        assert all(torch.equal(swapped[i], resident[i]) for i in range(8)), role  # bit for bit
    assert not torch.equal(out["ref_swapped"][0], out["teacher_swapped"][0])  # two different models swapped in
    assert out["first_step"]["kl_loss"] == 0.0  # the reference == the actor's initial weights, restored after


def test_colocated_run_with_a_reference_serves_the_trainers_weights(tmp_path: Path) -> None:
    """The reference's swap and the colocated offload share the actor's host copy: after every rollout (reference
    pass, training, offload for the engines, weight push) the engines' log-probs are the trainer's."""
    from tests.integration.run_helpers import processes_mentioning, records, run_to_end

    run_dir = tmp_path / "colocated_kl"
    result = run_to_end(run_dir, "--colocate", "--use-kl-loss", "--kl-loss-coef", "0.01", "--num-rollout", "6",
                        "--eval-interval", "50", timeout_s=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = records(run_dir)
    assert len(rows) == 6
    for row in rows:
        metrics = row["metrics"]
        assert metrics["train/train_rollout_logprob_abs_diff"] < 1e-5, (row["rollout_id"], metrics)
        assert "train/kl_loss" in metrics
    assert rows[0]["metrics"]["train/kl_loss"] == 0.0 and rows[-1]["metrics"]["train/kl_loss"] > 0.0
    assert processes_mentioning(str(run_dir)) == []
