"""A custom loss (slime's signature) that turns NaN from the 2nd rollout on: what a numerical blow-up (an
overflow, a division by zero in a user's loss) looks like to the trainer. Before that it is the plain
policy-gradient surrogate."""

from __future__ import annotations

import torch

calls = 0


def loss(args, batch, logits, sum_of_sample_mean):
    global calls
    calls += 1
    log_probs = torch.cat(batch["current_log_probs"])
    value = sum_of_sample_mean(-torch.cat(batch["advantages"]) * torch.exp(log_probs - log_probs.detach()))
    if calls > 1:
        value = value * float("nan")
    return value, {"loss": value.detach()}
