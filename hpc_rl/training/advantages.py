"""Rewards -> per-token advantages and returns, as pure torch functions (slime's estimators).

Owns: the per-token advantages of grpo/gspo/cispo, REINFORCE++ discounted returns, REINFORCE++-baseline,
PPO's token rewards and GAE(gamma, lambda), the on-policy-distillation penalty, masked whitening
(``--normalize-advantages``) and the :func:`compute_advantages` dispatcher.

Does not own: group reward normalisation (GRPO, Dr.GRPO, REINFORCE++-baseline: the controller's
``controller.train_batches.group_normalized_rewards``, which needs whole groups), the KL between
policy and reference (``losses.approx_kl``), collectives (whitening
takes an optional ``all_reduce`` hook; the DP(+CP) group is the caller's), or context-parallel
gathering (every function here sees each sample's FULL response).

Per-sample tensors are 1-D over the sample's response tokens; ``loss_masks`` mark trained tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from hpc_rl.config.sections.algorithm import ADVANTAGE_ESTIMATORS

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "compute_advantages",
    "gae_advantages_and_returns",
    "grpo_advantages",
    "masked_whiten",
    "opd_penalized_advantages",
    "ppo_token_rewards",
    "reinforce_plus_plus_baseline_advantages",
    "reinforce_plus_plus_returns",
]

_STD_NORMALIZED = ("grpo", "gspo", "cispo")


def grpo_advantages(rewards: Tensor | Sequence[float], response_lengths: Sequence[int]) -> list[Tensor]:
    """grpo/gspo/cispo: A_t = r~_i on every response token of sample i (KL is not folded in)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    lengths = [int(n) for n in response_lengths]
    return list(r.repeat_interleave(torch.tensor(lengths, dtype=torch.long)).split(lengths))


