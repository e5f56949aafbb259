"""Losses: hand-computed values, sign conventions, first-step facts, micro-batching invariance."""

import math

import pytest
import torch

from hpc_rl.training.loss_reduction import masked_token_mean, step_loss_scale, sum_of_sample_mean, sum_of_tokens
from hpc_rl.training.loss_terms import approx_kl, entropy_from_logits, score_centering_correction, tis_weights
from hpc_rl.training.losses import (
    PolicyLossConfig, cispo_loss, gspo_policy_loss, policy_loss, policy_loss_and_metrics, policy_loss_type_for,
    reinforce_loss,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def close(a: torch.Tensor, expected: list[float] | float, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a.float(), torch.as_tensor(expected, dtype=torch.float32), atol=tol, rtol=tol)


# --- KL ------------------------------------------------------------------------------------------


def test_kl_estimators_hand_values() -> None:
    logp, ref = t(0.0, -1.0), t(-1.0, 0.0)  # d = logp - ref = [1, -1]
    close(approx_kl(logp, ref, "k1"), [1.0, -1.0])
    close(approx_kl(logp, ref, "k2"), [0.5, 0.5])
    # exp(-d) + d - 1: d=1 -> e^-1 = 0.36787944; d=-1 -> e - 2 = 0.71828183
    close(approx_kl(logp, ref, "k3"), [0.36787944, 0.71828183])
    close(approx_kl(logp, ref, "low_var_kl"), [0.36787944, 0.71828183])


def test_low_var_kl_is_clamped_but_k3_is_not() -> None:
    logp, ref = t(0.0), t(20.0)  # exp(20) - 20 - 1 = 485165174.4
    close(approx_kl(logp, ref, "low_var_kl"), [10.0])
    assert approx_kl(logp, ref, "k3").item() == pytest.approx(485165174.4, rel=1e-5)


def test_kl_zero_when_equal_and_unknown_type() -> None:
    x = t(-0.3, -2.0, -7.5)
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        assert torch.equal(approx_kl(x, x.clone(), kind), torch.zeros(3))
    with pytest.raises(ValueError, match="kl_type"):
        approx_kl(x, x, "k4")


def test_kl_importance_ratio_multiplies() -> None:
    close(approx_kl(t(1.0), t(0.0), "k1", importance_ratio=t(0.5)), [0.5])


# --- policy losses -------------------------------------------------------------------------------


def test_ppo_clip_hand_values() -> None:
    old = t(0.0, 0.0, 0.0, 0.0, 0.0)
    logp = t(math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5), 0.0)
    adv = t(1.0, 1.0, -1.0, -1.0, 2.0)
    loss, clipfrac = policy_loss(logp, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    # A=1,r=1.5: max(-1.5, -1.28); A=1,r=.5: max(-.5,-.8); A=-1,r=.5: max(.5,.8); A=-1,r=1.5: max(1.5,1.28)
    close(loss, [-1.28, -0.5, 0.8, 1.5, -2.0])
    close(clipfrac, [1.0, 0.0, 1.0, 0.0, 0.0])


def test_dual_clip_bounds_negative_advantages_only() -> None:
    logp, old = t(math.log(5.0), math.log(5.0)), t(0.0, 0.0)
    adv = t(-1.0, 1.0)
    plain, _ = policy_loss(logp, old, adv, 0.2, 0.2)
    close(plain, [5.0, -1.2])
    dual, _ = policy_loss(logp, old, adv, 0.2, 0.2, eps_clip_c=3.0)
    close(dual, [3.0, -1.2])  # min(5, 3 * 1) for A < 0; A > 0 untouched
    with pytest.raises(ValueError, match="eps_clip_c"):
        policy_loss(logp, old, adv, 0.2, 0.2, eps_clip_c=0.5)


def test_ppo_sign_of_gradient_and_ratio_one() -> None:
    logp = t(-1.0, -2.0).requires_grad_()
    loss, clipfrac = policy_loss(logp, logp.detach(), t(1.0, -1.0), 0.2, 0.2)
    close(loss, [-1.0, 1.0])  # ratio exactly 1: L = -A
    assert clipfrac.sum().item() == 0.0
    loss.sum().backward()
    # Minimising raises logp where A > 0 (gradient -A) and lowers it where A < 0.
    close(logp.grad, [-1.0, 1.0])


def test_gspo_uses_masked_sequence_mean_ratio() -> None:
    lp = [t(-1.0, -2.0), t(-1.0, -1.0, -5.0)]
    old = [t(-1.5, -1.5), t(-1.2, -1.2, 0.0)]
    masks = [t(1, 1), t(1, 1, 0)]
    adv = t(1.0, 1.0, 1.0, 1.0, 1.0)
    # sample 0: mean(old - lp) = mean(-0.5, 0.5) = 0 -> ratio 1 -> -1
    # sample 1: masked mean(-0.2, -0.2) = -0.2 -> ratio e^0.2 = 1.2214 -> clipped at 1.2 -> -1.2
    loss, clipfrac = gspo_policy_loss(lp, old, adv, masks, eps_clip=0.2, eps_clip_high=0.2)
    close(loss, [-1.0, -1.0, -1.2, -1.2, -1.2])
    close(clipfrac, [0.0, 0.0, 1.0, 1.0, 1.0])


def test_cispo_value_and_gradient_only_through_log_probs() -> None:
    lp = t(-0.5).requires_grad_()
    old = t(-0.5 - math.log(2.0)).requires_grad_()  # ratio 2 -> truncated to 1.28
    loss, clipfrac = cispo_loss(lp, old, t(1.0), eps_clip=0.2, eps_clip_high=0.28)
    close(loss, [0.64])  # -1.28 * 1 * (-0.5)
    close(clipfrac, [1.0])
    loss.sum().backward()
    close(lp.grad, [-1.28])  # d/dlogp of -sg(1.28) * A * logp; nothing through the ratio
    assert old.grad is None or old.grad.abs().sum() == 0


def test_reinforce_loss() -> None:
    loss, clipfrac = reinforce_loss(t(-1.0, -3.0), t(2.0, -1.0))
    close(loss, [2.0, -3.0])
    close(clipfrac, [0.0, 0.0])


def test_tis_weights_and_metrics() -> None:
    old = t(0.0, 0.0, 0.0)
    rollout = t(0.0, -math.log(4.0), math.log(10.0))  # ratios 1, 4, 0.1
    w, m = tis_weights(old, rollout, clip_low=0.5, clip_high=2.0)
    close(w, [1.0, 2.0, 0.5])
    close(m["tis"], [1.0, 4.0, 0.1])
    close(m["tis_clipfrac"], [0.0, 1.0, 1.0])
    close(m["tis_abs"], [0.0, 3.0, 0.9])


def test_entropy_hand_values_and_stability() -> None:
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)], [1000.0, 0.0]])
    # ln 2; -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351; ~0 without NaN for huge logits
    close(entropy_from_logits(logits), [0.6931472, 0.5623351, 0.0])


