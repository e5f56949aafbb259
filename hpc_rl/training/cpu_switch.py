"""The one place where hpc_rl bends Megatron-core to run on a CPU-only torch build.

Owns: the process-wide switches from notes/megatron-cpu.md that no Megatron config flag provides:
`torch.cuda.current_device()` -> `torch.device("cpu")` (RoPE, attention buffers, SP and DDP buffers
call it unconditionally) and `torch.cuda.synchronize()` -> no-op (dist_checkpointing calls it).
They are applied once, and only when CUDA is absent, so a GPU process is never touched.
One more is scoped, not process-wide: `tensor_cuda_is_identity()`, for building a pipeline stage
whose output layer shares the first stage's embedding (Megatron moves that weight with `.cuda()`
before all-reducing it over the embedding group, LanguageModule.setup_embeddings_and_output_layer).
Also owns the CPU-safe RNG set-up and the fusion switches every CPU `TransformerConfig` needs.
Does not own process groups (`hpc_rl.training.parallel`) or model building.
"""

from __future__ import annotations

from collections.abc import Iterator
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
