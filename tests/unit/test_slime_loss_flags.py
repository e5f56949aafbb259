"""Issue 26: slime's loss and metric flags with slime's meaning, on plain tensors (hpc_rl.training.losses) and as
the trainer wires them from the config (policy_loss_config, the TIS plug-in, log-prob chunking)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpc_rl.config import load_config
from hpc_rl.config.sections.algorithm import AlgorithmConfig
from hpc_rl.config.sections.training import TrainingConfig
from hpc_rl.config.validation import collect_problems
from hpc_rl.plugins import PluginError, load_plugin
from hpc_rl.training.logprobs import vocab_parallel_logprobs
from hpc_rl.training.loss_reduction import sum_of_sample_mean
from hpc_rl.training.loss_terms import opsm_mask
from hpc_rl.training.losses import PolicyLossConfig, policy_loss_and_metrics
from hpc_rl.training.step_settings import old_logprobs_need_own_pass, policy_loss_config

MASKS = [torch.ones(3), torch.ones(2)]


def _inputs() -> dict:
    lp = [torch.tensor([-1.0, -2.0, -0.5], requires_grad=True), torch.tensor([-0.3, -0.4], requires_grad=True)]
    return {"log_probs": lp, "old_log_probs": [torch.tensor([-0.2, -0.1, -0.5]), torch.tensor([-0.3, -0.4])],
            "advantages": [torch.full((3,), -1.0), torch.full((2,), -1.0)], "loss_masks": MASKS,
            "rollout_log_probs": [torch.tensor([-0.25, -0.1, -0.6]), torch.tensor([-0.3, -0.5])]}


def test_opsm_masks_negative_advantage_tokens_of_drifted_samples() -> None:
    """--use-opsm: sample 0 drifted (mean logp_old - logp = 0.9 > delta) with A < 0: no policy loss there."""
    data = _inputs()
    keep, masked = opsm_mask(data["log_probs"], data["old_log_probs"], data["advantages"], MASKS, delta=1e-4)
    assert keep.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0] and masked.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    with_opsm, metrics = policy_loss_and_metrics(PolicyLossConfig(use_opsm=True), **{
        k: v for k, v in data.items() if k != "rollout_log_probs"})
    without, _ = policy_loss_and_metrics(PolicyLossConfig(), **{k: v for k, v in data.items() if k != "rollout_log_probs"})
    assert metrics["opsm_clipfrac"].item() == 1.0  # one whole sample masked (a sum of per-sample fractions)
    assert with_opsm.item() != without.item()
    with_opsm.backward()
    assert torch.equal(data["log_probs"][0].grad, torch.zeros(3))


def test_custom_tis_function_replaces_the_weighting_and_reports_its_metrics() -> None:
    """--custom-tis-function-path with slime's keyword call; --get-mismatch-metrics runs it without --use-tis."""
    seen: dict = {}

    def reject_sample_one(*, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
        seen.update(kwargs, train=train_log_probs)
        masks = [loss_masks[0], torch.zeros_like(loss_masks[1])]
        return pg_loss * 2.0, masks, {"mismatch": torch.ones_like(pg_loss)}

    data = _inputs()
    config = PolicyLossConfig(get_mismatch_metrics=True)
    loss, metrics = policy_loss_and_metrics(config, **data, tis_function=lambda **kw: reject_sample_one(**kw, extra=1))
    plain, _ = policy_loss_and_metrics(PolicyLossConfig(), **data)
    assert metrics["mismatch"].item() == 2.0 and "ois" in metrics  # sum over the 2 samples of a mean of ones
    assert seen["extra"] == 1 and torch.equal(seen["train"][0], data["old_log_probs"][0])
    per_token, _ = policy_loss_and_metrics(PolicyLossConfig(), **{**data, "loss_masks": [MASKS[0], torch.zeros(2)]})
    assert loss.item() == pytest.approx(2.0 * per_token.item())  # rejected tokens: numerator only, as slime
    assert loss.item() != plain.item()


def test_unbiased_kl_reaches_the_loss_from_the_config() -> None:
    """--use-unbiased-kl: the KL term is weighted by exp(logp - logp_old) (the trainer's loss config carries it)."""
    config = policy_loss_config(AlgorithmConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k1",
                                                use_unbiased_kl=True), TrainingConfig())
    assert config.use_unbiased_kl
    data = {k: v for k, v in _inputs().items() if k != "rollout_log_probs"}
    ref = [torch.zeros(3), torch.zeros(2)]
    _, unbiased = policy_loss_and_metrics(config, **data, ref_log_probs=ref)
    _, plain = policy_loss_and_metrics(PolicyLossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k1"),
                                       **data, ref_log_probs=ref)
    ratio = [torch.exp(lp.detach() - old) for lp, old in zip(data["log_probs"], data["old_log_probs"])]
    expected = sum_of_sample_mean([r * lp.detach() for r, lp in zip(ratio, data["log_probs"])], MASKS)
    assert unbiased["kl_loss"].item() == pytest.approx(expected.item())
    assert unbiased["kl_loss"].item() != pytest.approx(plain["kl_loss"].item())


