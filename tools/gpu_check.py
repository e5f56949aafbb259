"""The one-GPU check: hpc_rl's GPU path on ONE bare GPU machine, in one process, in a few minutes; a JSON report.

    python3 tools/gpu_check.py --report gpu_check.json              # on the GPU machine (tools/gpu_check_bundle.sh)
    python3 tools/gpu_check.py --device cpu --report /tmp/dry.json  # CPU dry mode (tests/unit/test_gpu_check_dry.py)

What it needs there: torch with CUDA, transformers, safetensors, numpy, megatron-core (carried as a wheel); no
SGLang, no Transformer Engine, no network (notes/one-gpu-h200.md). It calls hpc_rl's real code, in order:

    nccl_init                 init_parallel: a one-rank NCCL world (gloo in dry mode) and Megatron's groups
    logits_tiny               build_gpt_model, Megatron's local spec in bf16 on the device, the tiny Qwen3
                              checkpoint loaded: log-probs against transformers' on the same device and dtype
    logits_random_shape       the same on a random Qwen3 of ~0.44B parameters (dry mode: a small random shape)
    params_on_device          every parameter of the bf16 model on the device and in bf16
    optimizer_keeps_loaded_weights   build_trainer (Megatron's optimizer on GPU): the model holds the loaded
                              weights, and still after step 1 (within an Adam step of them)
    optimizer_step            a step reports a finite grad norm and its lr and moves the weights
    optimizer_nan_step        a NaN gradient: the step reports skipped AND leaves the weights unchanged
    optimizer_lr_warmup       a warm-up fraction over set_run_length(4): step 1 applies lr 0 (weights unchanged)
    optimizer_save_restore    sharded save_checkpoint, build_trainer from it: same weights and steps, and the
                              next step equal in both (optimizer state restored)
    rollout_step_dense_kl     RolloutTrainer.train_rollout: packed (thd) micro-batches, the reference KL (0 at step 1)
    rollout_step_moe_replay   the same on a tiny MoE with routing replay
    colocated_ipc             ColocatedWeightSender.sync to a fake engine whose second process rebuilds the shares
                              (CUDA IPC handles as SGLang's update_weights_from_tensor does; dry: /dev/shm)
    offload_onload            TrainerOffload: weights, grads, optimizer off the device and back, bit-exact
    weight_stream             WeightSender.connect/send_all on a one-rank NCCL weight-update group

Every check is "passed", "failed: <why>" or "skipped: <why>" (a missing package, no CUDA); a check that raises is
failed with its error, never dropped. Exit status: 0 none failed, 1 some failed, 2 no CUDA (`--device cuda`, the
default: the report says so and nothing ran). Where TE is absent the trainer's
`build_gpt_model(device="cuda")` would refuse (it builds TE layers on GPU): the check then builds Megatron's local
spec on CUDA (the report says `layer_spec: local`), the spec the CPU twin runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
TINY_MODEL = REPO / "configs" / "models" / "tiny_qwen3.yaml"
TINY_CHECKPOINT = REPO / "assets" / "tiny_qwen3"
LR = 1e-3


class Skip(Exception):
    """A check that cannot run here; the message says why."""


class CheckFailed(AssertionError):
    """A check that ran and found the GPU path wrong; the message says what."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def need_module(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - CUDA libraries raise more than ImportError
        raise Skip(f"{name} not importable ({type(error).__name__}: {str(error)[:120]})") from None


@dataclasses.dataclass
class Context:
    """What the checks share: the device, the dtype, the scratch directory and what earlier checks built."""

    device: str
    dtype: Any
    scratch: Path
    random_shape: str
    fake_faults: tuple[str, ...] = ()
    """Faults to fake into the optimizer (FAKE_FAULTS): only tests/unit/test_gpu_check_dry.py sets them."""
    state: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def on_cpu(self) -> bool:
        return self.device == "cpu"


# ---- setup ---------------------------------------------------------------------------------------------------
def check_nccl_init(ctx: Context) -> dict[str, Any]:
    need_module("megatron.core")
    import torch.distributed as dist

    from hpc_rl.config.schema import TrainingConfig
    from hpc_rl.engines.child_process import free_port
    from hpc_rl.training.parallel import init_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    info = init_parallel(TrainingConfig(), device=ctx.device)
    ctx.state["info"] = info
    expect(dist.get_world_size() == 1 and info.tp_size == 1, f"world {dist.get_world_size()}, tp {info.tp_size}")
    return {"backend": dist.get_backend(), "world_size": dist.get_world_size()}


