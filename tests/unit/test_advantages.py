"""Advantages: REINFORCE++(-baseline), GAE, whitening; hand-computed values."""

import pytest
import torch

from hpc_rl.training.advantages import (
    compute_advantages,
    gae_advantages_and_returns,
    grpo_advantages,
    masked_whiten,
    ppo_token_rewards,
    reinforce_plus_plus_baseline_advantages,
    reinforce_plus_plus_returns,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def close(a: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    torch.testing.assert_close(a.float(), torch.tensor(expected, dtype=torch.float32), atol=tol, rtol=tol)


def test_grpo_advantages_broadcast() -> None:
    adv = grpo_advantages([0.5, -1.0], [3, 1])
    close(adv[0], [0.5, 0.5, 0.5])
    close(adv[1], [-1.0])


def test_reinforce_plus_plus_returns_hand_values() -> None:
    # token rewards -0.5*kl = [-0.05, -0.1, -0.15]; r=1 on the last TRAINED token (index 1)
    # G2 = -0.15; G1 = 0.9 + 0.9*(-0.15) = 0.765; G0 = -0.05 + 0.9*0.765 = 0.6385
    (g,) = reinforce_plus_plus_returns([1.0], [t(0.1, 0.2, 0.3)], [t(1, 1, 0)], kl_coef=0.5, gamma=0.9)
    close(g, [0.6385, 0.765, -0.15])
    with pytest.raises(ValueError, match="all-zero"):
        reinforce_plus_plus_returns([1.0], [t(0.1)], [t(0)], 0.5, 0.9)


def test_reinforce_plus_plus_baseline_hand_values() -> None:
    (a,) = reinforce_plus_plus_baseline_advantages([0.5], [t(0.2, 0.4)], kl_coef=0.5)
    close(a, [0.4, 0.3])


def test_ppo_token_rewards_and_gae_hand_values() -> None:
    (tr,) = ppo_token_rewards([1.0], [t(0.1, 0.2)], kl_coef=0.5)
    close(tr, [-0.05, 0.9])
    # delta1 = 1 - 0.2 = 0.8; delta0 = 0 + 0.9*0.2 - 0.5 = -0.32; A0 = -0.32 + 0.72*0.8 = 0.256
    (adv,), (ret,) = gae_advantages_and_returns([t(0.0, 1.0)], [t(0.5, 0.2)], gamma=0.9, lambd=0.8)
    close(adv, [0.256, 0.8])
    close(ret, [0.756, 1.0])


def test_masked_whiten_hand_values_and_reduction_hook() -> None:
    # masked [1,2,3]: mean 2, var (14/3 - 4) * 3/2 = 1 -> [-1, 0, 1]; unmasked 100 -> 98
    out = masked_whiten(t(1, 2, 3, 100), t(1, 1, 1, 0))
    close(out, [-1.0, 0.0, 1.0, 98.0], tol=1e-4)
    close(masked_whiten(t(1, 2, 3), t(1, 1, 1), shift_mean=False), [1.0, 2.0, 3.0], tol=1e-4)

    # Two "ranks" holding [1, 2] and [3]: the hook sums their [S1, S2, N] as an all-reduce would.
    other = torch.stack([t(3).sum(), t(9).sum(), t(1).sum()])
    rank0 = masked_whiten(t(1, 2), t(1, 1), all_reduce=lambda s: s + other)
    close(rank0, [-1.0, 0.0], tol=1e-4)
    with pytest.raises(ValueError, match="no token"):
        masked_whiten(t(1.0), t(0))


def test_compute_advantages_dispatch() -> None:
    masks = [t(1, 1), t(1, 1, 1)]
    kl = [t(0.2, 0.4), t(0.0, 0.0, 0.0)]
    adv, ret = compute_advantages("grpo", rewards=[0.5, -0.5], loss_masks=masks, kl=kl, kl_coef=1.0)
    close(adv[0], [0.5, 0.5])  # KL is not folded into GRPO advantages
    close(ret[1], [-0.5, -0.5, -0.5])
    adv, _ = compute_advantages(
        "reinforce_plus_plus_baseline", rewards=[0.5, -0.5], loss_masks=masks, kl=kl, kl_coef=0.5
    )
    close(adv[0], [0.4, 0.3])
    adv, _ = compute_advantages("reinforce_plus_plus", rewards=[1.0, 0.0], loss_masks=masks, gamma=1.0)
    close(adv[0], [1.0, 1.0])
    adv, ret = compute_advantages(
        "ppo", rewards=[1.0, 0.0], loss_masks=masks, values=[t(0, 0), t(0, 0, 0)], gamma=1.0, lambd=1.0
    )
    close(adv[0], [1.0, 1.0])
    adv, _ = compute_advantages("grpo", rewards=[1.0, -1.0], loss_masks=masks, normalize_advantages=True)
    flat = torch.cat(adv)
    assert flat.mean().abs().item() < 1e-6
    with pytest.raises(ValueError, match="values"):
        compute_advantages("ppo", rewards=[1.0], loss_masks=[t(1)])
