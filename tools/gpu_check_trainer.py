"""The trainer's checks of tools/gpu_check.py: the one-rank world, the model against transformers, parameter
placement, Megatron's optimizer through build_trainer (loaded weights, a step, a NaN step, the warm-up's first lr,
sharded save and restore) and RolloutTrainer's step (packed micro-batches, reference KL, MoE routing replay)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from gpu_check_base import (
    TINY_CHECKPOINT, LR, Context, Skip, expect, need_module, need_parallel, tiny_arch, trainer_parts,
    weights_of, largest_change, loss_step, rollout_batch, non_finite_metrics,
)


def check_nccl_init(ctx: Context) -> dict[str, Any]:
    need_module("megatron.core")
    import torch.distributed as dist

    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.process.child_process import free_port
    from hpc_rl.training.parallel import init_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    info = init_parallel(TrainingConfig(), device=ctx.device)
    ctx.state["info"] = info
    expect(dist.get_world_size() == 1 and info.tp_size == 1, f"world {dist.get_world_size()}, tp {info.tp_size}")
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size()}


def _logits_against_transformers(ctx: Context, arch: Any, checkpoint: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.model_provider import build_gpt_model, forward_logits
    from hpc_rl.weights.hf_import import load_hf_into_model

    model = build_gpt_model(arch, TrainingConfig(), params_dtype=ctx.dtype, device="cpu").to(ctx.device).eval()
    load_hf_into_model(model, checkpoint, arch, tp_rank=0, tp_size=1)
    tokens = torch.randint(0, arch.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).to(ctx.device)
    with torch.no_grad():
        ours = forward_logits(model, tokens)[..., :arch.vocab_size].float().log_softmax(-1)
    placement = sorted({f"{p.device.type}/{p.dtype}" for p in model.parameters()})
    del model
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=ctx.dtype).to(ctx.device).eval()
    with torch.no_grad():
        theirs = reference(tokens).logits.float().log_softmax(-1)
    del reference
    difference = (ours - theirs).abs()
    figures = {"max_abs_logprob_diff": difference.max().item(), "mean_abs_logprob_diff": difference.mean().item(),
               "params": placement, "dtype": str(ctx.dtype)}
    # bf16: the two implementations round differently (measured in dry mode, CPU bf16: max 0.007 / mean 0.0006 on
    # the tiny model, max 0.034 / mean 0.007 on the 0.44B shape; fp32: 2e-6 on the 0.44B shape)
    max_tol, mean_tol = (1e-3, 1e-4) if ctx.dtype == torch.float32 else (0.25, 0.03)
    expect(figures["max_abs_logprob_diff"] < max_tol and figures["mean_abs_logprob_diff"] < mean_tol,
           f"log-probs differ from transformers': {figures}")
    return figures


def check_logits_tiny(ctx: Context) -> dict[str, Any]:
    need_module("transformers")
    need_parallel(ctx)
    return _logits_against_transformers(ctx, tiny_arch(), TINY_CHECKPOINT)


RANDOM_SHAPES = {  # TinyModelSpec fields; the tiny vocabulary (24) keeps the files small
    "0.5b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128),  # Qwen3-0.6B's layers: 0.44B parameters
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32),
}


def check_logits_random_shape(ctx: Context) -> dict[str, Any]:
    need_module("transformers")
    need_parallel(ctx)
    from hpc_rl.tiny_model import TinyModelSpec, make_tiny_model

    shape = RANDOM_SHAPES[ctx.random_shape]
    start = time.perf_counter()
    checkpoint = make_tiny_model(ctx.scratch / f"random_{ctx.random_shape}", TinyModelSpec(**shape))
    arch = dataclasses.replace(
        tiny_arch(), num_layers=shape["num_hidden_layers"], hidden_size=shape["hidden_size"],
        ffn_hidden_size=shape["intermediate_size"], num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_key_value_heads"], kv_channels=shape["head_dim"])
    figures = {"shape": ctx.random_shape, "make_checkpoint_s": time.perf_counter() - start}
    return figures | _logits_against_transformers(ctx, arch, checkpoint)


def check_params_on_device(ctx: Context) -> dict[str, Any]:
    import torch

    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.model_provider import build_gpt_model

    need_parallel(ctx)
    device = "cpu" if ctx.on_cpu else "cuda"
    model = build_gpt_model(tiny_arch(), TrainingConfig(), params_dtype=torch.bfloat16, device=device)
    wrong = [f"{name}: {p.device.type}/{p.dtype}" for name, p in model.named_parameters()
             if p.device.type != torch.device(ctx.device).type or p.dtype != torch.bfloat16]
    expect(not wrong, f"{len(wrong)} parameter(s) not {ctx.device}/bf16: {wrong[:4]}")
    return {"params": sum(1 for _ in model.parameters())}


def _loaded_weights(ctx: Context, dtype: Any) -> dict[str, Any]:
    """The tiny checkpoint in a model built as the actor is (its dtype), without an optimizer: what 'loaded'
    means."""
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.weights.hf_import import load_hf_into_model

    model = build_gpt_model(tiny_arch(), TrainingConfig(), params_dtype=dtype,
                            device="cpu" if ctx.on_cpu else "cuda")
    load_hf_into_model(model, TINY_CHECKPOINT, tiny_arch(), tp_rank=0, tp_size=1)
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def _group_lrs(optimizer: Any) -> list[float] | None:
    """The lrs in the param groups of the optimizer inside hpc_rl's (Megatron's scheduler sets them after each
    step, for the next one); None when it has none to show."""
    groups = getattr(getattr(optimizer, "optimizer", None), "param_groups", None)
    return sorted({float(group["lr"]) for group in groups}) if groups else None


def check_optimizer_keeps_loaded_weights(ctx: Context) -> dict[str, Any]:
    parts = trainer_parts(ctx)
    ctx.state["parts"] = parts
    loaded = _loaded_weights(ctx, next(parts.actor.parameters()).dtype)
    built = weights_of(parts.actor)
    at_build = largest_change(loaded, built)
    expect(at_build == 0.0, f"the actor does not hold the loaded weights after build_trainer (max |diff| {at_build})")
    result = loss_step(parts)
    after = weights_of(parts.actor)
    moved = largest_change(loaded, after)
    scale = max(t.abs().max().item() for t in loaded.values())
    bound = 10 * LR + scale * 2.0 ** -7  # an Adam step moves each weight by about lr; bf16 rounds by 2^-8
    ctx.state["after_step_1"] = after
    expect(moved <= bound, f"after step 1 the weights are {moved:.4g} from the loaded ones (bound {bound:.4g}): "
                           "the optimizer's main copies did not start from the loaded weights")
    return {"max_abs_change_step_1": moved, "bound": bound, "grad_norm": result.grad_norm}


def check_optimizer_step(ctx: Context) -> dict[str, Any]:
    import math

    if "parts" not in ctx.state:
        raise Skip("optimizer_keeps_loaded_weights did not build the trainer")
    parts = ctx.state["parts"]
    before = weights_of(parts.actor)
    steps = parts.optimizer.steps_done
    result = loss_step(parts)
    expect(not result.skipped and math.isfinite(result.grad_norm) and result.grad_norm > 0,
           f"a finite step was not applied: {result}")
    expect(abs(result.lr - LR) < 1e-12, f"constant schedule: lr {result.lr}, expected {LR}")
    expect(parts.optimizer.steps_done == steps + 1, f"steps_done {parts.optimizer.steps_done} after {steps} + 1")
    moved = largest_change(before, weights_of(parts.actor))
    expect(moved > 0, "the step left every weight unchanged")
    return {"grad_norm": result.grad_norm, "lr": result.lr, "max_abs_change": moved}


def check_optimizer_nan_step(ctx: Context) -> dict[str, Any]:
    parts = trainer_parts(ctx)  # its own: an applied NaN step must not spoil the checks after it
    loss_step(parts)  # Adam's moments exist, as in a run
    before, steps = weights_of(parts.actor), parts.optimizer.steps_done
    result = loss_step(parts, poison=True)
    moved = largest_change(before, weights_of(parts.actor))
    non_finite = sum(int(not t.isfinite().all()) for t in weights_of(parts.actor).values())
    expect(result.skipped, f"a NaN gradient's step was reported applied: {result}")
    expect(moved == 0.0 and non_finite == 0, f"the NaN step changed the weights (max |diff| {moved}, "
                                             f"{non_finite} tensors non-finite)")
    expect(parts.optimizer.steps_done == steps, "a skipped step advanced the schedule")
    return {"reported_skipped": result.skipped, "max_abs_change": moved}


def check_optimizer_lr_warmup(ctx: Context) -> dict[str, Any]:
    from hpc_rl.config.sections.training import OptimizerConfig

    parts = trainer_parts(ctx, optimizer=OptimizerConfig(lr=LR, lr_warmup_fraction=0.5, clip_grad=1.0))
    parts.optimizer.set_run_length(4)  # warm-up of 2 steps: lr 0, then lr/2
    before, group_lrs = weights_of(parts.actor), _group_lrs(parts.optimizer)
    first = loss_step(parts)
    moved = largest_change(before, weights_of(parts.actor))
    second = loss_step(parts)
    figures = {"lr_step_1": first.lr, "lr_step_2": second.lr, "max_abs_change_step_1": moved,
               "param_group_lrs_before_step_1": group_lrs}
    expect(first.lr == 0.0 and abs(second.lr - LR / 2) < 1e-12, f"warm-up lrs reported {figures}")
    expect(moved == 0.0, f"step 1 of a warm-up (lr 0) moved the weights by {moved:.4g}: a stale lr was applied "
                         f"(or the step replaced the weights: see optimizer_keeps_loaded_weights); {figures}")
    return figures


def check_optimizer_save_restore(ctx: Context) -> dict[str, Any]:
    from hpc_rl.training import checkpoint

    if "parts" not in ctx.state:
        raise Skip("optimizer_keeps_loaded_weights did not build the trainer")
    parts = ctx.state["parts"]
    root = ctx.scratch / "checkpoint"
    start = time.perf_counter()
    checkpoint.save_checkpoint(root, parts.actor, parts.optimizer, checkpoint.TrainerState(rollout_id=3))
    saved_s = time.perf_counter() - start
    restored = trainer_parts(ctx, load=str(root))
    expect(restored.resumed is not None, "build_trainer did not resume from the checkpoint")
    difference = largest_change(weights_of(parts.actor), weights_of(restored.actor))
    expect(difference == 0.0, f"restored weights differ by {difference}")
    expect(restored.optimizer.steps_done == parts.optimizer.steps_done,
           f"steps_done {restored.optimizer.steps_done} restored, {parts.optimizer.steps_done} saved")
    loss_step(parts)
    loss_step(restored)
    after = largest_change(weights_of(parts.actor), weights_of(restored.actor))
    expect(after < 1e-6, f"the step after the restore differs by {after}: the optimizer state was not restored")
    return {"save_s": saved_s, "next_step_diff": after, "files": sum(1 for _ in root.rglob("*"))}


def check_rollout_step_dense_kl(ctx: Context) -> dict[str, Any]:
    parts = trainer_parts(ctx, kl=True)
    ctx.state["kl_parts"] = parts
    metrics = parts.trainer.train_rollout(rollout_batch(24))[0]
    kl = {key: value for key, value in metrics.items() if "kl" in key}
    expect(not non_finite_metrics(metrics), f"non-finite metrics: {non_finite_metrics(metrics)}")
    expect({"kl_loss", "ppo_kl"} <= set(kl) and abs(kl["kl_loss"]) < 1e-6 and abs(kl["ppo_kl"]) < 1e-6,
           f"the first step's KL to the reference and to the old policy (the same weights) is not 0: {kl}")
    return {key: metrics[key] for key in sorted(metrics) if "kl" in key or "loss" in key or "grad_norm" in key}


def check_rollout_step_moe_replay(ctx: Context) -> dict[str, Any]:
    from hpc_rl.tiny_model import TinyMoeSpec, make_tiny_moe_model

    layers, experts, topk = 3, 4, 2
    hf_dir = make_tiny_moe_model(ctx.scratch / "tiny_moe", TinyMoeSpec(num_hidden_layers=layers, dense_layers=1,
                                                                      num_experts=experts))
    arch = dataclasses.replace(tiny_arch(), family="qwen3_moe", num_layers=layers, num_moe_experts=experts,
                               moe_ffn_hidden_size=32, moe_router_topk=topk, moe_layer_freq=[0, 1, 1],
                               tie_word_embeddings=False)
    parts = trainer_parts(ctx, arch=arch, hf_dir=hf_dir, kl=True, use_routing_replay=True, num_steps_per_rollout=2,
                     moe_token_dispatcher_type="alltoall")
    results = parts.trainer.train_rollout(rollout_batch(24))
    expect(len(results) == 2, f"two steps per rollout expected, got {len(results)}")
    bad = [key for metrics in results for key in non_finite_metrics(metrics)]
    expect(not bad, f"non-finite metrics: {bad}")
    router = {key: value for key, value in results[-1].items() if "router" in key or "moe" in key}
    expect(router.get("moe/replayed_routing_agreement") == 1.0,
           f"the training step did not route every token as the recorded pass did: {router}")
    return {"steps": len(results), **router}