def _local_spec_on_cuda() -> str:
    """Without Transformer Engine the trainer's cuda model cannot be built: build Megatron's local spec there."""
    from hpc_rl.training import model_provider

    try:
        importlib.import_module("transformer_engine")
        return "transformer_engine"
    except Exception:  # noqa: BLE001 - as layer_specs.use_transformer_engine
        model_provider.use_transformer_engine = lambda device: False
        return "local"


def _need_parallel(ctx: Context) -> Any:
    if "info" not in ctx.state:
        raise Skip("nccl_init did not pass")
    return ctx.state["info"]


def _tiny_arch() -> Any:
    from hpc_rl.config.model import ModelArchitecture

    return ModelArchitecture.from_yaml(TINY_MODEL)


# ---- the model against transformers --------------------------------------------------------------------------
def _logits_against_transformers(ctx: Context, arch: Any, checkpoint: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_rl.config.schema import TrainingConfig
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
    _need_parallel(ctx)
    return _logits_against_transformers(ctx, _tiny_arch(), TINY_CHECKPOINT)


RANDOM_SHAPES = {  # TinyModelSpec fields; the tiny vocabulary (24) keeps the files small
    "0.5b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128),  # Qwen3-0.6B's layers: 0.44B parameters
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32),
}


def check_logits_random_shape(ctx: Context) -> dict[str, Any]:
    need_module("transformers")
    _need_parallel(ctx)
    from hpc_rl.tiny_model import TinyModelSpec, make_tiny_model

    shape = RANDOM_SHAPES[ctx.random_shape]
    start = time.perf_counter()
    checkpoint = make_tiny_model(ctx.scratch / f"random_{ctx.random_shape}", TinyModelSpec(**shape))
    arch = dataclasses.replace(
        _tiny_arch(), num_layers=shape["num_hidden_layers"], hidden_size=shape["hidden_size"],
        ffn_hidden_size=shape["intermediate_size"], num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_key_value_heads"], kv_channels=shape["head_dim"])
    figures = {"shape": ctx.random_shape, "make_checkpoint_s": time.perf_counter() - start}
    return figures | _logits_against_transformers(ctx, arch, checkpoint)


def check_params_on_device(ctx: Context) -> dict[str, Any]:
    import torch

    from hpc_rl.config.schema import TrainingConfig
    from hpc_rl.training.model_provider import build_gpt_model

    _need_parallel(ctx)
    device = "cpu" if ctx.on_cpu else "cuda"
    model = build_gpt_model(_tiny_arch(), TrainingConfig(), params_dtype=torch.bfloat16, device=device)
    wrong = [f"{name}: {p.device.type}/{p.dtype}" for name, p in model.named_parameters()
             if p.device.type != torch.device(ctx.device).type or p.dtype != torch.bfloat16]
    expect(not wrong, f"{len(wrong)} parameter(s) not {ctx.device}/bf16: {wrong[:4]}")
    return {"params": sum(1 for _ in model.parameters())}


# ---- Megatron's optimizer through build_trainer ---------------------------------------------------------------
def _trainer(ctx: Context, *, optimizer: Any = None, load: str | None = None, kl: bool = False,
             arch: Any = None, hf_dir: Path | None = None, **training_fields: Any) -> Any:
    from hpc_rl.config.schema import AlgorithmConfig, CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer

    info = _need_parallel(ctx)
    training = TrainingConfig(**{"qkv_format": "thd", "global_batch_size": 8, "micro_batch_size": 2,
                                 **training_fields})
    algorithm = AlgorithmConfig(use_kl_loss=kl, kl_loss_coef=0.1 if kl else 0.0, kl_loss_type="low_var_kl",
                                eps_clip=0.2)
    hf = str(hf_dir or TINY_CHECKPOINT)
    parts = build_trainer(arch=arch or _tiny_arch(), training=training, algorithm=algorithm,
                          optimizer_config=optimizer or OptimizerConfig(lr=LR, lr_warmup_iters=0, clip_grad=1.0),
                          checkpoints=CheckpointConfig(hf_checkpoint=hf, ref_load=hf if kl else None, load=load),
                          info=info)
    if ctx.fake_faults:
        _with_fake_faults(parts, ctx.fake_faults)
    return parts


FAKE_FAULTS = {
    "loses_loaded_weights": "the first step with lr > 0 also moves every weight by 0.05 (as a mixed-precision "
                            "optimizer built before the load copies its random main params back)",
    "applies_nan_steps": "a step the optimizer skipped is reported applied",
    "stale_first_lr": "a step reported at lr 0 moves every weight by the full lr",
}
"""Faults of the optimizer the checks must catch, faked onto hpc_rl's real one (the dry-mode test's proof
that each optimizer check can fail on CPU, where today's optimizer has none of them)."""


def _with_fake_faults(parts: Any, faults: tuple[str, ...]) -> None:
    import torch

    real_step = parts.optimizer.step

    def step() -> Any:
        result = real_step()
        moved = 0.0
        if "loses_loaded_weights" in faults and result.lr > 0 and parts.optimizer.steps_done == 1:
            moved = 0.05
        if "stale_first_lr" in faults and result.lr == 0.0 and not result.skipped:
            moved = LR
        if moved:
            with torch.no_grad():
                for param in parts.actor.parameters():
                    param.add_(moved)
        if "applies_nan_steps" in faults and result.skipped:
            result = dataclasses.replace(result, skipped=False)
        return result

    parts.optimizer.step = step


def _weights(model: Any) -> dict[str, Any]:
    inner = model.module if hasattr(model, "module") else model
    return {name: p.detach().float().cpu().clone() for name, p in inner.named_parameters()}


def _loaded_weights(ctx: Context, dtype: Any) -> dict[str, Any]:
    """The tiny checkpoint in a model built as the actor is (its dtype), without an optimizer: what 'loaded'
    means."""
    from hpc_rl.config.schema import TrainingConfig
    from hpc_rl.training.model_provider import build_gpt_model
    from hpc_rl.weights.hf_import import load_hf_into_model

    model = build_gpt_model(_tiny_arch(), TrainingConfig(), params_dtype=dtype,
                            device="cpu" if ctx.on_cpu else "cuda")
    load_hf_into_model(model, TINY_CHECKPOINT, _tiny_arch(), tp_rank=0, tp_size=1)
    return {name: p.detach().float().cpu().clone() for name, p in model.named_parameters()}


def _group_lrs(optimizer: Any) -> list[float] | None:
    """The lrs in the param groups of the optimizer inside hpc_rl's (Megatron's scheduler sets them after each
    step, for the next one); None when it has none to show."""
    groups = getattr(getattr(optimizer, "optimizer", None), "param_groups", None)
    return sorted({float(group["lr"]) for group in groups}) if groups else None


def _largest_change(before: dict[str, Any], after: dict[str, Any]) -> float:
    return max((after[name] - before[name]).abs().max().item() for name in before)


def _loss_step(parts: Any, *, poison: bool = False) -> Any:
    """One optimizer step of a loss that raises one token's log-prob (NaN in one gradient when `poison`)."""
    import torch

    from hpc_rl.training.model_provider import forward_logits

    optimizer, actor = parts.optimizer, parts.actor
    tokens = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2]], device=next(actor.parameters()).device)
    optimizer.zero_grad()
    loss = -forward_logits(actor, tokens)[..., :24].float().log_softmax(-1)[..., 7].mean()
    loss.backward()
    if poison:
        param = next(p for p in actor.parameters() if p.requires_grad)
        grad = param.main_grad if getattr(param, "main_grad", None) is not None else param.grad
        grad.view(-1)[0] = float("nan")
    return optimizer.step()


