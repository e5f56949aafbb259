"""The GPU's optimizer path on CPU (issue 29): Megatron's mixed-precision optimizer over a bf16 model with fp32 main
copies, as `actor.build_trainer` builds it. Each check here failed on the code before (commit 246592e), whose GPU
path (`optimizer_gpu.MegatronActorOptimizer`) never ran:

- loaded weights survive the first step (HF load, and a resume from a checkpoint saved without optimizer state);
- a NaN gradient skips the step on the bf16 model (Megatron builds no grad scaler in bf16, so its step checks nothing);
- `optimizer: sgd` steps with SGD;
- the first step's lr follows Megatron's formula after `set_run_length` (warm-up fraction) and `restore_steps`
  (a resumed linear decay); a repeated `set_run_length` keeps the scheduler;
- every parameter of every family is built in the config's dtype beside Megatron's own (no cast after building);
- the checkpoint's RNG file holds Megatron's RNG tracker states and restores them.

There is no config field for bf16 on CPU (the trainer picks fp32 there): the bf16 trainer is `build_trainer` with
`actor.build_model` swapped for one passing params_dtype=bfloat16, nothing else changed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ARCH_FILE = str(ROOT / "configs/models/tiny_qwen3.yaml")
LR = 1e-3


def _bf16_trainer(hf_dir: str, info: Any, *, load: str | None = None, optimizer: Any = None) -> Any:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training import actor
    from hpc_rl.training.model_provider import build_gpt_model

    def build_bf16(arch: Any, training: Any, *, device: str = "cpu") -> torch.nn.Module:
        return build_gpt_model(arch, training, params_dtype=torch.bfloat16, device=device)

    actor.build_model = build_bf16  # this rank process only
    return actor.build_trainer(
        arch=ModelArchitecture.from_yaml(ARCH_FILE), training=TrainingConfig(global_batch_size=8, micro_batch_size=4),
        algorithm=AlgorithmConfig(), optimizer_config=optimizer or OptimizerConfig(lr=LR, clip_grad=1.0),
        checkpoints=CheckpointConfig(hf_checkpoint=hf_dir, load=load), info=info, model_file=ARCH_FILE)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def _farthest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def _random_grads(optimizer: Any, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer.zero_grad()
    for param in optimizer.params:
        param.main_grad.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def optimizer_rank(hf_dir: str, save_dir: str) -> dict[str, Any]:
    from hpc_rl.config.sections.training import OptimizerConfig, TrainingConfig
    from hpc_rl.training.checkpoint import TrainerState, save_checkpoint
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.training.optimizer import ActorOptimizer, wants_distributed_optimizer, wrap_ddp
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from tests.integration.test_trainer_step import make_batch

    info = init_parallel(TrainingConfig(global_batch_size=8, micro_batch_size=4), device="cpu")
    out: dict[str, Any] = {}
    # 1. HF weights loaded after the optimizer was built are the weights the first step starts from
    parts = _bf16_trainer(hf_dir, info)
    out["classes"] = sorted({type(chained).__name__ for chained in parts.optimizer.chained})
    out["dtypes"] = sorted({str(p.dtype) for p in parts.actor.parameters()})
    out["main_dtypes"] = sorted({str(parts.optimizer.moments(p)["param"].dtype) for p in parts.optimizer.params})
    loaded = _weights(parts.actor)
    parts.trainer.train_rollout(make_batch(0))
    out["first_step_from_loaded"] = _farthest(_weights(parts.actor), loaded)
    # 2. a NaN gradient: the step is skipped on the bf16 model, its fp32 copies and the schedule stay
    before, lr_before = _weights(parts.actor), parts.optimizer.lr
    _random_grads(parts.optimizer, 1)
    parts.optimizer.params[0].main_grad.view(-1)[0] = float("nan")
    nan_step = parts.optimizer.step()
    out["nan_step"] = {"skipped": nan_step.skipped, "moved": _farthest(_weights(parts.actor), before),
                       "steps_done": parts.optimizer.steps_done, "lr_kept": parts.optimizer.lr == lr_before,
                       "main_finite": all(bool(torch.isfinite(parts.optimizer.moments(p)["param"]).all())
                                          for p in parts.optimizer.params)}
    _random_grads(parts.optimizer, 2)
    finite = parts.optimizer.step()
    out["finite_step"] = {"skipped": finite.skipped, "steps_done": parts.optimizer.steps_done,
                          "moved": _farthest(_weights(parts.actor), before)}
    # 3. a resume from a checkpoint without optimizer state: the saved weights are where training goes on
    save_checkpoint(save_dir, parts.actor, parts.optimizer, TrainerState(rollout_id=0), save_optim=False)
    saved = _weights(parts.actor)
    resumed = _bf16_trainer(hf_dir, info, load=save_dir)
    out["resumed_steps"] = resumed.optimizer.steps_done
    resumed.trainer.train_rollout(make_batch(1))
    out["resumed_step_from_saved"] = _farthest(_weights(resumed.actor), saved)
    # 4. optimizer: sgd is Megatron's SGD (momentum 0.9: the first step moves by lr * grad)
    sgd_config = OptimizerConfig(optimizer="sgd", lr=0.5, clip_grad=0.0)
    sgd_model = build_gpt_model(parts.trainer.arch, TrainingConfig(), params_dtype=torch.bfloat16)
    sgd = ActorOptimizer(wrap_ddp(sgd_model, distributed_optimizer=wants_distributed_optimizer(sgd_config)),
                         sgd_config)
    _random_grads(sgd, 3)
    grads = [p.main_grad.clone() for p in sgd.params]
    start = [sgd.moments(p)["param"].detach().clone() for p in sgd.params]
    sgd.step()
    out["sgd"] = {"classes": sorted({type(o).__name__ for o in sgd.torch_optimizers}),
                  "megatron": sorted({type(o).__name__ for o in sgd.chained}),
                  "update_error": max((sgd.moments(p)["param"] - (s - 0.5 * g)).abs().max().item()
                                      for p, s, g in zip(sgd.params, start, grads))}
    # 5. the first step's lr: a warm-up fraction set by the run's length, a linear decay resumed at step 50
    warm = ActorOptimizer(parts.actor, OptimizerConfig(lr=LR, lr_warmup_fraction=0.1, lr_decay_style="linear"))
    warm.set_run_length(100)
    _random_grads(warm, 4)
    groups = sorted({g["lr"] for o in warm.torch_optimizers for g in o.param_groups})  # what the step runs at
    out["warmup"] = {"lr": warm.step().lr, "next": warm.lr, "groups": groups}
    scheduler = warm.scheduler  # every train command repeats the run's length: the same schedule is not rebuilt
    warm.set_run_length(100)
    out["same_length_kept"] = warm.scheduler is scheduler and warm.lr == out["warmup"]["next"]
    decay = ActorOptimizer(parts.actor, OptimizerConfig(lr=LR, min_lr=1e-4, lr_decay_style="linear"))
    decay.restore_steps(50)  # the trainer's order: the checkpoint is loaded, then the run's length is known
    decay.set_run_length(100)
    out["decay"] = {"groups": sorted({g["lr"] for o in decay.torch_optimizers for g in o.param_groups})}
    _random_grads(decay, 5)
    out["decay"]["lr"] = decay.step().lr
    shutdown_parallel()
    return out


def test_megatron_optimizer_keeps_loaded_weights_skips_nan_steps_and_follows_the_schedule(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = make_tiny_model(tmp_path / "hf")
    out = run_ranks(optimizer_rank, 1, str(hf_dir), str(tmp_path / "ckpt"), timeout=400)[0]
    assert out["classes"] == ["DistributedOptimizer"] and out["dtypes"] == ["torch.bfloat16"]
    assert out["main_dtypes"] == ["torch.float32"]
    # one Adam step moves a weight by about lr (plus bf16 rounding); the random init is ~0.02-0.1 away
    assert out["first_step_from_loaded"] < 3 * LR, out["first_step_from_loaded"]
    assert out["resumed_steps"] == 2 and out["resumed_step_from_saved"] < 3 * LR, out["resumed_step_from_saved"]
    assert out["nan_step"] == {"skipped": True, "moved": 0.0, "steps_done": 1, "lr_kept": True, "main_finite": True}
    assert out["finite_step"]["skipped"] is False and out["finite_step"]["steps_done"] == 2
    assert out["finite_step"]["moved"] > 0
    assert out["sgd"]["megatron"] == ["Float16OptimizerWithFloat16Params"]
    assert out["sgd"]["classes"] == ["SGD"] and out["sgd"]["update_error"] < 1e-6
    # Megatron's formula: warm-up from 0 over 10 steps (0.1 of 100), so step 1 runs at 0 and step 2 at lr / 10
    assert out["warmup"] == {"lr": 0.0, "next": pytest.approx(LR / 10), "groups": [0.0]}
    assert out["same_length_kept"] is True
    # linear decay from lr to min_lr over 100 steps, resumed after 50: min_lr + (lr - min_lr) * (1 - 50 / 100)
    expected = 1e-4 + (LR - 1e-4) * 0.5
    assert out["decay"]["lr"] == pytest.approx(expected) and out["decay"]["groups"] == [pytest.approx(expected)]


def dtype_rank() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training import checkpoint
    from hpc_rl.training.layer_specs import SequenceParallelRMSNorm
    from hpc_rl.training.model_provider import build_gpt_model, transformer_config
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel

    training = TrainingConfig(global_batch_size=8, micro_batch_size=4)
    init_parallel(training, device="cpu")
    qwen3 = ModelArchitecture.from_yaml(ARCH_FILE)
    families = {
        "qwen3": qwen3,
        "glm4 (post-sublayer norms)": dataclasses.replace(qwen3, post_sublayer_norms=True),
        "qwen3 moe": ModelArchitecture.from_yaml(ROOT / "configs/models/tiny_qwen3_moe.yaml"),
        "deepseek v3 (MLA, MTP)": ModelArchitecture.from_yaml(ROOT / "configs/models/tiny_deepseek_v3.yaml"),
    }
    out: dict[str, Any] = {}
    for family, arch in families.items():
        model = build_gpt_model(arch, training, params_dtype=torch.bfloat16)
        megatron_device = model.embedding.word_embeddings.weight.device
        out[family] = {"params": len(list(model.parameters())), "wrong": [
            f"{name}: {p.dtype} on {p.device}" for name, p in model.named_parameters()
            if p.dtype != torch.bfloat16 or p.device != megatron_device]}
    norm = SequenceParallelRMSNorm(transformer_config(qwen3, training, params_dtype=torch.bfloat16), 64)
    out["norm alone"] = str(norm.weight.dtype)
    # the RNG file: Megatron's tracker states (a fake tracker: on CPU the tracker is the inference one, stateless)
    saved_states = {"model-parallel-rng": torch.arange(8, dtype=torch.uint8)}

    class FakeTracker:
        def __init__(self) -> None:
            self.states = dict(saved_states)

        def get_states(self) -> dict[str, torch.Tensor]:
            return dict(self.states)

        def set_states(self, states: dict[str, torch.Tensor]) -> None:
            self.states = states

    fake = FakeTracker()
    real_tracker = tensor_parallel.get_cuda_rng_tracker
    tensor_parallel.get_cuda_rng_tracker = lambda *args, **kwargs: fake
    try:
        state = checkpoint.rng_state()
        fake.states = {"model-parallel-rng": torch.zeros(8, dtype=torch.uint8)}
        torch.manual_seed(123)
        out["rng_keys"] = sorted(state)
        out["tracker_saved"] = {k: v.tolist() for k, v in state["tracker"].items()}
        import tempfile

        with tempfile.TemporaryDirectory() as directory:
            (Path(directory) / "rng").mkdir()
            torch.save(state, Path(directory) / "rng" / "rank_00000.pt")
            (Path(directory) / "metadata.json").write_text("{}")  # what marks a torch_dist directory
            checkpoint.restore_rng_state(directory)
        out["tracker_restored"] = {k: v.tolist() for k, v in fake.states.items()}
        out["torch_restored"] = torch.equal(torch.get_rng_state(), state["torch"])
    finally:
        tensor_parallel.get_cuda_rng_tracker = real_tracker
    shutdown_parallel()
    return out


def test_every_parameter_in_the_configs_dtype_and_rng_tracker_in_checkpoints() -> None:
    out = run_ranks(dtype_rank, 1, timeout=400)[0]
    for family in ("qwen3", "glm4 (post-sublayer norms)", "qwen3 moe", "deepseek v3 (MLA, MTP)"):
        assert out[family]["params"] > 0 and out[family]["wrong"] == [], (family, out[family]["wrong"][:5])
    assert out["norm alone"] == "torch.bfloat16"
    assert out["rng_keys"] == ["torch", "tracker"]  # no "cuda" without a GPU
    assert out["tracker_saved"] == {"model-parallel-rng": list(range(8))}
    assert out["tracker_restored"] == out["tracker_saved"] and out["torch_restored"]
