"""The one place where hpc_rl bends Megatron-core to run on a CPU-only torch build.

Owns: the process-wide switches from notes/megatron-cpu.md that no Megatron config flag provides:
`torch.cuda.current_device()` -> `torch.device("cpu")` (RoPE, attention buffers, SP and DDP buffers
call it unconditionally) and `torch.cuda.synchronize()` -> no-op (dist_checkpointing calls it).
They are applied once, and only when CUDA is absent, so a GPU process is never touched.
One more is scoped, not process-wide: `tensor_cuda_is_identity()`, for building a pipeline stage
whose output layer shares the first stage's embedding (Megatron moves that weight with `.cuda()`
before all-reducing it over the embedding group, LanguageModule.setup_embeddings_and_output_layer).
Also owns the CPU-safe RNG set-up, the fusion switches every CPU `TransformerConfig` needs, and
`light_megatron_import()`, which keeps importing Megatron on CPU from costing seconds of start-up for
code it never runs there (issue 11).
Does not own process groups (`hpc_rl.training.parallel`) or model building.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_applied = False


def cuda_available() -> bool:
    """True when this process can use a GPU (the switches below are then never applied)."""
    return torch.cuda.is_available()


def apply_cpu_switches() -> bool:
    """Patch the two CUDA calls Megatron makes unconditionally; idempotent. Returns True if on CPU."""
    global _applied
    if cuda_available():
        return False
    if not _applied:
        torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        _applied = True
    return True


@contextmanager
def tensor_cuda_is_identity() -> Iterator[None]:
    """Within the block, `tensor.cuda()` returns the tensor itself on a CPU-only build (else no-op)."""
    if cuda_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def deferred_compile(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile` whose decorator use (`@torch.compile`, `torch.compile(fn, **kw)` on a function)
    calls `compile_fn` at the function's first call instead of at decoration. torch.compile is lazy
    itself (it compiles at the first call); only the ~2 s import of dynamo and inductor moves there,
    and a function never called on CPU (Megatron's fused kernels: fusions are off) never pays it.
    Anything else (a module, no function) goes to `compile_fn` at once."""

    def compile_later(model: Any = None, **options: Any) -> Any:
        if model is None:
            return lambda fn: compile_later(fn, **options)
        if not callable(model) or isinstance(model, torch.nn.Module) or not hasattr(model, "__code__"):
            return compile_fn(model, **options)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(compile_fn(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    return compile_later


@contextmanager
def light_megatron_import() -> Iterator[None]:
    """Import Megatron-core within this block (trainer start-up, CPU only; on a GPU it does nothing).

    Megatron binds `jit_fuser = torch.compile` at import and decorates its fused kernels with it, which
    imports torch dynamo and inductor (~2 s of CPU on this machine kind); within the block torch.compile
    is `deferred_compile(torch.compile)`, so a kernel compiles at its first call as before. Megatron's
    dynamic inference context imports wandb only to log from it (~0.8 s; hpc_rl's trainer never builds
    one), and its timers import torch.utils.tensorboard (and with it tensorboard, ~0.4 s) only to write
    timers to a writer hpc_rl never passes (hpc_rl writes its own event files: hpc_rl.telemetry): within
    the block these imports fail as when the packages are not installed (Megatron takes that path), and
    work again after (issue 23)."""
    if cuda_available() or "megatron.core" in sys.modules:
        yield
        return
    original_compile = torch.compile
    blocked = [name for name in UNUSED_BY_THE_TRAINER if name not in sys.modules]
    torch.compile = deferred_compile(original_compile)  # type: ignore[assignment]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  (import raises ImportError)
    try:
        yield
    finally:
        torch.compile = original_compile  # type: ignore[assignment]
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


UNUSED_BY_THE_TRAINER = ("wandb", "torch.utils.tensorboard")
"""What Megatron-core imports optionally (ImportError is a path it takes) and hpc_rl's CPU trainer never uses."""


def cpu_fusion_overrides() -> dict[str, Any]:
    """TransformerConfig fields that must be off on CPU (fused kernels are CUDA-only)."""
    return {
        "use_cpu_initialization": True,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "gradient_accumulation_fusion": False,
        "bias_dropout_fusion": False,
    }


def seed_megatron_rng(seed: int) -> None:
    """Seed torch and Megatron's TP RNG tracker; on CPU the tracker must be the inference one.

    The default tracker calls `torch.cuda.get_rng_state`. The inference tracker does not, but its
    dropout in TP regions is not per-rank, so train with dropout 0 on CPU.
    """
    from megatron.core import tensor_parallel

    on_cpu = not cuda_available()
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=on_cpu, force_reset=True)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=on_cpu)
    torch.manual_seed(seed)