def check_optimizer_keeps_loaded_weights(ctx: Context) -> dict[str, Any]:
    parts = _trainer(ctx)
    ctx.state["parts"] = parts
    loaded = _loaded_weights(ctx, next(parts.actor.parameters()).dtype)
    built = _weights(parts.actor)
    at_build = _largest_change(loaded, built)
    expect(at_build == 0.0, f"the actor does not hold the loaded weights after build_trainer (max |diff| {at_build})")
    result = _loss_step(parts)
    after = _weights(parts.actor)
    moved = _largest_change(loaded, after)
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
    before = _weights(parts.actor)
    steps = parts.optimizer.steps_done
    result = _loss_step(parts)
    expect(not result.skipped and math.isfinite(result.grad_norm) and result.grad_norm > 0,
           f"a finite step was not applied: {result}")
    expect(abs(result.lr - LR) < 1e-12, f"constant schedule: lr {result.lr}, expected {LR}")
    expect(parts.optimizer.steps_done == steps + 1, f"steps_done {parts.optimizer.steps_done} after {steps} + 1")
    moved = _largest_change(before, _weights(parts.actor))
    expect(moved > 0, "the step left every weight unchanged")
    return {"grad_norm": result.grad_norm, "lr": result.lr, "max_abs_change": moved}


