"""What a rollout's training does, read from the config: the loss knobs and which passes it runs.

Owns: `PolicyLossConfig` from the `algorithm` and `training` sections, whether the old log-probs need a forward
pass of their own (`old_logprobs_need_own_pass`), and whether a run computes no reference, old log-probs or
advantages at all (`skips_advantages`: SFT, --disable-compute-advantages-and-returns). Pure functions of the
config, used by `step.RolloutTrainer` and checked without a model by the unit tests.
"""

from __future__ import annotations

from hpc_rl.config.sections.algorithm import AlgorithmConfig
from hpc_rl.config.sections.training import TrainingConfig
from hpc_rl.training.losses import PolicyLossConfig, policy_loss_type_for


def policy_loss_config(algorithm: AlgorithmConfig, training: TrainingConfig) -> PolicyLossConfig:
    """The loss knobs from the `algorithm` section."""
    return PolicyLossConfig(
        policy_loss_type=policy_loss_type_for(algorithm.advantage_estimator, pg_loss_type=algorithm.pg_loss_type),
        eps_clip=algorithm.eps_clip, eps_clip_high=algorithm.eps_clip_high, eps_clip_c=algorithm.eps_clip_c,
        entropy_coef=algorithm.entropy_coef, use_kl_loss=algorithm.use_kl_loss,
        kl_loss_coef=algorithm.kl_loss_coef, kl_loss_type=algorithm.kl_loss_type, use_tis=algorithm.use_tis,
        tis_clip=algorithm.tis_clip, tis_clip_low=algorithm.tis_clip_low,
        calculate_per_token_loss=training.calculate_per_token_loss, use_unbiased_kl=algorithm.use_unbiased_kl,
        use_opsm=algorithm.use_opsm, opsm_delta=algorithm.opsm_delta,
        get_mismatch_metrics=algorithm.get_mismatch_metrics,
    )


def old_logprobs_need_own_pass(training: TrainingConfig, algorithm: AlgorithmConfig, *, has_ref: bool,
                               distilling: bool = False) -> bool:
    """Whether the old log-probs need a forward pass of their own before the first update.

    Old log-probs are the actor's at the weights the rollout's training starts from (slime
    recomputes them; the engine's are `rollout_log_probs`, compared by TIS), whatever policy
    generated the samples: async or partial (off-policy) samples do not change that. With one
    optimizer step per rollout, the training pass runs at exactly those weights on the same
    micro-batches, so its log-probs, detached, ARE the old log-probs (ratio 1, ppo_kl 0, the same
    gradient). A separate pass is needed only when (a) later steps follow an update
    (`num_steps_per_rollout` > 1), or (b) something needs them before the loss: KL reward shaping
    (`kl_coef` != 0 with a reference) enters the advantages, which are computed first, and a custom
    advantage function receives them (slime's `rollout_data["log_probs"]`).
    `use_rollout_logprobs` takes them from the engine instead (no pass either way). With `keep_old_actor`
    (slime's --keep-old-actor) they come from the weights the engines generated with, so from a pass of
    their own at those weights. `use_rollout_entropy` wants that pass's entropies. On-policy distillation's
    penalty is computed from them (`distilling`). SFT and --disable-compute-advantages-and-returns need none.
    """
    if algorithm.use_rollout_logprobs or skips_advantages(algorithm):
        return False
    return (training.num_steps_per_rollout > 1 or (has_ref and algorithm.kl_coef != 0.0)
            or algorithm.custom_advantage_function_path is not None or algorithm.keep_old_actor
            or algorithm.use_rollout_entropy or distilling)


def skips_advantages(algorithm: AlgorithmConfig) -> bool:
    """SFT, or slime's --disable-compute-advantages-and-returns: no reference, old log-probs or advantages."""
    return algorithm.loss_type == "sft_loss" or algorithm.disable_compute_advantages_and_returns
