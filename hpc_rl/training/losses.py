"""Policy-gradient losses and the total loss of one micro-batch, as pure torch functions.

Owns: the per-token policy losses slime uses (PPO clip with clip-higher and dual clip, GSPO, CISPO, REINFORCE),
SFT's and the critic's value loss, the loss knobs (`PolicyLossConfig`), and :func:`policy_loss_and_metrics`,
which assembles the total loss of one micro-batch (TIS and a custom TIS function's hook, OPSM, the KL loss,
entropy, score centering). The terms it adds or weighs by (KL estimators, entropy, TIS weights, OPSM, score
centering) are `loss_terms`'; the reducers and the step's loss scale are `loss_reduction`'.

Does not own: computing log-probs through Megatron (vocab-parallel gather, context parallelism),
all-reduces, or advantages (see ``advantages.py``). Everything here runs on plain tensors, so users
can call it from custom losses and tests run without processes: `__all__` is the public surface for users'
custom losses and keeps the names of `loss_terms` and `loss_reduction` importable from here (their import path
before the split), so plug-ins written against `hpc_rl.training.losses` keep working.

Conventions (slime's): ``log_probs`` = current policy, ``old_log_probs`` = policy that produced the
advantages' data (recomputed by the trainer, or the rollout's with ``--use-rollout-logprobs``),
``ppo_kl = old_log_probs - log_probs`` (so ``ratio = exp(-ppo_kl)``). Losses are to be minimised.
Per-token tensors of a micro-batch are 1-D: the samples' response tokens concatenated; the
per-sample ``loss_masks`` (1 = trained token) give each sample's length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from hpc_rl.config.sections.algorithm import KL_TYPES
from hpc_rl.training.loss_reduction import (
    PerSample, masked_token_mean, step_loss_scale, sum_of_sample_mean, sum_of_tokens,
)
from hpc_rl.training.loss_terms import (
    approx_kl, entropy_from_logits, log_probs_from_logits, opsm_mask, score_centering_correction, tis_weights,
)

__all__ = [
    "KL_TYPES",
    "POLICY_LOSS_TYPES",
    "PolicyLossConfig",
    "approx_kl",
    "cispo_loss",
    "clipped_surrogate",
    "entropy_from_logits",
    "gspo_policy_loss",
    "gspo_ppo_kl",
    "log_probs_from_logits",
    "masked_token_mean",
    "opsm_mask",
    "policy_loss",
    "policy_loss_and_metrics",
    "policy_loss_type_for",
    "score_centering_correction",
    "reinforce_loss",
    "sft_loss",
    "step_loss_scale",
    "sum_of_sample_mean",
    "sum_of_tokens",
    "tis_weights",
    "value_loss",
]

POLICY_LOSS_TYPES = ("ppo", "gspo", "cispo", "reinforce")
TisFunction = Callable[..., tuple[Tensor, PerSample, dict[str, Tensor]]]
"""slime's `--custom-tis-function-path`, called as fn(pg_loss=, train_log_probs=, rollout_log_probs=, loss_masks=)
(the caller binds args, total_lengths and response_lengths); returns (pg_loss, loss_masks, per-token metrics)."""


# ---------------------------------------------------------------------------------------------
# Policy-gradient losses (per token)
# ---------------------------------------------------------------------------------------------


def clipped_surrogate(
    ppo_kl: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate from the log-ratio ``ppo_kl = logp_old - logp``; returns (loss, clipfrac).

    ratio = exp(-ppo_kl);  L = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_high));
    clipfrac = 1.0 where the clipped term is strictly larger (the clip is active), else 0.0.
    Dual clip (eps_clip_c > 1): where A < 0, L = min(L, -eps_clip_c * A) (bounds the loss of very
    large ratios on negative advantages).
    """
    ratio = torch.exp(-ppo_kl)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        if not eps_clip_c > 1.0:
            raise ValueError(f"eps_clip_c (dual clip) must be > 1.0, got {eps_clip_c}")
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, clipfrac


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss and clipfrac with ratio = exp(log_probs - old_log_probs).

    L_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_clip, 1 + eps_clip_high)); dual clip for A_t < 0
    when ``eps_clip_c`` is given: L_t = min(L_t, -eps_clip_c * A_t). See :func:`clipped_surrogate`.
    """
    return clipped_surrogate(old_log_probs - log_probs, advantages, eps_clip, eps_clip_high, eps_clip_c)


def gspo_ppo_kl(log_probs: PerSample, old_log_probs: PerSample, loss_masks: PerSample) -> Tensor:
    """GSPO's sequence-level log-ratio, broadcast to tokens and concatenated.

    For sample i: s_i = sum_t m_t (logp_old - logp)_t / max(sum_t m_t, 1), repeated on each of its
    tokens (the negative log of the geometric-mean sequence ratio). Needs each sample's FULL
    response: with context parallelism the caller gathers the sequence first.
    """
    parts = []
    for lp, old, m in zip(log_probs, old_log_probs, loss_masks, strict=True):
        m = m.to(lp.dtype)
        s = ((old - lp) * m).sum() / m.sum().clamp_min(1)
        parts.append(s.expand_as(lp))
    return torch.cat(parts) if parts else torch.zeros(0)


def gspo_policy_loss(
    log_probs: PerSample,
    old_log_probs: PerSample,
    advantages: Tensor,
    loss_masks: PerSample,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """GSPO: the PPO clipped surrogate on the sequence-level ratio exp(-s_i) (see :func:`gspo_ppo_kl`).

    ``advantages`` is the concatenated per-token tensor; returns concatenated (loss, clipfrac).
    """
    return clipped_surrogate(
        gspo_ppo_kl(log_probs, old_log_probs, loss_masks), advantages, eps_clip, eps_clip_high, eps_clip_c
    )


def cispo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1): L_t = -stopgrad(clip(r_t, 1 - eps_clip, 1 + eps_clip_high)) * A_t * logp_t.

    The gradient flows only through ``log_probs`` (so clipped tokens still get one, scaled by the
    truncated ratio). clipfrac = 1.0 where the clip changed the ratio. Canonical CISPO has no lower
    bound: pass ``eps_clip >= 1``.
    """
    ratio = torch.exp(log_probs - old_log_probs)
    truncated = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = -truncated.detach() * advantages * log_probs
    return loss, (truncated != ratio).float()