def check_optimizer_nan_step(ctx: Context) -> dict[str, Any]:
    parts = _trainer(ctx)  # its own: an applied NaN step must not spoil the checks after it
    _loss_step(parts)  # Adam's moments exist, as in a run
    before, steps = _weights(parts.actor), parts.optimizer.steps_done
    result = _loss_step(parts, poison=True)
    moved = _largest_change(before, _weights(parts.actor))
    non_finite = sum(int(not t.isfinite().all()) for t in _weights(parts.actor).values())
    expect(result.skipped, f"a NaN gradient's step was reported applied: {result}")
    expect(moved == 0.0 and non_finite == 0, f"the NaN step changed the weights (max |diff| {moved}, "
                                             f"{non_finite} tensors non-finite)")
    expect(parts.optimizer.steps_done == steps, "a skipped step advanced the schedule")
    return {"reported_skipped": result.skipped, "max_abs_change": moved}


def check_optimizer_lr_warmup(ctx: Context) -> dict[str, Any]:
    from hpc_rl.config.schema import OptimizerConfig

    parts = _trainer(ctx, optimizer=OptimizerConfig(lr=LR, lr_warmup_fraction=0.5, clip_grad=1.0))
    parts.optimizer.set_run_length(4)  # warm-up of 2 steps: lr 0, then lr/2
    before, group_lrs = _weights(parts.actor), _group_lrs(parts.optimizer)
    first = _loss_step(parts)
    moved = _largest_change(before, _weights(parts.actor))
    second = _loss_step(parts)
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
    restored = _trainer(ctx, load=str(root))
    expect(restored.resumed is not None, "build_trainer did not resume from the checkpoint")
    difference = _largest_change(_weights(parts.actor), _weights(restored.actor))
    expect(difference == 0.0, f"restored weights differ by {difference}")
    expect(restored.optimizer.steps_done == parts.optimizer.steps_done,
           f"steps_done {restored.optimizer.steps_done} restored, {parts.optimizer.steps_done} saved")
    _loss_step(parts)
    _loss_step(restored)
    after = _largest_change(_weights(parts.actor), _weights(restored.actor))
    expect(after < 1e-6, f"the step after the restore differs by {after}: the optimizer state was not restored")
    return {"save_s": saved_s, "next_step_diff": after, "files": sum(1 for _ in root.rglob("*"))}


# ---- the trainer's rollout step --------------------------------------------------------------------------------
def _batch(vocab: int, count: int = 8, seed: int = 0) -> Any:
    import random

    from hpc_rl.training.train_batch import TrainBatch

    rng = random.Random(seed)
    tokens, responses = [], []
    for _ in range(count):
        prompt, response = rng.randint(2, 6), rng.randint(2, 6)
        tokens.append([rng.randrange(vocab) for _ in range(prompt + response)])
        responses.append(response)
    return TrainBatch(tokens=tokens, response_lengths=responses, loss_masks=[[1] * r for r in responses],
                      rewards=[rng.gauss(0, 1) for _ in tokens], rollout_logprobs=[[-1.0] * r for r in responses])


def _finite_metrics(metrics: dict[str, float]) -> list[str]:
    import math

    return [key for key, value in metrics.items() if isinstance(value, float) and not math.isfinite(value)]


