"""Trainer sanity on real gloo ranks: first-step ppo_kl == 0 and KL == 0, micro-batching invariance
(fixed-size packed THD vs token-packed padded micro-batches: same loss and gradients),
checkpoint save -> process exit -> resume equality, and an interrupted save leaving the previous
checkpoint loadable."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from hpc_rl.training.local_ranks import run_ranks

pytestmark = pytest.mark.slow
LOGIT_TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2], [1, 4, 9, 16, 23, 0, 8, 6]])
ARCH_FILE = str(Path(__file__).resolve().parents[2] / "configs/models/tiny_qwen3.yaml")


def make_batch(seed: int, n: int = 8):
    from hpc_rl.training.train_batch import TrainBatch

    rng = random.Random(seed)
    tokens, responses, masks, logprobs = [], [], [], []
    for _ in range(n):
        prompt, response = rng.randint(2, 6), rng.randint(1, 7)
        tokens.append([rng.randrange(24) for _ in range(prompt + response)])
        responses.append(response)
        masks.append([1 if rng.random() > 0.2 else 0 for _ in range(response)])
        logprobs.append([-rng.random() * 3 for _ in range(response)])
    rewards = [rng.gauss(0, 1) for _ in range(n)]
    return TrainBatch(tokens=tokens, response_lengths=responses, loss_masks=masks, rewards=rewards,
                      rollout_logprobs=logprobs)


def _parts(hf_dir: str, *, tp: int = 1, load: str | None = None, **training_overrides):
    from hpc_rl.training.parallel import init_parallel

    training = _training(tp=tp, **training_overrides)
    info = init_parallel(training, device="cpu")
    return _build_parts(hf_dir, training, info, load=load), info


def _training(*, tp: int = 1, **overrides):
    from hpc_rl.config.sections.training import TrainingConfig

    overrides = {"qkv_format": "thd", **overrides}  # the packed path unless a test says otherwise
    return TrainingConfig(tensor_model_parallel_size=tp, global_batch_size=8, micro_batch_size=2, **overrides)


def _build_parts(hf_dir: str, training, info, *, load: str | None = None):
    """Actor, reference, optimizer and trainer in the already-initialised groups."""
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig
    from hpc_rl.training.actor import build_trainer

    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coef=0.01,
                                eps_clip=0.2, eps_clip_high=0.28)
    optimizer = OptimizerConfig(lr=1e-3, clip_grad=1.0, weight_decay=0.01, lr_warmup_iters=0)
    checkpoints = CheckpointConfig(hf_checkpoint=hf_dir, ref_load=hf_dir, load=load)
    arch = ModelArchitecture.from_yaml(ARCH_FILE)
    return build_trainer(arch=arch, training=training, algorithm=algorithm, optimizer_config=optimizer,
                         checkpoints=checkpoints, info=info, model_file=ARCH_FILE)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def first_step_and_invariance_rank(hf_dir: str) -> dict:
    from hpc_rl.training.model_provider import forward_logits
    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.training.step import RolloutTrainer

    parts, info = _parts(hf_dir)
    with torch.no_grad():
        tp1_logits = forward_logits(parts.actor, LOGIT_TOKENS)[..., :24]
    batch = make_batch(0)
    recorded: list[dict[str, torch.Tensor]] = []

    def record_instead_of_step():  # a fake step: keep the reduced grads, leave the weights alone
        from megatron.core.distributed import finalize_model_grads

        from hpc_rl.training.optimizer import StepResult

        finalize_model_grads([parts.actor])
        recorded.append({n: p.main_grad.clone() for n, p in parts.actor.named_parameters()})
        parts.optimizer.zero_grad()
        return StepResult(grad_norm=0.0, lr=0.0, skipped=True)

    real_step = parts.optimizer.step
    parts.optimizer.step = record_instead_of_step
    fixed = parts.trainer.train_rollout(batch)[0]
    # token-packed micro-batches in the padded layout vs fixed-size ones packed (THD): same loss and grads
    dynamic_training = type(parts.trainer.training)(global_batch_size=8, use_dynamic_batch_size=True,
                                                    max_tokens_per_gpu=20, qkv_format="bshd")
    dynamic = RolloutTrainer(actor=parts.actor, optimizer=parts.optimizer, ref_model=parts.ref_model,
                             arch=parts.trainer.arch, training=dynamic_training, algorithm=parts.trainer.algorithm,
                             info=info)
    dyn = dynamic.train_rollout(batch)[0]
    per_token = []  # --calculate-per-token-loss must be micro-batching invariant too
    for overrides in ({"micro_batch_size": 3}, {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 25}):
        training = type(parts.trainer.training)(global_batch_size=8, calculate_per_token_loss=True, **overrides)
        per_token.append(RolloutTrainer(actor=parts.actor, optimizer=parts.optimizer, ref_model=parts.ref_model,
                                        arch=parts.trainer.arch, training=training,
                                        algorithm=parts.trainer.algorithm, info=info).train_rollout(batch)[0])
    # the old log-probs from their own forward pass (before PR: always) vs the training pass's own
    separate = RolloutTrainer(actor=parts.actor, optimizer=parts.optimizer, ref_model=parts.ref_model,
                              arch=parts.trainer.arch, training=parts.trainer.training,
                              algorithm=parts.trainer.algorithm, info=info, separate_old_logprob_pass=True)
    separate_metrics = separate.train_rollout(batch)[0]
    parts.optimizer.step = real_step
    timing = ("step_time", "tokens_per_second")
    same_metrics = {k: v for k, v in separate_metrics.items() if k not in timing} == {
        k: v for k, v in fixed.items() if k not in timing}
    fused_is_exact = (not parts.trainer.separate_old_logprob_pass and same_metrics
                      and all(torch.equal(recorded[4][n], recorded[0][n]) for n in recorded[0]))
    token_grad_diff = max((recorded[2][n] - recorded[3][n]).abs().max().item() for n in recorded[2])
    grad_diff = max((recorded[0][n] - recorded[1][n]).abs().max().item() for n in recorded[0])
    grad_scale = max(recorded[0][n].abs().max().item() for n in recorded[0])
    real = parts.trainer.train_rollout(batch)[0]
    second = parts.trainer.train_rollout(batch)[0]
    one_rank_step = _one_rank_step_against_reference(parts)
    shutdown_parallel()
    return {"fixed": fixed, "dynamic": dyn, "grad_diff": grad_diff, "grad_scale": grad_scale,
            "real": real, "second": second, "tp1_logits": tp1_logits, "per_token": per_token,
            "token_grad_diff": token_grad_diff, "fused_is_exact": fused_is_exact, "one_rank_step": one_rank_step}


def _one_rank_step_against_reference(parts) -> dict:
    """One optimizer step of the one-rank dense actor (Megatron's distributed optimizer over fp32 parameters, no
    `finalize_model_grads`) against the textbook one on copies of the weights and Adam state: Megatron's finalize,
    a float64 norm, torch's per-tensor AdamW."""
    import megatron.core.distributed as megatron_distributed

    from hpc_rl.training.lr_schedule import learning_rate

    optimizer, config = parts.optimizer, parts.optimizer.config
    (megatron_optimizer,) = optimizer.chained
    generator = torch.Generator().manual_seed(5)
    for param in optimizer.params:
        param.main_grad.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    grads = [param.main_grad.clone() for param in optimizer.params]
    before = [param.detach().clone() for param in optimizer.params]
    copies = {id(param): param.detach().clone().requires_grad_(True) for param in optimizer.params}
    states = {id(param): megatron_optimizer._get_main_param_and_optimizer_states(param) for param in optimizer.params}
    lr = learning_rate(config, optimizer.steps_done)
    decayed = [copies[id(p)] for p in optimizer.params if p.dim() >= 2]  # Megatron's rule: no decay on norms, biases
    reference = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": config.weight_decay},
         {"params": [copies[id(p)] for p in optimizer.params if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, foreach=False, fused=False)
    step_count = float(optimizer.torch_optimizers[0].state[megatron_optimizer.optimizer.param_groups[0]["params"][0]]
                       ["step"])
    for param in optimizer.params:
        reference.state[copies[id(param)]] = {
            "step": torch.tensor(step_count),
            "exp_avg": states[id(param)]["exp_avg"].detach().clone().view(param.shape),
            "exp_avg_sq": states[id(param)]["exp_avg_sq"].detach().clone().view(param.shape)}
    real_finalize = megatron_distributed.finalize_model_grads
    real_finalize([optimizer.ddp_model])  # what the step leaves out: it must not change one rank's grads
    finalize_changed = any(not torch.equal(p.main_grad, g) for p, g in zip(optimizer.params, grads))
    reference_norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    scale = min(1.0, config.clip_grad / (reference_norm + 1e-6))
    for param, grad in zip(optimizer.params, grads):
        copies[id(param)].grad = grad * scale
    reference.step()
    calls: list[int] = []
    megatron_distributed.finalize_model_grads = lambda *a, **k: calls.append(1) or real_finalize(*a, **k)
    try:
        result = optimizer.step()
    finally:
        megatron_distributed.finalize_model_grads = real_finalize
    return {"finalize_calls": len(calls), "finalize_changed": finalize_changed,
            "optimizer": type(megatron_optimizer).__name__, "clipped": scale < 1.0, "step_count": step_count,
            "norm": result.grad_norm, "reference_norm": reference_norm,
            "param_diff": max((p - copies[id(p)]).abs().max().item() for p in optimizer.params),
            "moved": max((p - b).abs().max().item() for p, b in zip(optimizer.params, before))}


def test_first_step_kl_zero_and_microbatch_invariance(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = make_tiny_model(tmp_path / "hf")
    out = run_ranks(first_step_and_invariance_rank, 1, str(hf_dir))[0]
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(LOGIT_TOKENS).logits
    assert (out["tp1_logits"] - reference).abs().max().item() < 1e-4  # Megatron TP=1 == HF
    for metrics in (out["fixed"], out["dynamic"], out["real"]):
        assert metrics["ppo_kl"] == 0.0
        assert metrics["kl_loss"] == 0.0
        assert metrics["pg_clipfrac"] == 0.0
    assert abs(out["fixed"]["loss"] - out["dynamic"]["loss"]) < 1e-6
    assert out["grad_scale"] > 0
    assert out["grad_diff"] < 1e-6 * max(1.0, out["grad_scale"])
    assert abs(out["per_token"][0]["loss"] - out["per_token"][1]["loss"]) < 1e-6
    assert out["token_grad_diff"] < 1e-6 * max(1.0, out["grad_scale"])
    assert out["real"]["grad_norm"] > 0 and out["real"]["lr"] == pytest.approx(1e-3)
    assert out["second"]["kl_loss"] > 0  # the actor moved away from the reference
    assert out["real"]["train_rollout_logprob_abs_diff"] > 0
    # old log-probs from the training pass: the same metrics and bit-identical gradients as their own pass
    assert out["fused_is_exact"]
    # one dense rank: Megatron's distributed optimizer (the GPU's), no finalize_model_grads (nothing to reduce: it
    # leaves the grads as they are); the same clipped update and norm as Megatron's finalize + a float64 norm +
    # torch's per-tensor AdamW over the same Adam state
    step = out["one_rank_step"]
    assert step["optimizer"] == "DistributedOptimizer" and step["step_count"] >= 1
    assert step["finalize_calls"] == 0 and not step["finalize_changed"]
    assert step["clipped"] and step["norm"] == pytest.approx(step["reference_norm"], rel=1e-6)
    assert step["moved"] > 1e-4 and step["param_diff"] < 1e-7


def train_then_save_rank(hf_dir: str, save_dir: str, resume: bool, tp: int = 1) -> dict:
    from hpc_rl.training.checkpoint import TrainerState, save_checkpoint
    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.weights.export import export_hf_state_dict

    parts, _ = _parts(hf_dir, load=save_dir if resume else None, tp=tp, sequence_parallel=tp > 1)
    if resume:
        assert parts.resumed is not None
        start = parts.resumed.rollout_id + 1
        controller_state = parts.resumed.controller_state
    else:
        parts.trainer.train_rollout(make_batch(0))
        save_checkpoint(save_dir, parts.actor, parts.optimizer,
                        TrainerState(rollout_id=0, controller_state={"cursor": 8, "buffer": [[1, 2]]}))
        start, controller_state = 1, None
    noise = torch.rand(3)  # the RNG stream continues from the save point in both runs
    metrics = parts.trainer.train_rollout(make_batch(start))
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    params = {name: t.clone() for name, t in export_hf_state_dict(parts.actor, parts.trainer.arch, group)}
    shutdown_parallel()
    return {"start": start, "metrics": metrics, "params": params, "noise": noise, "controller": controller_state}


def test_checkpoint_resume_is_exact(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import make_tiny_model

    hf_dir = make_tiny_model(tmp_path / "hf")
    save_dir = tmp_path / "ckpt"
    straight = run_ranks(train_then_save_rank, 1, str(hf_dir), str(save_dir), False)[0]
    assert (save_dir / "latest_checkpointed_iteration.txt").read_text() == "0"
    # A crash while saving rollout 1 leaves a partial .tmp directory: the tracker still says 0.
    (save_dir / "iter_0000001.tmp").mkdir()
    (save_dir / "iter_0000001.tmp" / "garbage").write_text("half-written")
    resumed = run_ranks(train_then_save_rank, 1, str(hf_dir), str(save_dir), True)[0]
    assert resumed["start"] == 1
    assert resumed["controller"] == {"cursor": 8, "buffer": [[1, 2]]}
    assert resumed["metrics"][0]["loss"] == straight["metrics"][0]["loss"]
    assert torch.equal(resumed["noise"], straight["noise"])
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    # Resharded resume: the TP=1 checkpoint (weights + AdamW moments) loaded at TP=2 with SP.
    resharded = run_ranks(train_then_save_rank, 2, str(hf_dir), str(save_dir), True, 2)[0]
    assert resharded["start"] == 1
    assert abs(resharded["metrics"][0]["loss"] - straight["metrics"][0]["loss"]) < 1e-5
    for name, value in straight["params"].items():
        assert (resharded["params"][name] - value).abs().max().item() < 1e-5, name