def reinforce_plus_plus_returns(
    rewards: Tensor | Sequence[float],
    kl: Sequence[Tensor],
    loss_masks: Sequence[Tensor],
    kl_coef: float,
    gamma: float,
) -> list[Tensor]:
    """REINFORCE++: G_t = sum_{s >= t} gamma^(s - t) * rew_s, with rew_s = -kl_coef * kl_s, plus the
    scalar reward r on the LAST token whose loss mask is 1. Advantage = G (before whitening).

    Raises if a sample has no trained token.
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    out = []
    for i, (k, m) in enumerate(zip(kl, loss_masks, strict=True)):
        token_rewards = -kl_coef * k.float()
        nz = torch.nonzero(m, as_tuple=True)[0]
        if nz.numel() == 0:
            raise ValueError(f"sample {i} has an all-zero loss mask; REINFORCE++ needs a last trained token")
        token_rewards[nz[-1]] += r[i]
        returns = torch.empty_like(token_rewards)
        running = torch.zeros((), dtype=token_rewards.dtype)
        for t in range(token_rewards.numel() - 1, -1, -1):
            running = token_rewards[t] + gamma * running
            returns[t] = running
        out.append(returns)
    return out


def reinforce_plus_plus_baseline_advantages(
    centered_rewards: Tensor | Sequence[float], kl: Sequence[Tensor], kl_coef: float
) -> list[Tensor]:
    """REINFORCE++-baseline: A_t = (r - mean_group) - kl_coef * kl_t.

    ``centered_rewards`` are already group-mean-centred (the controller's ``group_normalized_rewards``
    with estimator="reinforce_plus_plus_baseline"); no discounting.
    """
    r = torch.as_tensor(centered_rewards, dtype=torch.float32).flatten()
    return [float(r[i]) - kl_coef * k.float() for i, k in enumerate(kl)]


def ppo_token_rewards(
    rewards: Tensor | Sequence[float], kl: Sequence[Tensor], kl_coef: float
) -> list[Tensor]:
    """PPO token rewards: rew_t = -kl_coef * kl_t, plus r on the response's LAST token (index -1,
    regardless of the loss mask, as slime does; REINFORCE++ instead uses the last trained token)."""
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    out = []
    for i, k in enumerate(kl):
        tr = -kl_coef * k.float()
        if tr.numel():
            tr[-1] += r[i]
        out.append(tr)
    return out


def gae_advantages_and_returns(
    token_rewards: Sequence[Tensor], values: Sequence[Tensor], gamma: float, lambd: float
) -> tuple[list[Tensor], list[Tensor]]:
    """GAE(gamma, lambda) per sample, with V after the last token = 0.

    delta_t = rew_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lambda * A_{t+1};
    returns_t = A_t + V_t. Computed without gradient (advantages and returns are targets).
    """
    advs, rets = [], []
    with torch.no_grad():
        for rew, v in zip(token_rewards, values, strict=True):
            rew = rew.float()
            v = v.float()
            next_v = torch.cat([v[1:], v.new_zeros(1)]) if v.numel() else v
            delta = rew + gamma * next_v - v
            adv = torch.empty_like(delta)
            acc = torch.zeros((), dtype=delta.dtype)
            for t in range(delta.numel() - 1, -1, -1):
                acc = delta[t] + gamma * lambd * acc
                adv[t] = acc
            advs.append(adv)
            rets.append(adv + v)
    return advs, rets


def opd_penalized_advantages(advantages: Sequence[Tensor], student_log_probs: Sequence[Tensor],
                             teacher_log_probs: Sequence[Tensor], opd_kl_coef: float) -> tuple[list[Tensor], list[Tensor]]:
    """On-policy distillation (slime's apply_opd_kl_to_advantages): per token, the reverse-KL sample
    k_t = logp_student_t - logp_teacher_t, and A_t - opd_kl_coef * k_t, whatever estimator made A.
    The student's log-probs are the old ones (recomputed, or the rollout's with use_rollout_logprobs).
    Returns (advantages, reverse_kl); whitening (normalize_advantages) comes after, as in slime."""
    penalized, reverse_kl = [], []
    for i, (adv, student, teacher) in enumerate(zip(advantages, student_log_probs, teacher_log_probs, strict=True)):
        if student.shape != teacher.shape:
            raise ValueError(f"sample {i}: {teacher.numel()} teacher log-probs for {student.numel()} response tokens")
        kl = student.float() - teacher.float().to(student.device)
        penalized.append(adv - opd_kl_coef * kl)
        reverse_kl.append(kl)
    return penalized, reverse_kl


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    *,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """Whiten ``values`` with the mean/variance of the masked entries (``--normalize-advantages``).

    S1 = sum m x, S2 = sum m x^2, N = sum m (summed over ranks by ``all_reduce``, which receives the
    float32 tensor [S1, S2, N] and returns its sum over the DP(+CP) group; None = this rank only).
    mean = S1/N; var = S2/N - mean^2, times N/(N-1) when N >= 2 (unbiased);
    out = (x - mean) / sqrt(var + eps), plus mean again if ``shift_mean`` is False.
    Every entry is transformed (masked-out ones too). Raises if N == 0 after the reduction.
    """
    x = values.float()
    m = mask.to(torch.float32)
    stats = torch.stack([(x * m).sum(), (x.square() * m).sum(), m.sum()])
    if all_reduce is not None:
        stats = all_reduce(stats)
    s1, s2, n = (float(v) for v in stats)
    if n == 0:
        raise ValueError("masked_whiten: the mask selects no token (on any rank)")
    mean = s1 / n
    var = s2 / n - mean * mean
    if n >= 2:
        var = var * n / (n - 1)
    out = (x - mean) * torch.rsqrt(torch.tensor(var + eps))
    return out if shift_mean else out + mean


def compute_advantages(
    estimator: str,
    *,
    rewards: Tensor | Sequence[float],
    loss_masks: Sequence[Tensor],
    kl: Sequence[Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
    values: Sequence[Tensor] | None = None,
    normalize_advantages: bool = False,
    all_reduce: Callable[[Tensor], Tensor] | None = None,
    student_log_probs: Sequence[Tensor] | None = None,
    teacher_log_probs: Sequence[Tensor] | None = None,
    opd_kl_coef: float = 0.0,
) -> tuple[list[Tensor], list[Tensor]]:
    """Per-sample (advantages, returns) for one of slime's estimators.

    ``rewards`` are the scalars AFTER the controller's group normalisation (the rollout side normalises;
    REINFORCE++-baseline expects centred rewards). ``kl`` is the per-token KL(pi_old || pi_ref)
    used for reward shaping (``--kl-coef``, estimator ``--kl-loss-type``); None -> zeros.
      grpo/gspo/cispo: A = returns = r~ broadcast;  reinforce_plus_plus: A = returns = G;
      reinforce_plus_plus_baseline: A = returns = r~ - kl_coef * kl;
      ppo: GAE on ppo_token_rewards with ``values`` (returns = A + V).
    With ``teacher_log_probs`` (on-policy distillation), A gets :func:`opd_penalized_advantages` against
    ``student_log_probs``; returns are left as the estimator made them (slime's order).
    ``normalize_advantages`` then whitens A over all trained tokens (see :func:`masked_whiten`).
    """
    if kl is None and estimator not in _STD_NORMALIZED:  # only the estimators that shape with KL read it
        kl = [torch.zeros(m.numel()) for m in loss_masks]
    if estimator in _STD_NORMALIZED:
        advantages = grpo_advantages(rewards, [m.numel() for m in loss_masks])
        returns = advantages
    elif estimator == "reinforce_plus_plus":
        advantages = reinforce_plus_plus_returns(rewards, kl, loss_masks, kl_coef, gamma)
        returns = advantages
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = reinforce_plus_plus_baseline_advantages(rewards, kl, kl_coef)
        returns = advantages
    elif estimator == "ppo":
        if values is None:
            raise ValueError("estimator 'ppo' needs the critic's values")
        advantages, returns = gae_advantages_and_returns(
            ppo_token_rewards(rewards, kl, kl_coef), values, gamma, lambd
        )
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {ADVANTAGE_ESTIMATORS}")

    if teacher_log_probs is not None:
        if student_log_probs is None:
            raise ValueError("on-policy distillation needs the student's log-probs")
        advantages, _ = opd_penalized_advantages(advantages, student_log_probs, teacher_log_probs, opd_kl_coef)

    if normalize_advantages and advantages:
        flat = masked_whiten(torch.cat(advantages), torch.cat(list(loss_masks)), all_reduce=all_reduce)
        advantages = list(flat.split([a.numel() for a in advantages]))
    return advantages, returns