def check_rollout_step_dense_kl(ctx: Context) -> dict[str, Any]:
    parts = _trainer(ctx, kl=True)
    ctx.state["kl_parts"] = parts
    metrics = parts.trainer.train_rollout(_batch(24))[0]
    kl = {key: value for key, value in metrics.items() if "kl" in key}
    expect(not _finite_metrics(metrics), f"non-finite metrics: {_finite_metrics(metrics)}")
    expect({"kl_loss", "ppo_kl"} <= set(kl) and abs(kl["kl_loss"]) < 1e-6 and abs(kl["ppo_kl"]) < 1e-6,
           f"the first step's KL to the reference and to the old policy (the same weights) is not 0: {kl}")
    return {key: metrics[key] for key in sorted(metrics) if "kl" in key or "loss" in key or "grad_norm" in key}


def check_rollout_step_moe_replay(ctx: Context) -> dict[str, Any]:
    from hpc_rl.tiny_model import TinyMoeSpec, make_tiny_moe_model

    layers, experts, topk = 3, 4, 2
    hf_dir = make_tiny_moe_model(ctx.scratch / "tiny_moe", TinyMoeSpec(num_hidden_layers=layers, dense_layers=1,
                                                                      num_experts=experts))
    arch = dataclasses.replace(_tiny_arch(), family="qwen3_moe", num_layers=layers, num_moe_experts=experts,
                               moe_ffn_hidden_size=32, moe_router_topk=topk, moe_layer_freq=[0, 1, 1],
                               tie_word_embeddings=False)
    parts = _trainer(ctx, arch=arch, hf_dir=hf_dir, kl=True, use_routing_replay=True, num_steps_per_rollout=2,
                     moe_token_dispatcher_type="alltoall")
    results = parts.trainer.train_rollout(_batch(24))
    expect(len(results) == 2, f"two steps per rollout expected, got {len(results)}")
    bad = [key for metrics in results for key in _finite_metrics(metrics)]
    expect(not bad, f"non-finite metrics: {bad}")
    router = {key: value for key, value in results[-1].items() if "router" in key or "moe" in key}
    expect(router.get("moe/replayed_routing_agreement") == 1.0,
           f"the training step did not route every token as the recorded pass did: {router}")
    return {"steps": len(results), **router}


# ---- weights to an engine on the same device, offload, the weight stream -----------------------------------------
def _fake_engine(answers: list[dict[str, Any]]) -> tuple[Any, str, Any]:
    """An HTTP server that hands each share to the receiver process and keeps its answers."""
    import subprocess
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    receiver = subprocess.Popen([sys.executable, str(TOOLS / "gpu_check_receiver.py")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status = 200
            for share in body["serialized_named_tensors"]:
                receiver.stdin.write(json.dumps({"share": share}) + "\n")
                receiver.stdin.flush()
                answer = json.loads(receiver.stdout.readline())
                answers.append(answer)
                status = 400 if "error" in answer else status
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}", receiver


def check_colocated_ipc(ctx: Context) -> dict[str, Any]:
    import torch
    from megatron.core import parallel_state

    from hpc_rl.weights.colocated_sender import ColocatedWeightSender
    from hpc_rl.weights.export import export_hf_state_dict

    if "parts" not in ctx.state:
        raise Skip("optimizer_keeps_loaded_weights did not build the trainer")
    actor, arch = ctx.state["parts"].actor, _tiny_arch()
    sender = ColocatedWeightSender(actor, arch, tp_group=parallel_state.get_tensor_model_parallel_group(), tp_size=1,
                                   rank=0, world_size=1, bucket_bytes=1 << 14, dtype=torch.bfloat16)
    answers: list[dict[str, Any]] = []
    server, url, receiver = _fake_engine(answers)
    try:
        report = sender.sync(version=1, engine_url=url, bucket_bytes=1 << 14, rank_engines=[[0, 0]], timeout_s=120)
    finally:
        server.shutdown()
        receiver.stdin.close()
        receiver.wait(timeout=60)
    errors = [a["error"] for a in answers if "error" in a]
    expect(not errors, f"the second process could not rebuild a share: {errors[:2]}")
    received = {name: entry for a in answers for name, entry in a["tensors"].items()}
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in export_hf_state_dict(actor, arch)}
    expect(set(received) == set(expected), f"names differ: {sorted(set(received) ^ set(expected))[:6]}")
    wrong = []
    for name, (shape, dtype, total, squares, device) in received.items():
        mine = expected[name].double()
        if (shape != list(mine.shape) or dtype != "torch.bfloat16" or device != torch.device(ctx.device).type
                or abs(total - mine.sum().item()) > 1e-6 * (1 + abs(total))
                or abs(squares - (mine * mine).sum().item()) > 1e-6 * (1 + squares)):
            wrong.append(name)
    expect(not wrong, f"{len(wrong)} tensor(s) rebuilt with other values/shapes/devices: {wrong[:4]}")
    return {"buckets": report["buckets"], "bytes": report["bytes"], "tensors": len(received),
            "receiver_devices": sorted({entry[4] for entry in received.values()})}


