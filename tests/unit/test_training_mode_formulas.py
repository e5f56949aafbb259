"""Issue 21: the SFT loss, the on-policy-distillation penalty, GAE and the value loss equal slime's formulas
(slime 624b824a: slime/backends/megatron_utils/loss.py sft_loss_function, apply_opd_kl_to_advantages,
value_loss_function; slime/utils/ppo_utils.py get_advantages_and_returns_batch / vanilla_gae), on fixed
tensors with hand-checked values."""

from __future__ import annotations

import pytest
import torch

from hpc_rl.training.advantages import (
    compute_advantages, gae_advantages_and_returns, opd_penalized_advantages, ppo_token_rewards,
)
from hpc_rl.training.loss_reduction import sum_of_sample_mean
from hpc_rl.training.losses import sft_loss, value_loss


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def close(a: torch.Tensor, expected: list[float] | float, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a.float(), torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=tol)


def test_sft_loss_is_minus_the_reduced_log_probs_of_the_trained_tokens() -> None:
    log_probs = [t(-1.0, -2.0, -4.0), t(-0.5, -1.5)]
    masks = [t(1, 1, 0), t(0, 1)]
    # slime: loss = -sum_of_sample_mean(log_probs): sample means (-1.5) and (-1.5) summed -> 3.0
    loss, metrics = sft_loss(log_probs, masks)
    close(loss, 3.0)
    close(metrics["loss"], 3.0)
    # --calculate-per-token-loss: the masked token sum (-1 - 2 - 1.5) -> 4.5 (divided by the step's tokens later)
    loss, _ = sft_loss(log_probs, masks, per_token=True)
    close(loss, 4.5)
    # gradient only on trained tokens
    leaf = [lp.clone().requires_grad_(True) for lp in log_probs]
    sft_loss(leaf, masks)[0].backward()
    close(leaf[0].grad, [-0.5, -0.5, 0.0])
    close(leaf[1].grad, [0.0, -1.0])


def test_opd_penalty_is_the_reverse_kl_to_the_teacher_times_its_coefficient() -> None:
    advantages = [t(0.5, 0.5), t(-1.0)]
    student, teacher = [t(-0.2, -1.0), t(-3.0)], [t(-0.5, -0.25), t(-1.0)]
    penalized, kl = opd_penalized_advantages(advantages, student, teacher, opd_kl_coef=2.0)
    close(kl[0], [0.3, -0.75])
    close(penalized[0], [0.5 - 0.6, 0.5 + 1.5])
    close(penalized[1], [-1.0 + 4.0])
    with pytest.raises(ValueError, match="teacher log-probs"):
        opd_penalized_advantages([t(0.0, 0.0)], [t(0.0, 0.0)], [t(0.0)], 1.0)


def test_opd_is_orthogonal_to_the_estimator_and_comes_before_whitening() -> None:
    masks = [t(1, 1), t(1)]
    student, teacher = [t(-0.2, -1.0), t(-3.0)], [t(-0.5, -0.25), t(-1.0)]
    plain, returns = compute_advantages("grpo", rewards=[0.5, -1.0], loss_masks=masks)
    with_opd, opd_returns = compute_advantages("grpo", rewards=[0.5, -1.0], loss_masks=masks,
                                               student_log_probs=student, teacher_log_probs=teacher, opd_kl_coef=1.0)
    close(with_opd[0], [0.5 - 0.3, 0.5 + 0.75])
    close(with_opd[1], [-1.0 + 2.0])
    close(opd_returns[0], returns[0])  # slime changes the advantages only
    # normalize_advantages whitens the penalized values: [0.2, 1.25, 1.0] -> mean 0.81667, unbiased std
    whitened, _ = compute_advantages("grpo", rewards=[0.5, -1.0], loss_masks=masks, normalize_advantages=True,
                                     student_log_probs=student, teacher_log_probs=teacher, opd_kl_coef=1.0)
    values = torch.tensor([0.2, 1.25, 1.0])
    expected = (values - values.mean()) / torch.sqrt(values.var(unbiased=True) + 1e-8)
    close(torch.cat(whitened), expected.tolist(), tol=1e-4)


