"""PPO's critic on a trainer rank: the actor's architecture with a value head, its own optimizer and checkpoints.

Owns: turning a built GPTModel into a value model (slime's: the output layer becomes a Linear(hidden, 1) with
a bias, initialised normal(0, 0.02) / zeros, the embedding untied from it), building the critic the way slime
starts one (the actor's initial weights for the body, a fresh head; or the critic's own checkpoint when one
exists), per-sample values of the response tokens, and where critic checkpoints live
(`<save>/critic`, resumed from `<load>/critic`, unless critic_save / critic_load say otherwise).

The critic shares the actor's ranks and parallel layout (slime: same GPUs, same topology); `train_critic`
trains it before the actor on each rollout, on the same micro-batches, in the trainer's own optimizer steps
(`step.RolloutTrainer._train_step`). Not here: the value loss's formula (`losses.value_loss`), GAE
(`advantages`).

Pipeline parallel: every stage runs the critic's passes (the critic's own `PipelineSchedule`); the value head
sits on the last stage only, where the values, the returns and the value loss are computed. Context parallel:
the values are gathered over CP as the actor's log-probs are (`response_values`).

Tensor parallel: the head is replicated on every TP rank and sees the full hidden state (the final norm's
output is not sharded); under sequence parallelism it runs on this rank's sequence shard and its output is
gathered, its parameters marked sequence-parallel so their gradients are summed over TP (as slime's
LinearForLastLayer).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from hpc_rl.config.sections.training import CriticConfig, OptimizerConfig
from hpc_rl.training.advantages import gae_advantages_and_returns, ppo_token_rewards
from hpc_rl.training.context_parallel import gather_with_local_grad
from hpc_rl.training.loss_reduction import sum_of_sample_mean, sum_of_tokens
from hpc_rl.training.losses import value_loss

VALUE_HEAD_INIT_STD = 0.02
CRITIC_DIR = "critic"


class ValueHead(torch.nn.Linear):
    """hidden -> one value per position, in place of GPTModel's output layer (same call signature)."""

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, seed: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, 1, bias=True, device=device, dtype=dtype)
        self.sequence_parallel = sequence_parallel
        generator = torch.Generator().manual_seed(seed)  # every TP/DP rank draws the same head
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=generator) * VALUE_HEAD_INIT_STD)  # host draw
            self.bias.zero_()
        if sequence_parallel:
            self.weight.sequence_parallel = True  # type: ignore[attr-defined]
            self.bias.sequence_parallel = True  # type: ignore[attr-defined]

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,  # type: ignore[override]
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        values = super().forward(input_).float()
        if self.sequence_parallel:
            from megatron.core import tensor_parallel

            values = tensor_parallel.gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def install_value_head(model: torch.nn.Module, *, seed: int) -> torch.nn.Module:
    """`model` (a GPTModel, not DDP-wrapped) with its output layer replaced by a ValueHead on the last stage, on the
    model's device and in its params_dtype (built before DDP and the optimizer see it: a head left fp32 on the host
    under a bf16 CUDA model would fail the first forward on a GPU)."""
    if getattr(model, "post_process", True):
        device = next(model.parameters()).device
        model.output_layer = ValueHead(model.config.hidden_size, sequence_parallel=model.config.sequence_parallel,
                                       seed=seed, device=device, dtype=model.config.params_dtype)
    model.share_embeddings_and_output_weights = False  # the head has its own weight, tied to nothing
    return model


def critic_optimizer_config(actor: OptimizerConfig, critic: CriticConfig) -> OptimizerConfig:
    """The actor's optimizer settings with the critic's overrides (slime: --megatron-config-path role critic)."""
    return dataclasses.replace(actor, **critic.critic_optimizer)


def critic_save_dir(critic: CriticConfig, actor_save_dir: str | None) -> str | None:
    return critic.critic_save or (str(Path(actor_save_dir) / CRITIC_DIR) if actor_save_dir else None)


def critic_load_dir(critic: CriticConfig, actor_load: str | None) -> str | None:
    return critic.critic_load or (str(Path(actor_load) / CRITIC_DIR) if actor_load else None)


def response_values(micro: Any, output: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample values at the positions that score each response token (the state before it; slime's
    get_values), from the critic's [b, s, 1] or [1, T, 1] output. Under context parallelism this rank holds
    two chunks of each sequence: the per-position values are all-gathered over CP and put back in global
    order first (backward: this rank's slice only, as the actor's log-probs), so every CP rank reads every
    sample's values and computes the same value loss."""
    values = output[..., 0].float()
    split = micro.context_parallel
    if split is not None:
        values = gather_with_local_grad(values[0], micro.cp_group).index_select(0, split.order).unsqueeze(0)
    rows, columns = micro.response_positions(values.device)
    return list(values[rows, columns].split(micro.response_lengths))


def critic_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """A critic step's metrics: the loss's under slime's names (value_loss, value_clipfrac), the step's as critic_*
    (critic_grad_norm, critic_lr, ...), beside the actor's step metrics."""
    return {(k if k.startswith("value_") else f"critic_{k}"): v for k, v in metrics.items()}


def _no_loss_here(micro: Any, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    raise AssertionError("the value loss is computed on the last pipeline stage only")


def train_critic(trainer: Any, batch: Any, plan: list[list[Any]],
                 masks: list[torch.Tensor]) -> tuple[list[torch.Tensor] | None, list[dict[str, float]]]:
    """PPO's critic, first on each rollout (slime's order): its values before the update (the actor's GAE uses
    them), GAE returns of the task reward (slime gives the critic kl_coef 0), then one value-loss step per
    optimizer step of the rollout. Returns (old values per sample, each step's metrics); on a pipeline stage
    before the last, which runs only its chunk's passes, the values are None (the metrics are the last stage's,
    broadcast by the step)."""
    critic, pipeline = trainer.critic, trainer.critic_pipeline
    all_micros = [m for step in plan for m in step]
    with torch.no_grad():
        outputs = pipeline.forward_only(critic.model, all_micros, response_values)
    if not pipeline.is_last:  # an earlier stage runs its chunk's passes; values and returns live on the last
        return None, [trainer._train_step(batch, micros, masks, _no_loss_here, model=critic.model,
                                          optimizer=critic.optimizer, pipeline=pipeline) for micros in plan]
    by_index: dict[int, torch.Tensor] = {}
    for micro, values in zip(all_micros, outputs):
        by_index.update(zip(micro.indices, values))
    old_values = [by_index[i] for i in range(len(batch))]
    token_rewards = ppo_token_rewards(batch.rewards, [torch.zeros_like(v) for v in old_values], 0.0)
    _, returns = gae_advantages_and_returns(token_rewards, old_values, trainer.algorithm.gamma,
                                            trainer.algorithm.lambd)
    reduce = sum_of_tokens if trainer.loss_config.calculate_per_token_loss else sum_of_sample_mean

    def loss_of(micro: Any, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        idx = micro.indices
        per_token, clipfrac = value_loss(torch.cat(response_values(micro, output)),
                                         torch.cat([old_values[i] for i in idx]),
                                         torch.cat([returns[i] for i in idx]).to(output.device),
                                         critic.config.value_clip)
        micro_masks = [masks[i] for i in idx]
        loss = reduce(per_token, micro_masks)
        return loss, {"value_loss": loss.detach(), "value_clipfrac": reduce(clipfrac, micro_masks)}

    steps = [trainer._train_step(batch, micros, masks, loss_of, model=critic.model, optimizer=critic.optimizer,
                                 pipeline=pipeline) for micros in plan]
    return old_values, steps