def check_offload_onload(ctx: Context) -> dict[str, Any]:
    import torch

    from hpc_rl.training.offload import TrainerOffload

    if "kl_parts" not in ctx.state:
        raise Skip("rollout_step_dense_kl did not build the trainer")
    parts = ctx.state["kl_parts"]
    offload = TrainerOffload(models=[parts.actor, parts.ref_model], optimizer=parts.optimizer)
    before = _weights(parts.actor)
    allocated = torch.cuda.memory_allocated() if not ctx.on_cpu else 0
    moved = offload.offload(["weights", "grads", "optimizer"])
    freed = allocated - (torch.cuda.memory_allocated() if not ctx.on_cpu else 0)
    sizes = [p.untyped_storage().nbytes() for p in parts.actor.parameters()]
    expect(all(size == 0 for size in sizes), "a weight's storage was not freed by the offload")
    back = offload.onload()
    difference = _largest_change(before, _weights(parts.actor))
    expect(difference == 0.0, f"the weights came back different (max |diff| {difference})")
    metrics = parts.trainer.train_rollout(_batch(24, seed=1))[0]
    expect(not _finite_metrics(metrics), "the step after the onload is not finite")
    figures = {"offload_bytes": moved["offload/bytes"], "onload_bytes": back["onload/bytes"],
               "offload_s": moved["offload/seconds"], "onload_s": back["onload/seconds"]}
    if not ctx.on_cpu:
        figures["device_bytes_freed"] = freed
        expect(freed >= 0.9 * moved["offload/bytes"], f"only {freed} of {moved['offload/bytes']} bytes left the GPU")
    return figures


def check_weight_stream(ctx: Context) -> dict[str, Any]:
    import torch
    from megatron.core import parallel_state

    from hpc_rl.engines.child_process import free_port
    from hpc_rl.weights.sender import WeightSender

    if "parts" not in ctx.state:
        raise Skip("optimizer_keeps_loaded_weights did not build the trainer")
    sender = WeightSender(ctx.state["parts"].actor, _tiny_arch(), tp_size=1, dp_rank=0, rank=0,
                          tp_group=parallel_state.get_tensor_model_parallel_group(), bucket_bytes=1 << 14,
                          dtype=torch.bfloat16)
    backend = "gloo" if ctx.on_cpu else "nccl"
    start = time.perf_counter()
    sender.connect("127.0.0.1", free_port(), 1, group_name="gpu_check", backend=backend, timeout_s=120)
    plan = sender.send_all()
    sender.synchronize()
    if not ctx.on_cpu:
        torch.cuda.synchronize()
    sender.close()
    expect(len(plan) > 1, f"{len(plan)} bucket(s): the plan should split the model at 16 KiB")
    return {"backend": backend, "buckets": len(plan), "bytes": sum(b.num_bytes for b in plan),
            "seconds": time.perf_counter() - start}


CHECKS: list[tuple[str, Callable[[Context], dict[str, Any]]]] = [
    ("nccl_init", check_nccl_init),
    ("logits_tiny", check_logits_tiny),
    ("logits_random_shape", check_logits_random_shape),
    ("params_on_device", check_params_on_device),
    ("optimizer_keeps_loaded_weights", check_optimizer_keeps_loaded_weights),
    ("optimizer_step", check_optimizer_step),
    ("optimizer_nan_step", check_optimizer_nan_step),
    ("optimizer_lr_warmup", check_optimizer_lr_warmup),
    ("optimizer_save_restore", check_optimizer_save_restore),
    ("rollout_step_dense_kl", check_rollout_step_dense_kl),
    ("rollout_step_moe_replay", check_rollout_step_moe_replay),
    ("colocated_ipc", check_colocated_ipc),
    ("offload_onload", check_offload_onload),
    ("weight_stream", check_weight_stream),
]