# --- reduction -----------------------------------------------------------------------------------


def test_sum_of_sample_mean_and_tokens() -> None:
    values = t(1, 2, 3, 4, 5, 7, 7)
    masks = [t(1, 1, 0), t(1, 1), t(0, 0)]
    close(sum_of_sample_mean(values, masks), 6.0)  # (1+2)/2 + (4+5)/2 + 0 (empty mask, clamped to 1)
    close(sum_of_sample_mean([values[:3], values[3:5], values[5:]], masks), 6.0)
    close(sum_of_tokens(values, masks), 12.0)
    close(masked_token_mean(values, masks), 3.0)
    with pytest.raises(ValueError, match="tokens"):
        sum_of_sample_mean(t(1, 2), [t(1, 1, 1)])


def test_step_loss_scale() -> None:
    assert step_loss_scale(8) == 1 / 8
    assert step_loss_scale(8, dp_size=2, num_microbatches=3) == 6 / 8


# --- total loss ----------------------------------------------------------------------------------


def test_total_loss_hand_value_and_first_step_facts() -> None:
    lp = [t(-1.0, -2.0), t(-0.5)]
    cfg = PolicyLossConfig(entropy_coef=0.1, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1")
    loss, m = policy_loss_and_metrics(
        cfg,
        log_probs=lp,
        old_log_probs=[x.clone() for x in lp],
        advantages=[t(1.0, 1.0), t(-2.0)],
        loss_masks=[t(1, 1), t(1)],
        entropy=[t(0.5, 0.7), t(0.2)],
        ref_log_probs=[x - 0.1 for x in lp],
    )
    # pg: sample means of -A: -1 + 2 = 1; entropy: 0.6 + 0.2 = 0.8; k1 = 0.1 per token -> 0.1 + 0.1
    assert m["pg_loss"].item() == pytest.approx(1.0)
    assert m["entropy_loss"].item() == pytest.approx(0.8)
    assert m["kl_loss"].item() == pytest.approx(0.2)
    assert loss.item() == pytest.approx(1.0 - 0.1 * 0.8 + 0.5 * 0.2)
    assert m["ppo_kl"].item() == 0.0  # exactly, logp == logp_old
    assert m["pg_clipfrac"].item() == 0.0


def test_first_step_kl_loss_exactly_zero_for_every_type() -> None:
    lp = [t(-1.3, -0.2), t(-4.0)]
    for kind in ("k1", "k2", "k3", "low_var_kl"):
        cfg = PolicyLossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type=kind)
        _, m = policy_loss_and_metrics(
            cfg,
            log_probs=lp,
            old_log_probs=None,
            advantages=[t(1, 1), t(1)],
            loss_masks=[t(1, 1), t(1)],
            ref_log_probs=[x.clone() for x in lp],
        )
        assert m["kl_loss"].item() == 0.0 and m["ppo_kl"].item() == 0.0