def reinforce_loss(log_probs: Tensor, advantages: Tensor) -> tuple[Tensor, Tensor]:
    """Plain policy gradient: L_t = -stopgrad(A_t) * logp_t; clipfrac is all zeros."""
    return -advantages.detach() * log_probs, torch.zeros_like(log_probs)


def sft_loss(log_probs: PerSample, loss_masks: PerSample, *, per_token: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    """SFT (slime's sft_loss): loss = -R(log p(token)) over the trained (assistant) tokens, R the step's reducer
    (:func:`sum_of_sample_mean`, or :func:`sum_of_tokens` with ``per_token``); metrics: ``loss``."""
    reduce = sum_of_tokens if per_token else sum_of_sample_mean
    loss = -reduce(torch.cat(list(log_probs)) if len(log_probs) else torch.zeros(0), loss_masks)
    return loss, {"loss": loss.detach()}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss per token (slime's value_loss_function, no 1/2 factor): with
    V_clip = V_old + clamp(V - V_old, -value_clip, value_clip), L_t = max((V_clip - R)^2, (V - R)^2);
    clipfrac = 1.0 where |V - V_old| > value_clip. Reduce both with the step's reducer."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = torch.maximum((clipped - returns).square(), (values - returns).square())
    return loss, ((values - old_values).abs() > value_clip).float()


# ---------------------------------------------------------------------------------------------
# Total loss of one micro-batch
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class PolicyLossConfig:
    """The knobs of slime's policy loss (one field per flag; names follow slime's flags)."""

    policy_loss_type: Literal["ppo", "gspo", "cispo", "reinforce"] = "ppo"
    """Per-token loss: ppo (clip), gspo (sequence ratio), cispo, reinforce. See policy_loss_type_for."""
    eps_clip: float = 0.2
    """--eps-clip: lower clip, ratio >= 1 - eps_clip."""
    eps_clip_high: float | None = None
    """--eps-clip-high: upper clip, ratio <= 1 + eps_clip_high; None -> eps_clip."""
    eps_clip_c: float | None = None
    """--eps-clip-c: dual-clip bound (> 1) for negative advantages; None -> off."""
    entropy_coef: float = 0.0
    """--entropy-coef: loss -= entropy_coef * entropy."""
    use_kl_loss: bool = False
    """--use-kl-loss: add kl_loss_coef * KL(pi || pi_ref) (needs ref_log_probs)."""
    kl_loss_coef: float = 0.0
    """--kl-loss-coef."""
    kl_loss_type: str = "k1"
    """--kl-loss-type: k1, k2, k3 or low_var_kl."""
    use_unbiased_kl: bool = False
    """--use-unbiased-kl: weight the KL estimate by exp(logp - logp_old)."""
    use_tis: bool = False
    """--use-tis: multiply the pg loss by clamp(exp(logp_old - logp_rollout), tis_clip_low, tis_clip)."""
    get_mismatch_metrics: bool = False
    """--get-mismatch-metrics: run the TIS function (the custom one) for its train/rollout mismatch metrics."""
    use_opsm: bool = False
    """--use-opsm: off-policy sequence masking (see opsm_mask)."""
    opsm_delta: float = 1e-4
    """--opsm-delta: the sequence-level log-ratio above which OPSM masks negative-advantage tokens."""
    tis_clip: float = 2.0
    """--tis-clip: upper TIS clamp."""
    tis_clip_low: float = 0.0
    """--tis-clip-low: lower TIS clamp."""
    calculate_per_token_loss: bool = False
    """--calculate-per-token-loss: reduce with sum_of_tokens instead of sum_of_sample_mean."""

    def __post_init__(self) -> None:
        if self.policy_loss_type not in POLICY_LOSS_TYPES:
            raise ValueError(f"policy_loss_type {self.policy_loss_type!r} not in {POLICY_LOSS_TYPES}")
        if self.kl_loss_type not in KL_TYPES:
            raise ValueError(f"kl_loss_type {self.kl_loss_type!r} not in {KL_TYPES}")
        if self.eps_clip_c is not None and not self.eps_clip_c > 1.0:
            raise ValueError(f"eps_clip_c must be > 1.0 (dual clip), got {self.eps_clip_c}")
        if self.tis_clip_low > self.tis_clip:
            raise ValueError(f"tis_clip_low ({self.tis_clip_low}) > tis_clip ({self.tis_clip})")

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def policy_loss_type_for(advantage_estimator: str, *, cispo: bool = False, pg_loss_type: str | None = None) -> str:
    """slime's mapping: --pg-loss-type reinforce -> "reinforce"; else gspo -> "gspo"; cispo -> "cispo";
    everything else -> "ppo" (--pg-loss-type ppo, or unset, keeps the estimator's clipped objective)."""
    if pg_loss_type == "reinforce":
        return "reinforce"
    if pg_loss_type not in (None, "ppo"):
        raise ValueError(f"pg_loss_type {pg_loss_type!r} is not ppo or reinforce")
    if cispo or advantage_estimator == "cispo":
        return "cispo"
    return "gspo" if advantage_estimator == "gspo" else "ppo"


def policy_loss_and_metrics(
    config: PolicyLossConfig,
    *,
    log_probs: PerSample,
    old_log_probs: PerSample | None,
    advantages: PerSample,
    loss_masks: PerSample,
    entropy: PerSample | None = None,
    ref_log_probs: PerSample | None = None,
    rollout_log_probs: PerSample | None = None,
    train_log_probs: PerSample | None = None,
    tis_function: TisFunction | None = None,
    score_centering: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Total loss of one micro-batch and its metrics, from per-sample tensors.

    loss = R(pg_loss) - entropy_coef * R(entropy) + kl_loss_coef * R(KL(logp, logp_ref))
    where R is :func:`sum_of_sample_mean` (or :func:`sum_of_tokens` with calculate_per_token_loss)
    over this micro-batch's samples. The caller multiplies ``loss`` by :func:`step_loss_scale` (or
    divides per-token sums by the step's token count) before backward.

    ``old_log_probs=None`` means on-policy (logp_old = logp.detach()). With ``use_tis``,
    ``rollout_log_probs`` is required and w = clamp(exp(logp_old - logp_rollout)) multiplies pg_loss; a
    ``tis_function`` (slime's custom TIS, also run by ``get_mismatch_metrics``) replaces that weighting: it
    returns the weighted pg loss, the loss masks its numerator keeps (denominators stay the original
    masks', as slime's) and per-token metrics. ``train_log_probs``: the trainer's own old log-probs for TIS
    (default: old_log_probs). With ``use_opsm`` the pg loss of masked tokens is dropped (opsm_mask).

    Metrics are detached and reduced with the same R, so they are SUMS over this micro-batch's
    samples: divide the step's sum by global_batch_size (or tokens) to log means. Keys (slime's):
    loss, pg_loss, pg_clipfrac, ppo_kl (= R(logp_old - logp)), entropy_loss, kl_loss (with
    use_kl_loss), ois, tis, tis_clipfrac, tis_abs (with use_tis; a tis_function's own keys), opsm_clipfrac
    (with use_opsm), train_rollout_logprob_abs_diff
    (= R|logp_old - logp_rollout|, whenever rollout_log_probs is given).

    ``score_centering`` (slime's --use-score-centering, REINFORCE only): (train head log-probs with gradient,
    sampler head log-probs), each [tokens of the micro-batch, k] at the sampler's top-k ids. Each token's
    policy-gradient score is centred: pg_t += A_t * c_t with c_t = :func:`score_centering_correction` (its IS
    bounds are the TIS clamps with use_tis; without, ``unweighted``, as the sampled score is), so the gradient is
    -A_t (w_t grad log p(y_t) - c_t). Tokens with loss mask 0 get c_t = 0. Extra metrics:
    score_centering_head_mass_q / _p (R of Q and P) and score_centering_abs (R|c_t|).
    """
    reduce: Callable[[Tensor | PerSample, PerSample], Tensor] = (
        sum_of_tokens if config.calculate_per_token_loss else sum_of_sample_mean
    )
    if old_log_probs is None:
        old_log_probs = [lp.detach() for lp in log_probs]
    lp = torch.cat(list(log_probs))
    old = torch.cat(list(old_log_probs))
    adv = torch.cat(list(advantages))

    if config.policy_loss_type == "gspo":
        ppo_kl = gspo_ppo_kl(log_probs, old_log_probs, loss_masks)
        pg, clipfrac = clipped_surrogate(ppo_kl, adv, config.eps_clip, config.clip_high, config.eps_clip_c)
    else:
        ppo_kl = old - lp
        if config.policy_loss_type == "cispo":
            pg, clipfrac = cispo_loss(lp, old, adv, config.eps_clip, config.clip_high)
        elif config.policy_loss_type == "reinforce":
            pg, clipfrac = reinforce_loss(lp, adv)
        else:
            pg, clipfrac = clipped_surrogate(
                ppo_kl, adv, config.eps_clip, config.clip_high, config.eps_clip_c
            )

    metrics: dict[str, Tensor] = {}
    if config.use_opsm:
        keep, masked = opsm_mask(log_probs, old_log_probs, advantages, loss_masks, config.opsm_delta)
        pg = pg * keep.to(pg)
        metrics["opsm_clipfrac"] = reduce(masked, loss_masks)
    rollout = torch.cat(list(rollout_log_probs)) if rollout_log_probs else None
    if config.use_tis or config.get_mismatch_metrics:
        if rollout is None:
            raise ValueError("use_tis / get_mismatch_metrics need rollout_log_probs (the inference engine's log-probs)")
        trained = torch.cat(list(train_log_probs)).detach() if train_log_probs is not None else old.detach()
        if tis_function is not None:
            pg, kept_masks, tis_metrics = tis_function(
                pg_loss=pg, train_log_probs=list(train_log_probs or [o.detach() for o in old_log_probs]),
                rollout_log_probs=list(rollout_log_probs or []), loss_masks=list(loss_masks))
            pg = pg * torch.cat(list(kept_masks)).to(pg)
        else:
            w, tis_metrics = tis_weights(trained, rollout, config.tis_clip_low, config.tis_clip)
            pg = pg * w
        metrics["ois"] = reduce(torch.exp(-ppo_kl.detach()), loss_masks)
        for key, value in tis_metrics.items():
            metrics[key] = reduce(torch.as_tensor(value).detach(), loss_masks)

    if score_centering is not None:
        if config.policy_loss_type != "reinforce":
            raise ValueError(f"score centering corrects the REINFORCE gradient, not {config.policy_loss_type!r}")
        train_head, sampler_head = score_centering
        trained_token = torch.cat([m.to(lp.device) for m in loss_masks]).bool().unsqueeze(-1)
        # Untrained tokens (tool output) carry no sampler head (-inf): score them against the trainer's own
        # head so nothing is inf or NaN, then drop them.
        sampler_head = torch.where(trained_token, sampler_head.to(train_head), train_head.detach())
        correction, q_mass, p_mass = score_centering_correction(
            train_head, sampler_head, clip_low=config.tis_clip_low, clip_high=config.tis_clip,
            unweighted=not config.use_tis)
        correction = torch.where(trained_token.squeeze(-1), correction, torch.zeros_like(correction))
        pg = pg + adv.detach() * correction
        metrics["score_centering_head_mass_q"] = reduce(q_mass, loss_masks)
        metrics["score_centering_head_mass_p"] = reduce(p_mass, loss_masks)
        metrics["score_centering_abs"] = reduce(correction.detach().abs(), loss_masks)

    pg_loss = reduce(pg, loss_masks)
    loss = pg_loss
    entropy_loss = reduce(torch.cat(list(entropy)), loss_masks) if entropy is not None else None
    if entropy_loss is not None:
        loss = loss - config.entropy_coef * entropy_loss

    if config.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("use_kl_loss needs ref_log_probs")
        ref = torch.cat(list(ref_log_probs))
        with_grad = config.kl_loss_coef != 0.0
        kl_lp = lp if with_grad else lp.detach()
        ratio = torch.exp(kl_lp - old) if config.use_unbiased_kl else None
        kl_loss = reduce(approx_kl(kl_lp, ref, config.kl_loss_type, ratio), loss_masks)
        if with_grad:
            loss = loss + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()

    if rollout is not None:
        metrics["train_rollout_logprob_abs_diff"] = reduce((old.detach() - rollout).abs(), loss_masks)

    head = {
        "loss": loss.detach(),
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": reduce(clipfrac, loss_masks).detach(),
        "ppo_kl": reduce(ppo_kl.detach(), loss_masks),
    }
    if entropy_loss is not None:
        head["entropy_loss"] = entropy_loss.detach()
    return loss, {**head, **metrics}

