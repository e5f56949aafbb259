"""What the loss computes: the `algorithm` and `distillation` sections of the run config.

Owns: those sections' field names, defaults, types and own invariants, and the allowed-value tables of advantage
estimators, KL types, loss types, policy-gradient loss types and on-policy-distillation types: each a `Literal`
alias, the field's type (`hpc_rl.config.typing_rules.coerce_value` refuses any other value, at its file line) and
the one table the trainer's modules import (`hpc_rl.training.advantages`, `losses`, `loss_terms`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from hpc_rl.config.problems import Problem, raise_problems
from hpc_rl.config.typing_rules import literal_problems

AdvantageEstimator = Literal["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"]
KlType = Literal["k1", "k2", "k3", "low_var_kl"]
LossType = Literal["policy_loss", "sft_loss", "custom_loss"]
PgLossType = Literal["ppo", "reinforce"]
"""slime's --pg-loss-type choices."""
OpdType = Literal["sglang", "megatron"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
KL_TYPES: tuple[str, ...] = get_args(KlType)
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
PG_LOSS_TYPES: tuple[str, ...] = get_args(PgLossType)
OPD_TYPES: tuple[str, ...] = get_args(OpdType)


@dataclass(kw_only=True)
class AlgorithmConfig:
    """Advantages and loss terms of the GRPO family."""

    advantage_estimator: AdvantageEstimator = "grpo"
    """grpo | gspo | cispo | reinforce_plus_plus | reinforce_plus_plus_baseline | ppo."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) to the loss."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss."""
    kl_loss_type: KlType = "low_var_kl"
    """KL estimator for the loss: k1 | k2 | k3 | low_var_kl."""
    kl_coef: float = 0.0
    """KL reward shaping (PPO / REINFORCE++)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    eps_clip: float = 0.2
    """PPO clip range below 1."""
    eps_clip_high: float | None = None
    """PPO clip range above 1 (clip-higher; default eps_clip)."""
    eps_clip_c: float | None = None
    """Dual-clip constant (> 1) for negative advantages."""
    use_tis: bool = False
    """Truncated importance sampling against the rollout log-probs."""
    tis_clip: float = 2.0
    """Upper TIS weight clamp."""
    tis_clip_low: float = 0.0
    """Lower TIS weight clamp."""
    use_rollout_logprobs: bool = False
    """Use the engine's log-probs as old log-probs instead of recomputing them."""
    pg_loss_type: PgLossType | None = None
    """Policy-gradient objective (slime's --pg-loss-type): ppo (advantage_estimator's clipped objective: PPO, GSPO
    or CISPO) | reinforce (-A * logp per token, no clip; with use_tis the TIS weight multiplies it). None: ppo
    (slime's default without score centering; with use_score_centering, None means reinforce)."""
    use_score_centering: bool = False
    """Score centering (slime's --use-score-centering; arXiv:2609.20807): the engines return each generated
    token's top-k log-probs (score_centering_top_k) and the REINFORCE loss subtracts the sampler's expected
    score, estimated on that head (`hpc_rl.training.losses.score_centering_correction`). Needs pg_loss_type
    reinforce (unset means reinforce here) and context_parallel_size 1."""
    score_centering_top_k: int = 128
    """Head size k of score centering: how many top log-probs the engines return per generated token. Cost: 8 x k
    bytes per generated token (int32 id + float32 log-prob) on the controller and on the wire to the trainer
    (k 128: 1 KiB per token), and a [tokens, k] gather of the trainer's logits per micro-batch."""
    disable_grpo_std_normalization: bool = False
    """Dr. GRPO: subtract the group mean only."""
    disable_rewards_normalization: bool = False
    """Skip group normalisation of rewards entirely."""
    normalize_advantages: bool = False
    """Whiten advantages over the DP group."""
    gamma: float = 1.0
    """Discount (REINFORCE++, PPO)."""
    lambd: float = 1.0
    """GAE lambda (PPO)."""
    loss_type: str = "policy_loss"
    """policy_loss (the loss of advantage_estimator) | custom_loss (custom_loss_function_path's)."""
    custom_loss_function_path: str | None = None
    """With loss_type custom_loss: import path of slime's `fn(args, batch, logits, sum_of_sample_mean) ->
    (loss, metrics)`, called per micro-batch on the trainer (batch keys: hpc_rl.training.custom_hooks)."""
    custom_advantage_function_path: str | None = None
    """Import path of slime's `fn(args, rollout_data)` that sets rollout_data["advantages"] and ["returns"]
    (per-sample token tensors) in place of advantage_estimator's; called on the trainer per rollout."""
    disable_compute_advantages_and_returns: bool = False
    """No advantages, returns, reference or old log-probs (slime's flag; what sft_loss needs, which reads none)."""
    ref_update_interval: int | None = None
    """Every this many rollouts the reference model takes the actor's weights (slime's --ref-update-interval;
    None: the reference stays fixed). The updated reference is saved with each checkpoint."""
    keep_old_actor: bool = False
    """Old log-probs from the weights the engines generated the rollout with (kept on the host at each weight
    sync) instead of the trainer's current ones: they differ with update_weights_interval > 1 or in async mode
    (slime's --keep-old-actor)."""
    use_unbiased_kl: bool = False
    """Weight the KL-loss estimate by the importance ratio exp(logp - logp_old) (slime's --use-unbiased-kl,
    DeepSeek-V3.2's unbiased KL)."""
    use_opsm: bool = False
    """Off-policy sequence masking (slime's --use-opsm): no policy loss on the negative-advantage tokens of a sample
    whose mean log-ratio logp_old - logp exceeds opsm_delta; logs opsm_clipfrac."""
    opsm_delta: float = 1e-4
    """OPSM's threshold on a sample's mean log-ratio (slime's --opsm-delta)."""
    get_mismatch_metrics: bool = False
    """Run custom_tis_function_path every step for its train/inference mismatch metrics (and what it does to the
    loss), also without use_tis; with use_rollout_logprobs the trainer still recomputes its own log-probs for it
    (slime's --get-mismatch-metrics)."""
    custom_tis_function_path: str | None = None
    """Import path of slime's TIS/RS function, called with keywords: fn(args=, pg_loss=, train_log_probs=,
    rollout_log_probs=, loss_masks=, total_lengths=, response_lengths=) -> (pg_loss, loss_masks, metrics); it
    replaces the built-in TIS weighting (use_tis) and runs with get_mismatch_metrics."""
    use_rollout_entropy: bool = False
    """Compute each token's entropy in the old and reference log-prob passes and hand them to the custom advantage
    function as rollout_data["entropy"] and ["ref_entropy"] (slime's --use-rollout-entropy)."""
    rollout_data_postprocess_path: str | None = None
    """Import path of slime's `fn(args, rollout_id, rollout_data)`, called on the trainer after the advantages; it
    may change rollout_data["loss_masks"] and ["advantages"] (per-sample tensors) before training."""

    def __post_init__(self) -> None:
        problems = literal_problems(self, "algorithm")
        if self.loss_type not in LOSS_TYPES:  # a str field, not the Literal: its message names slime's value_loss
            problems.append(Problem("algorithm.loss_type", "not_one_of", f"{self.loss_type!r} is not one of "
                                    f"{', '.join(LOSS_TYPES)} (slime's value_loss is the critic's own, chosen by "
                                    f"advantage_estimator ppo)"))
        if self.use_score_centering:
            if self.pg_loss_type == "ppo":
                problems.append(Problem("algorithm.use_score_centering", "conflict", "corrects the REINFORCE "
                                        "gradient: set pg_loss_type reinforce (or leave it unset), or drop "
                                        "use_score_centering"))
            self.pg_loss_type = "reinforce"
        if self.score_centering_top_k < 1:
            problems.append(Problem("algorithm.score_centering_top_k", "out_of_range",
                                    f"{self.score_centering_top_k} "
                                    f"must be >= 1 (the number of top log-probs the engines return per generated "
                                    f"token)"))
        if self.eps_clip_high is None:
            self.eps_clip_high = self.eps_clip
        if self.eps_clip_c is not None and self.eps_clip_c <= 1.0:
            problems.append(Problem("algorithm.eps_clip_c", "out_of_range",
                                    f"{self.eps_clip_c} must be > 1 (dual clip) or null"))
        raise_problems(problems)


@dataclass(kw_only=True)
class DistillationConfig:
    """On-policy distillation (slime's --use-opd): a per-token reverse-KL penalty against a teacher's log-probs,
    added to the advantages of whatever advantage_estimator computes."""

    use_opd: bool = False
    """Distil from a teacher on the student's own samples."""
    opd_type: OpdType | None = None
    """sglang (teacher log-probs from a teacher SGLang server) | megatron (teacher loaded on the trainer ranks)."""
    opd_kl_coef: float = 1.0
    """Weight of the penalty: A_t -= opd_kl_coef * (logp_student_t - logp_teacher_t)."""
    opd_teacher_load: str | None = None
    """megatron: the teacher's torch_dist checkpoint, or an HF directory (the student's architecture and tokenizer)."""
    opd_teacher_ckpt_step: int | None = None
    """megatron: which iteration of opd_teacher_load (default: its latest)."""
    opd_teacher_hf_checkpoint: str | None = None
    """sglang: start the teacher as a component of this job, serving this HF directory (its own GPUs, health-
    checked, behind the job's engine key; cluster.opd_teacher_num_gpus GPUs). Without it, the teacher is
    slime's --rm-url server."""
    opd_teacher_url: str | None = None
    """sglang: /generate URL of a teacher server started outside the job (slime's --rm-url with its OPD reward)."""

    def __post_init__(self) -> None:
        raise_problems(literal_problems(self, "distillation"))