def test_total_loss_with_tis_and_mismatch_metric() -> None:
    cfg = PolicyLossConfig(use_tis=True, tis_clip=2.0, tis_clip_low=0.5)
    loss, m = policy_loss_and_metrics(
        cfg,
        log_probs=[t(0.0, 0.0)],
        old_log_probs=[t(0.0, 0.0)],
        advantages=[t(1.0, 1.0)],
        loss_masks=[t(1, 1)],
        rollout_log_probs=[t(0.0, -math.log(4.0))],  # weights 1 and 2
    )
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 2)
    assert m["tis"].item() == pytest.approx((1 + 4) / 2)
    assert m["tis_clipfrac"].item() == pytest.approx(0.5)
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(math.log(4.0) / 2)
    assert m["ois"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        policy_loss_and_metrics(
            cfg, log_probs=[t(0.0)], old_log_probs=None, advantages=[t(1.0)], loss_masks=[t(1)]
        )


def test_policy_loss_type_mapping_and_config_validation() -> None:
    assert policy_loss_type_for("grpo") == "ppo"
    assert policy_loss_type_for("gspo") == "gspo"
    assert policy_loss_type_for("cispo") == "cispo"
    with pytest.raises(ValueError):
        PolicyLossConfig(kl_loss_type="k9")
    with pytest.raises(ValueError):
        PolicyLossConfig(eps_clip_c=1.0)
    assert PolicyLossConfig(eps_clip=0.2).clip_high == 0.2


# --- issue 34: --pg-loss-type and score centering --------------------------------------------------


def test_pg_loss_type_reinforce_overrides_the_estimators_objective() -> None:
    for estimator in ("grpo", "gspo", "cispo", "ppo", "reinforce_plus_plus"):
        assert policy_loss_type_for(estimator, pg_loss_type="reinforce") == "reinforce"
    assert policy_loss_type_for("gspo", pg_loss_type="ppo") == "gspo"  # ppo keeps the estimator's clipped loss
    assert policy_loss_type_for("cispo", pg_loss_type="ppo") == "cispo"
    assert policy_loss_type_for("grpo", pg_loss_type=None) == "ppo"
    with pytest.raises(ValueError, match="pg_loss_type"):
        policy_loss_type_for("grpo", pg_loss_type="a2c")


def test_reinforce_with_tis_hand_value_and_gradient() -> None:
    # One sample, two tokens, logp = [-1, -2], A = 1, TIS ratios exp(old - rollout) = [2, 1] clipped at 1.5.
    # REINFORCE: pg_t = -A * w_t * logp_t = [1.5, 2.0]; sum_of_sample_mean -> 1.75; d/dlogp = -A * w_t / 2.
    # (PPO on the same numbers: ratio 1, pg_t = -A * w_t = [-1.5, -1.0], mean -1.25.)
    def run(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = t(-1.0, -2.0).requires_grad_()
        loss, _ = policy_loss_and_metrics(
            PolicyLossConfig(policy_loss_type=kind, use_tis=True, tis_clip=1.5),
            log_probs=[log_probs], old_log_probs=[t(-1.0, -2.0)], advantages=[t(1.0, 1.0)], loss_masks=[t(1, 1)],
            rollout_log_probs=[t(-1.0 - math.log(2.0), -2.0)])
        loss.backward()
        return loss.detach(), log_probs.grad
    loss, grad = run("reinforce")
    close(loss, 1.75)
    close(grad, [-0.75, -0.5])
    loss, _ = run("ppo")
    close(loss, -1.25)


def test_score_centering_correction_hand_values() -> None:
    # p = [0.5, 0.25] (P = 0.75), q = [0.4, 0.4] (Q = 0.8): rho = 0.2 / 0.25 = 0.8.
    train = torch.log(t(0.5, 0.25)).reshape(1, 2).requires_grad_()
    sampler = torch.log(t(0.4, 0.4)).reshape(1, 2)
    # No IS bounds: w = p / q and alpha = 1, so q * w - alpha * p = 0: the head term vanishes.
    correction, q_mass, p_mass = score_centering_correction(train, sampler)
    close(correction, [0.0])
    close(q_mass, [0.8])
    close(p_mass, [0.75])
    # TIS bounds [0, 1]: w = [1, 0.625], alpha = 0.8 * min(1.25, 1) = 0.8,
    # residual = [0.4 - 0.4, 0.25 - 0.2] = [0, 0.05]; correction = 0.05 * log 0.25.
    correction, _, _ = score_centering_correction(train, sampler, clip_low=0.0, clip_high=1.0)
    close(correction, [0.05 * math.log(0.25)])
    correction.sum().backward()
    close(train.grad, [[0.0, 0.05]])  # the gradient flows through log p only, weighted by the residual
    # Unweighted (REINFORCE without TIS): w = 1, alpha = rho = 0.8, residual = q - 0.8 p = [0, 0.2].
    correction, _, _ = score_centering_correction(train.detach(), sampler, unweighted=True)
    close(correction, [0.2 * math.log(0.25)])
    # A head holding the whole train mass floors 1 - P at eps (no division by zero).
    full = torch.log(t(0.75, 0.25)).reshape(1, 2)
    correction, _, _ = score_centering_correction(full, sampler, clip_low=0.0, clip_high=1.0)
    assert torch.isfinite(correction).all()


# --- micro-batching invariance -------------------------------------------------------------------


def _step_grads(microbatches: list[list[int]], per_token: bool, kind: str) -> tuple[float, torch.Tensor]:
    torch.manual_seed(0)
    vocab, dim = 11, 6
    weight = torch.nn.Parameter(torch.randn(vocab, dim) * 0.5)
    g = torch.Generator().manual_seed(1)
    lengths = [3, 7, 1, 5, 4, 6]
    feats = [torch.randn(n, dim, generator=g) for n in lengths]
    tokens = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    old = [torch.randn(n, generator=g) * 0.1 - 2.0 for n in lengths]
    adv = [torch.full((n,), float(a)) for n, a in zip(lengths, [1.0, -0.5, 2.0, -1.0, 0.3, 0.7])]
    masks = [(torch.rand(n, generator=g) > 0.2).float() for n in lengths]
    masks[2] = torch.ones(1)
    total_tokens = sum(float(m.sum()) for m in masks)
    cfg = PolicyLossConfig(policy_loss_type=kind, entropy_coef=0.01, calculate_per_token_loss=per_token)
    total = 0.0
    for mb in microbatches:
        logits = [feats[i] @ weight.T for i in mb]
        lp = [torch.log_softmax(x, -1).gather(-1, tokens[i][:, None]).squeeze(-1) for x, i in zip(logits, mb)]
        loss, _ = policy_loss_and_metrics(
            cfg,
            log_probs=lp,
            old_log_probs=[old[i] for i in mb],
            advantages=[adv[i] for i in mb],
            loss_masks=[masks[i] for i in mb],
            entropy=[entropy_from_logits(x) for x in logits],
        )
        scaled = loss / total_tokens if per_token else loss * step_loss_scale(len(lengths))
        scaled.backward()
        total += scaled.item()
    return total, weight.grad.clone()


@pytest.mark.parametrize(
    ("kind", "per_token"), [("ppo", False), ("ppo", True), ("gspo", False), ("cispo", False)]
)
def test_microbatching_does_not_change_loss_or_gradients(per_token: bool, kind: str) -> None:
    loss_a, grad_a = _step_grads([[0, 1, 2], [3, 4, 5]], per_token, kind)
    loss_b, grad_b = _step_grads([[4], [0, 3, 1, 5], [2]], per_token, kind)
    loss_c, grad_c = _step_grads([[0, 1, 2, 3, 4, 5]], per_token, kind)
    assert loss_a == pytest.approx(loss_b, abs=1e-6) and loss_a == pytest.approx(loss_c, abs=1e-6)
    torch.testing.assert_close(grad_a, grad_b, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad_a, grad_c, atol=1e-6, rtol=1e-5)
    assert grad_a.abs().sum() > 0