def run_check(name: str, check: Callable[[Context], dict[str, Any]], ctx: Context) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        figures = check(ctx)
        outcome = {"status": "passed", "figures": figures}
    except Skip as why:
        outcome = {"status": "skipped", "why": f"skipped: {why}"}
    except Exception as error:  # noqa: BLE001 - every failure is reported, the next check still runs
        outcome = {"status": "failed", "why": f"failed: {type(error).__name__}: {str(error)[:600]}",
                   "traceback": traceback.format_exc()[-2500:]}
    outcome["seconds"] = round(time.perf_counter() - start, 3)
    return outcome


def environment(device: str) -> dict[str, Any]:
    versions = {}
    for package in ("torch", "megatron.core", "transformers", "safetensors", "numpy", "transformer_engine",
                    "sglang"):
        try:
            module = importlib.import_module(package)
            versions[package] = str(getattr(module, "__version__", "present"))
        except Exception as error:  # noqa: BLE001
            versions[package] = f"missing ({type(error).__name__})"
    import torch

    import hpc_rl

    gpu = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else None
    return {"python": platform.python_version(), "hpc_rl": hpc_rl.__file__, "packages": versions, "gpu": gpu,
            "cuda": getattr(torch.version, "cuda", None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the dry mode (gloo)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the logits checks' dtype (the trainer runs bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--random-shape", choices=sorted(RANDOM_SHAPES), default=None,
                        help="the random Qwen3 of logits_random_shape (default: 0.5b on cuda, small on cpu)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="run only these checks (nccl_init always runs; one that needs an earlier check's "
                             "trainer says skipped)")
    parser.add_argument("--report", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--fake-fault", nargs="*", choices=sorted(FAKE_FAULTS), default=[],
                        help="tests only: fake these optimizer faults, to see the checks fail")
    args = parser.parse_args(argv)
    args.report.parent.mkdir(parents=True, exist_ok=True)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(REPO))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        report = {"device": "cuda", "error": "no CUDA device (torch.cuda.is_available() is False): run with "
                                             "--device cpu for the dry mode", "checks": {}}
        args.report.write_text(json.dumps(report, indent=1))
        print(report["error"], file=sys.stderr)
        return 2
    started = time.perf_counter()
    report: dict[str, Any] = {"device": args.device, "environment": environment(args.device), "checks": {}}
    with tempfile.TemporaryDirectory(prefix="hpc_rl_gpu_check_") as scratch:
        ctx = Context(device=args.device, dtype=getattr(torch, args.dtype), scratch=Path(scratch),
                      random_shape=args.random_shape or ("small" if args.device == "cpu" else "0.5b"),
                      fake_faults=tuple(args.fake_fault))
        report["fake_faults"] = list(args.fake_fault)
        if args.device == "cuda":
            try:
                report["layer_spec"] = _local_spec_on_cuda()
            except Exception as error:  # noqa: BLE001 - megatron.core missing: every check says so
                report["layer_spec"] = f"unknown ({type(error).__name__})"
        for name, check in CHECKS:
            if args.only is not None and name not in args.only and name != "nccl_init":
                continue
            # written before and after every check: a run killed by its time limit (a hung NCCL call) still
            # leaves what ran, and which check was running
            report["checks"][name] = {"status": "running", "why": "running: the process ended inside this check"}
            args.report.write_text(json.dumps(report, indent=1, default=str))
            outcome = run_check(name, check, ctx)
            report["checks"][name] = outcome
            args.report.write_text(json.dumps(report, indent=1, default=str))
            print(f"{name:<32} {outcome['status'].upper():<8} {outcome['seconds']:7.1f} s  "
                  f"{outcome.get('why', json.dumps(outcome.get('figures', {}))[:150])}", flush=True)
        if "info" in ctx.state:
            from hpc_rl.training.parallel import shutdown_parallel

            shutdown_parallel()
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["summary"] = {status: sorted(n for n, o in report["checks"].items() if o["status"] == status)
                         for status in ("passed", "failed", "skipped")}
    args.report.write_text(json.dumps(report, indent=1, default=str))
    print(f"report: {args.report} ({report['seconds']} s; {len(report['summary']['failed'])} failed, "
          f"{len(report['summary']['skipped'])} skipped)")
    return 1 if report["summary"]["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
