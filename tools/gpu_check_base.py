"""What the checks of tools/gpu_check.py share: their outcomes (`Skip`, `CheckFailed`), the `Context` they pass
along, the tiny model's paths, a trainer built through hpc_rl's `build_trainer` (with the faults the dry-mode test
fakes into its optimizer), and small helpers over weights and batches. Owns no check."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
TINY_MODEL = REPO / "configs" / "models" / "tiny_qwen3.yaml"
TINY_CHECKPOINT = REPO / "assets" / "tiny_qwen3"
LR = 1e-3
"""The optimizer checks' learning rate (constant, no warm-up, unless a check says otherwise)."""


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


def local_spec_on_cuda() -> str:
    """Without Transformer Engine the trainer's cuda model cannot be built: build Megatron's local spec there."""
    from hpc_rl.training import model_provider

    try:
        importlib.import_module("transformer_engine")
        return "transformer_engine"
    except Exception:  # noqa: BLE001 - as layer_specs.use_transformer_engine
        model_provider.use_transformer_engine = lambda device: False
        return "local"


def need_parallel(ctx: Context) -> Any:
    if "info" not in ctx.state:
        raise Skip("nccl_init did not pass")
    return ctx.state["info"]


def tiny_arch() -> Any:
    from hpc_rl.config.model import ModelArchitecture

    return ModelArchitecture.from_yaml(TINY_MODEL)


def trainer_parts(ctx: Context, *, optimizer: Any = None, load: str | None = None, kl: bool = False,
             arch: Any = None, hf_dir: Path | None = None, **training_fields: Any) -> Any:
    from hpc_rl.config.sections.algorithm import AlgorithmConfig
    from hpc_rl.config.sections.training import CheckpointConfig, OptimizerConfig, TrainingConfig
    from hpc_rl.training.actor import build_trainer

    info = need_parallel(ctx)
    training = TrainingConfig(**{"qkv_format": "thd", "global_batch_size": 8, "micro_batch_size": 2,
                                 **training_fields})
    algorithm = AlgorithmConfig(use_kl_loss=kl, kl_loss_coef=0.1 if kl else 0.0, kl_loss_type="low_var_kl",
                                eps_clip=0.2)
    hf = str(hf_dir or TINY_CHECKPOINT)
    parts = build_trainer(arch=arch or tiny_arch(), training=training, algorithm=algorithm,
                          optimizer_config=optimizer or OptimizerConfig(lr=LR, lr_warmup_iters=0, clip_grad=1.0),
                          checkpoints=CheckpointConfig(hf_checkpoint=hf, ref_load=hf if kl else None, load=load),
                          info=info)
    if ctx.fake_faults:
        with_fake_faults(parts, ctx.fake_faults)
    return parts


FAKE_FAULTS = {
    "loses_loaded_weights": "the first step with lr > 0 also moves every weight by 0.05 (as a mixed-precision "
                            "optimizer built before the load copies its random main params back)",
    "applies_nan_steps": "a step the optimizer skipped is reported applied",
    "stale_first_lr": "a step reported at lr 0 moves every weight by the full lr",
}
"""Faults of the optimizer the checks must catch, faked onto hpc_rl's real one (the dry-mode test's proof
that each optimizer check can fail on CPU, where today's optimizer has none of them)."""


def with_fake_faults(parts: Any, faults: tuple[str, ...]) -> None:
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


def weights_of(model: Any) -> dict[str, Any]:
    inner = model.module if hasattr(model, "module") else model
    return {name: p.detach().float().cpu().clone() for name, p in inner.named_parameters()}


def largest_change(before: dict[str, Any], after: dict[str, Any]) -> float:
    return max((after[name] - before[name]).abs().max().item() for name in before)


def loss_step(parts: Any, *, poison: bool = False) -> Any:
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


def rollout_batch(vocab: int, count: int = 8, seed: int = 0) -> Any:
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


def non_finite_metrics(metrics: dict[str, float]) -> list[str]:
    import math

    return [key for key, value in metrics.items() if isinstance(value, float) and not math.isfinite(value)]