def _slime_batched_gae(rewards: list[torch.Tensor], values: list[torch.Tensor], gamma: float,
                       lambd: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """slime's get_advantages_and_returns_batch (CP 1): pad to the longest response, vanilla_gae over the
    padded rows (the next value after a row's last column is 0; padded columns hold 0 reward and value)."""
    width = max(r.numel() for r in rewards)
    padded_r = torch.zeros(len(rewards), width)
    padded_v = torch.zeros(len(rewards), width)
    for i, (r, v) in enumerate(zip(rewards, values)):
        padded_r[i, : r.numel()], padded_v[i, : v.numel()] = r, v
    last = torch.zeros(len(rewards))
    reversed_adv = []
    for col in reversed(range(width)):
        next_value = padded_v[:, col + 1] if col < width - 1 else 0.0
        delta = padded_r[:, col] + gamma * next_value - padded_v[:, col]
        last = delta + gamma * lambd * last
        reversed_adv.append(last)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + padded_v
    return ([advantages[i, : r.numel()] for i, r in enumerate(rewards)],
            [returns[i, : r.numel()] for i, r in enumerate(rewards)])


def test_gae_equals_slimes_batched_gae_on_responses_of_different_lengths() -> None:
    values = [t(0.5, 0.2, -0.1, 0.3), t(0.4), t(0.1, 0.9)]
    kl = [t(0.1, 0.2, 0.0, 0.05), t(0.3), t(-0.2, 0.1)]
    token_rewards = ppo_token_rewards([1.0, -1.0, 0.5], kl, kl_coef=0.1)
    ours_adv, ours_ret = gae_advantages_and_returns(token_rewards, values, gamma=0.95, lambd=0.9)
    slime_adv, slime_ret = _slime_batched_gae(token_rewards, values, gamma=0.95, lambd=0.9)
    for a, b in zip(ours_adv + ours_ret, slime_adv + slime_ret):
        close(a, b.tolist())
    # one hand value: the one-token response: A = r + 0 - V = (-1 - 0.1 * 0.3) - 0.4
    close(ours_adv[1], [-1.43])


def test_ppo_advantages_use_the_critic_values_then_the_opd_penalty() -> None:
    values = [t(0.5, 0.2)]
    masks = [t(1, 1)]
    advantages, returns = compute_advantages("ppo", rewards=[1.0], loss_masks=masks, values=values, gamma=1.0,
                                             lambd=1.0)
    # rewards [0, 1]: A1 = 1 - 0.2 = 0.8, A0 = (0 + 0.2 - 0.5) + 0.8 = 0.5; returns = A + V = [1, 1]
    close(advantages[0], [0.5, 0.8])
    close(returns[0], [1.0, 1.0])
    penalized, same_returns = compute_advantages("ppo", rewards=[1.0], loss_masks=masks, values=values,
                                                 student_log_probs=[t(-1.0, -1.0)],
                                                 teacher_log_probs=[t(-2.0, -0.5)], opd_kl_coef=0.5)
    close(penalized[0], [0.5 - 0.5, 0.8 + 0.25])
    close(same_returns[0], [1.0, 1.0])


def test_value_loss_is_slimes_clipped_squared_error() -> None:
    new, old, returns = t(1.0, 0.0, 0.5), t(0.5, 0.1, 0.5), t(2.0, -1.0, 0.0)
    loss, clipfrac = value_loss(new, old, returns, value_clip=0.2)
    # token 0: clipped V = 0.7 -> (0.7-2)^2 = 1.69 vs (1-2)^2 = 1: max 1.69; |1-0.5| > 0.2 -> clipped
    # token 1: clipped V = 0.0 (|-0.1| <= 0.2) -> 1.0 both; token 2: 0.25 both
    close(loss, [1.69, 1.0, 0.25])
    close(clipfrac, [1.0, 0.0, 0.0])
    # reduced as slime: sum_of_sample_mean over the masked tokens (no 1/2 factor)
    close(sum_of_sample_mean(loss, [t(1, 1), t(0)]), 1.345)
    # the gradient of the unclipped branch: d/dV (V - R)^2 = 2 (V - R) where it is the max
    leaf = new.clone().requires_grad_(True)
    value_loss(leaf, old, returns, value_clip=0.2)[0].sum().backward()
    close(leaf.grad, [0.0, 2.0, 1.0])