def test_the_loss_flags_reach_the_trainer() -> None:
    config = load_config([], ["--use-opsm", "--opsm-delta", "0.01", "--get-mismatch-metrics", "--use-unbiased-kl",
                              "--custom-tis-function-path", "tests.unit.plugin_fixtures.tis"])
    loss = policy_loss_config(config.algorithm, config.training)
    assert (loss.use_opsm, loss.opsm_delta, loss.get_mismatch_metrics, loss.use_unbiased_kl) == (True, 0.01, True, True)
    assert old_logprobs_need_own_pass(TrainingConfig(), AlgorithmConfig(use_rollout_entropy=True), has_ref=False)


def test_tis_plugins_are_checked_with_slimes_keywords(tmp_path: Path) -> None:
    good = load_plugin("tis", "tests.unit.plugin_fixtures.tis")
    assert callable(good)
    bad = tmp_path / "bad_tis.py"
    bad.write_text("def tis(args, pg_loss, masks):\n    return pg_loss, masks, {}\n")
    with pytest.raises(PluginError, match="keyword argument"):
        load_plugin("tis", f"{bad}:tis")
    config = load_config([], ["--custom-tis-function-path", f"{bad}:tis"])
    assert any(p.where == "algorithm.custom_tis_function_path" for p in collect_problems(config, check_files=False))
    alone = load_config([], ["--get-mismatch-metrics"])
    assert any(p.where == "algorithm.get_mismatch_metrics" for p in collect_problems(alone, check_files=False))


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op allocated (views of an input allocate nothing): a memory bound, on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, tensor.numel())
        return out


def test_log_probs_chunk_size_bounds_the_softmax_intermediates() -> None:
    """--log-probs-chunk-size: the same log-probs and entropies, [chunk, V] intermediates instead of [T, V]."""
    torch.manual_seed(0)
    logits, targets = torch.randn(40, 50), torch.randint(0, 50, (40,))
    whole = vocab_parallel_logprobs(logits, targets, vocab_size=48, with_entropy=True)
    with LargestOutput() as probe:
        chunked = vocab_parallel_logprobs(logits, targets, vocab_size=48, with_entropy=True, chunk_size=8)
    assert torch.allclose(whole[0], chunked[0]) and torch.allclose(whole[1], chunked[1])
    assert probe.largest <= 8 * 50


def test_flops_balanced_microbatches_balance_the_quadratic_cost() -> None:
    """--balance-by-flops: first-fit by tokens leaves the short samples together and each long one alone (uneven
    work); Karmarkar-Karp on c*L + L^2 makes ceil(tokens / cap) micro-batches of equal cost."""
    from hpc_rl.training.batching import flops_balanced_microbatches, pack_microbatches

    lengths = [10, 10, 10, 10, 60, 60]

    def costs(bins: list[list[int]]) -> list[int]:
        return [sum(10 * lengths[i] + lengths[i] ** 2 for i in b) for b in bins]

    by_tokens = pack_microbatches(lengths, 80)
    by_flops = flops_balanced_microbatches(lengths, 80, linear_coefficient=10.0)
    assert len(by_flops) == 2 and sorted(i for b in by_flops for i in b) == list(range(6))
    assert len(set(costs(by_flops))) == 1 and len(set(costs(by_tokens))) > 1
