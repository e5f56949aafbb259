"""slime's --custom-loss-function-path / --custom-advantage-function-path train a real step on a gloo rank.

The plug-ins (tests/integration/plugins/custom_loss.py) are PPO's unclipped surrogate and GRPO's reward
broadcast x 2: on a first step they must give the gradient of the built-in GRPO loss on rewards x 2,
to float precision, and the optimizer step must move the weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks
from tests.integration.test_trainer_step import ARCH_FILE, make_batch

pytestmark = pytest.mark.slow
PLUGINS = "tests.integration.plugins.custom_loss"


def _grads_of_one_step(hf_dir: str, algorithm, batch, info) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    from megatron.core.distributed import finalize_model_grads

    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer
    from hpc_rl.training.optimizer import StepResult

    training = TrainingConfig(global_batch_size=8, micro_batch_size=3, qkv_format="thd")
    parts = build_trainer(arch=ModelArchitecture.from_yaml(ARCH_FILE), training=training, algorithm=algorithm,
                          optimizer_config=OptimizerConfig(lr=1e-3), checkpoints=CheckpointConfig(hf_checkpoint=hf_dir),
                          info=info, model_file=ARCH_FILE)
    grads: dict[str, torch.Tensor] = {}

    def record_instead_of_step():
        finalize_model_grads([parts.actor])
        grads.update({n: p.main_grad.clone() for n, p in parts.actor.named_parameters()})
        parts.optimizer.zero_grad()
        return StepResult(grad_norm=0.0, lr=0.0, skipped=True)

    real_step, parts.optimizer.step = parts.optimizer.step, record_instead_of_step
    metrics = parts.trainer.train_rollout(batch)[0]
    parts.optimizer.step = real_step
    before = {n: p.detach().clone() for n, p in parts.actor.named_parameters()}
    stepped = parts.trainer.train_rollout(batch)[0]  # a real optimizer step through the custom loss
    moved = max((p.detach() - before[n]).abs().max().item() for n, p in parts.actor.named_parameters())
    return grads, {**metrics, "moved": moved, "stepped_grad_norm": stepped["grad_norm"]}


def custom_vs_builtin_rank(hf_dir: str) -> dict:
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.parallel import init_parallel, shutdown_parallel
    from tests.integration.plugins import custom_loss

    info = init_parallel(TrainingConfig(), device="cpu")
    batch = make_batch(3)
    doubled = type(batch)(tokens=batch.tokens, response_lengths=batch.response_lengths, loss_masks=batch.loss_masks,
                          rewards=[2.0 * r for r in batch.rewards], rollout_logprobs=batch.rollout_logprobs)
    builtin, builtin_metrics = _grads_of_one_step(hf_dir, AlgorithmConfig(eps_clip=0.2), doubled, info)
    custom_algorithm = AlgorithmConfig(loss_type="custom_loss",
                                       custom_loss_function_path=f"{PLUGINS}.unclipped_surrogate",
                                       custom_advantage_function_path=f"{PLUGINS}.reward_advantages")
    custom, custom_metrics = _grads_of_one_step(hf_dir, custom_algorithm, batch, info)
    shutdown_parallel()
    diff = max((builtin[n] - custom[n]).abs().max().item() for n in builtin)
    scale = max(builtin[n].abs().max().item() for n in builtin)
    return {"diff": diff, "scale": scale, "builtin": builtin_metrics, "custom": custom_metrics,
            "calls": dict(custom_loss.CALLS)}


def test_custom_loss_and_advantages_train_like_the_builtin_loss(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = make_tiny_model(tmp_path / "hf")
    out = run_ranks(custom_vs_builtin_rank, 1, str(hf_dir))[0]
    assert out["scale"] > 0
    assert out["diff"] < 1e-5 * max(1.0, out["scale"]), out
    assert out["custom"]["loss"] == pytest.approx(out["builtin"]["pg_loss"], rel=1e-5, abs=1e-7)
    assert out["calls"]["advantages"] == 2  # once per rollout
    assert out["calls"]["loss"] == 2 * 3  # once per micro-batch (8 samples / micro_batch_size 3), two rollouts
    assert "custom_calls" in out["custom"]
    assert out["custom"]["moved"] > 0 and out["custom"]["stepped_grad_norm"] > 0
