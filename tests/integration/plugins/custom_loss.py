"""Custom loss and advantage functions with slime's signatures, for tests/integration/test_custom_loss_step.py.

`reward_advantages` gives every response token its sample's reward (GRPO's broadcast) times ADVANTAGE_SCALE;
`unclipped_surrogate` is PPO's surrogate without the clip: -A * exp(logp - logp_old). On a first step
(logp == logp_old, nothing clipped) the pair trains exactly like the built-in GRPO loss with advantages
scaled by ADVANTAGE_SCALE.
"""

from __future__ import annotations

import torch

ADVANTAGE_SCALE = 2.0
CALLS = {"loss": 0, "advantages": 0}


def reward_advantages(args, rollout_data):
    CALLS["advantages"] += 1
    assert args.loss_type == "custom_loss"  # slime's flat args
    rollout_data["advantages"] = [torch.full_like(mask, ADVANTAGE_SCALE * float(reward))
                                  for reward, mask in zip(rollout_data["rewards"], rollout_data["loss_masks"])]
    rollout_data["returns"] = [a.clone() for a in rollout_data["advantages"]]


def unclipped_surrogate(args, batch, logits, sum_of_sample_mean):
    CALLS["loss"] += 1
    log_probs = torch.cat(batch["current_log_probs"])
    old = torch.cat(batch["log_probs"])
    advantages = torch.cat(batch["advantages"])
    loss = sum_of_sample_mean(-advantages * torch.exp(log_probs - old))
    return loss, {"loss": loss.detach(), "custom_calls": torch.tensor(float(CALLS["loss"]))}
