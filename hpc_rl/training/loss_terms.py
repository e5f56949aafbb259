"""The per-token terms a policy loss adds or weighs by: KL estimators, entropy, TIS, OPSM and score centering.

Owns: the KL estimators k1/k2/k3/low_var_kl (unbiased with an importance ratio; the allowed names are
`hpc_rl.config.sections.algorithm.KL_TYPES`), entropy and log-probs from (unsharded) logits, truncated importance
sampling weights for the train/inference mismatch, off-policy sequence masking (slime's --use-opsm) and score
centering's head correction. Pure torch on plain tensors, slime's conventions (see `hpc_rl.training.losses`);
`losses.policy_loss_and_metrics` assembles them into a micro-batch's loss. Users' custom losses reach these
through `hpc_rl.training.losses` (its `__all__`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hpc_rl.config.sections.algorithm import KL_TYPES
from hpc_rl.training.loss_reduction import PerSample


def approx_kl(
    log_probs: Tensor, ref_log_probs: Tensor, kl_type: str, importance_ratio: Tensor | None = None
) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate (Schulman's k1/k2/k3), computed in float32.

    With ``d = log_probs - ref_log_probs``:
      k1 = d;  k2 = d^2 / 2;  k3 = low_var_kl = exp(-d) - (-d) - 1  (>= 0, unbiased, low variance).
    ``importance_ratio`` (pi/pi_old, slime's ``--use-unbiased-kl``) multiplies the estimate.
    Only ``low_var_kl`` is then clamped to [-10, 10]; ``k3`` is the same formula unclamped (as in slime).
    No clamp is applied to the log-ratio itself.
    """
    d = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        kl = d
    elif kl_type == "k2":
        kl = 0.5 * d.square()
    elif kl_type in ("k3", "low_var_kl"):
        kl = torch.expm1(-d) + d  # exp(-d) - 1 + d, without cancellation near d = 0
    else:
        raise ValueError(f"unknown kl_type {kl_type!r}; expected one of {KL_TYPES}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_type == "low_var_kl":
        kl = kl.clamp(-10.0, 10.0)
    return kl


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy of softmax(logits) over the last dim: H = -sum_v p_v log p_v.

    Stable for large logits (via log_softmax). With a vocab-parallel (TP-sharded) last dim this is
    NOT the entropy: the caller must all-reduce max, sum-exp and sum(p*z) over the TP group
    (H = max + log(sum exp(z - max)) - sum(p * z)), as Megatron trainers do.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def log_probs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(token) under softmax(logits): ``log_softmax(logits)[..., token]`` (no TP sharding)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def tis_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling for the train/inference mismatch.

    w_t = clamp(exp(logp_old - logp_rollout), clip_low, clip_high), with no gradient (the policy
    loss is multiplied by it). Per-token metrics: ``tis`` (unclamped ratio), ``tis_clipfrac``
    (1.0 where clamped), ``tis_abs`` = |ratio - 1|.
    """
    with torch.no_grad():
        ratio = torch.exp(old_log_probs.float() - rollout_log_probs.float())
        w = ratio.clamp(clip_low, clip_high)
        metrics = {"tis": ratio, "tis_clipfrac": (w != ratio).float(), "tis_abs": (ratio - 1.0).abs()}
    return w, metrics


def score_centering_correction(
    train_head_log_probs: Tensor, sampler_head_log_probs: Tensor, *, clip_low: float | None = None,
    clip_high: float | None = None, eps: float = 1e-6, unweighted: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The head term of score centering (arXiv:2609.20807 eqs. 9, 12, 14, as slime's later main uses it).

    Inputs are [tokens, k] log-probs of the sampler's top-k tokens at each position, normalized over the
    whole vocabulary: ``train_head_log_probs`` (log p, the trainer's; the only input with a gradient) and
    ``sampler_head_log_probs`` (log q, the engine's). With head masses P = sum_k p, Q = sum_k q, the tail
    ratio rho = max(1 - Q, eps) / max(1 - P, eps), the importance weight IS(r) = clamp(r, clip_low,
    clip_high) (identity when both are None: no TIS), alpha = rho * IS(1 / rho) and w_k = IS(p_k / q_k):

        correction_t = sum_k (q_k * w_k - alpha * p_k) * log p_k        (the bracket without gradient)

    ``unweighted``: the sampled token's score carries no importance weight (REINFORCE without TIS), so neither
    does its expectation: w_k = 1 and alpha = rho, correction_t = sum_k (q_k - rho * p_k) * log p_k. (With the
    identity IS the head term vanishes exactly: E_q[(p / q) grad log p] = E_p[grad log p] = 0.)

    Returns (correction [tokens], Q [tokens], P [tokens]); Q and P are detached. The correction estimates the
    sampler's expected (importance-weighted) score E_q[w grad log p] on the head, the tail taken proportional to
    the trainer's; :func:`policy_loss_and_metrics` subtracts it from each token's score (``score_centering``).
    """
    def importance(ratio: Tensor) -> Tensor:
        if clip_low is None and clip_high is None:
            return ratio
        return ratio.clamp(0.0 if clip_low is None else clip_low, clip_high)

    with torch.no_grad():
        p, q = train_head_log_probs.float().exp(), sampler_head_log_probs.float().exp()
        p_mass, q_mass = p.sum(-1), q.sum(-1)
        rho = (1.0 - q_mass).clamp_min(eps) / (1.0 - p_mass).clamp_min(eps)
        if unweighted:
            alpha, sampled = rho, q
        else:
            alpha = rho * importance(rho.reciprocal())
            weights = importance((train_head_log_probs.float() - sampler_head_log_probs.float()).exp())
            sampled = torch.where(q > 0, q * weights, torch.zeros_like(q))  # a -inf sampler entry: 0, not 0 * inf
        residual = sampled - alpha.unsqueeze(-1) * p
    return (residual * train_head_log_probs).sum(-1), q_mass, p_mass


def opsm_mask(log_probs: PerSample, old_log_probs: PerSample, advantages: PerSample, loss_masks: PerSample,
              delta: float) -> tuple[Tensor, Tensor]:
    """Off-policy sequence masking (slime's --use-opsm): a token with a negative advantage in a sample whose
    masked mean (logp_old - logp) exceeds `delta` gets no policy loss. Returns (keep, masked), both per token
    and concatenated: keep = 1 - masked. Needs each sample's full response (as GSPO); no gradient."""
    masked = []
    with torch.no_grad():
        for lp, old, adv, m in zip(log_probs, old_log_probs, advantages, loss_masks, strict=True):
            m = m.to(lp.dtype)
            sequence_kl = ((old - lp) * m).sum() / m.sum().clamp_min(1)
            masked.append(((adv < 0) & (sequence_kl > delta)).to(lp.dtype))
    flat = torch.cat(masked) if masked else torch.zeros(0)
    return 1.0 - flat, flat
