"""The one place where hpc_rl bends Megatron-core to run on a CPU-only torch build.

Owns: the process-wide switches from notes/megatron-cpu.md that no Megatron config flag provides:
`torch.cuda.current_device()` -> `torch.device("cpu")` (RoPE, attention buffers, SP and DDP buffers
call it unconditionally) and `torch.cuda.synchronize()` -> no-op (dist_checkpointing calls it).
They are applied once, and only when CUDA is absent, so a GPU process is never touched.
One more is scoped, not process-wide: `tensor_cuda_is_identity()`, for building a pipeline stage
whose output layer shares the first stage's embedding (Megatron moves that weight with `.cuda()`
before all-reducing it over the embedding group, LanguageModule.setup_embeddings_and_output_layer).
Megatron's optimizer (`get_megatron_optimizer`, its mixed-precision and distributed classes, clipping) runs on CPU
with two more: `prepare_megatron_optimizer` (its small state tensors made on the host instead of `device='cuda'`,
in its own modules only) and the scoped `host_optimizer_calls` (CUDA type names for host tensors, `.cuda()` the
identity, during calls into it).
Also owns the CPU-safe RNG set-up, the fusion switches every CPU `TransformerConfig` needs, the MoE
ones (`prepare_megatron_moe`, `cpu_moe_overrides`: notes/megatron-moe-cpu.md), the MLA one
(`prepare_megatron_mla`), and
`light_megatron_import()`, which keeps importing Megatron on CPU from costing seconds of start-up for
code it never runs there (issue 11).
Does not own process groups (`hpc_rl.training.parallel`) or model building.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_applied = False
_moe_prepared = False
log = logging.getLogger(__name__)


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


class _HostTorch(types.ModuleType):
    """`torch` as Megatron's optimizer modules see it on a CPU-only build: everything is torch's own, except that a
    tensor asked for on `device="cuda"` (or `torch.device("cuda")`) is made on the host, where the parameters are."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        return _on_host(value) if name in _FACTORIES else value


_FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like", "arange"})


def _on_host(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


MEGATRON_OPTIMIZER_MODULES = (
    "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer", "megatron.core.optimizer.grad_scaler", "megatron.core.utils",
)
"""The modules whose `torch` becomes `_HostTorch` on CPU: Megatron's optimizer classes, gradient clipping, grad
scaler, and the torch fallbacks of apex's multi-tensor kernels (`local_multi_tensor_l2_norm` in megatron.core.utils)."""

_optimizer_prepared = False


def prepare_megatron_optimizer() -> None:
    """Make Megatron's optimizer (`get_megatron_optimizer`, its mixed-precision and distributed classes, clipping)
    runnable on a CPU-only build; idempotent, and nothing on a GPU.

    megatron-core 0.16.1 makes its small state tensors with a hard-coded `device='cuda'` (the unit loss scale
    `_scale_one`, `found_inf`, apex's dummy overflow buffers, the gradient norm's all-reduce buffer in
    `get_grad_norm_fp32`, the grad scaler's scale): these modules get `_HostTorch`, which makes them on the host.
    The rest of the switch is scoped (`host_optimizer_calls`)."""
    global _optimizer_prepared
    if _optimizer_prepared or cuda_available():
        return
    import importlib

    for name in MEGATRON_OPTIMIZER_MODULES:
        importlib.import_module(name).torch = _HostTorch()
    _optimizer_prepared = True


_TENSOR_TYPE = torch.Tensor.type


def _cuda_type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """`Tensor.type()` as a CUDA tensor answers (`torch.cuda.BFloat16Tensor`) for a host tensor; with arguments
    (a cast) torch's own."""
    name = _TENSOR_TYPE(self, *args, **kwargs)
    if args or kwargs or self.device.type != "cpu":
        return name
    return name.replace("torch.", "torch.cuda.", 1)


@contextmanager
def host_optimizer_calls() -> Iterator[None]:
    """Within the block (a call into Megatron's optimizer), on a CPU-only build: `Tensor.type()` names host tensors
    as CUDA ones, and `tensor.cuda()` returns the tensor itself. Megatron sorts parameters into its fp16/bf16 and
    fp32 groups by those names (`Float16OptimizerWithFloat16Params`, `DistributedOptimizer`) and asserts
    `torch.cuda.FloatTensor` gradients before clipping; its state loading moves tensors with `.cuda()`. On a GPU
    the block changes nothing."""
    if cuda_available():
        yield
        return
    prepare_megatron_optimizer()
    original_cuda = torch.Tensor.cuda
    torch.Tensor.type = _cuda_type_name  # type: ignore[method-assign,assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = _TENSOR_TYPE  # type: ignore[method-assign]
        torch.Tensor.cuda = original_cuda  # type: ignore[method-assign]


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


class _NoCudaStream:
    """Stands in for the CUDA side stream Megatron's alltoall dispatcher creates once per process."""


def _cpu_alltoall_split_sizes(self: Any, point: str, tokens_per_expert: Any = None) -> Any:
    """The CPU twin of `MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`.

    On GPU that method copies the split sizes to the host on a side stream at `cuda_dtoh_point`
    (as numpy arrays, which NCCL's all_to_all_single takes) and waits on an event at
    `cuda_sync_point`. On CPU everything already is on the host: at the same point the EP split sizes
    become lists of ints (gloo's all_to_all_single refuses tensors and numpy arrays as split sizes),
    and there is nothing to wait for. The dispatch itself, its permutations and its all-to-alls are
    Megatron's own code."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for attribute in ("input_splits", "output_splits"):
            value = getattr(self, attribute)
            if value is not None and not isinstance(value, list):
                setattr(self, attribute, [int(size) for size in value.tolist()])
    return tokens_per_expert


def _uneven_gather_twin(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron's `_gather_along_first_dim`, with its uneven case (`output_split_sizes`, which the
    alltoall dispatcher uses under TP > 1) done the way gloo can: NCCL all-gathers chunks of different
    sizes, gloo refuses them ("invalid tensor size"), so each rank's chunk is padded to the largest,
    gathered, and trimmed. Same result; equal sizes go to Megatron's own code."""

    @functools.wraps(original)
    def gather(input_: torch.Tensor, group: Any, output_split_sizes: Any = None, use_global_buffer: bool = False,
               ) -> torch.Tensor:
        sizes = None if output_split_sizes is None else [int(size) for size in output_split_sizes]
        if sizes is None or group.size() == 1 or len(set(sizes)) == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        import torch.distributed as dist

        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        chunks = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(chunks, padded.contiguous(), group=group)
        return torch.cat([chunk[:size] for chunk, size in zip(chunks, sizes)], dim=0)

    return gather


def prepare_megatron_moe() -> None:
    """Make Megatron's MoE layer runnable in this process; idempotent (call before building one).

    On any device: megatron-core 0.16.1's `RouterGatingLinearFunction` reads the module global
    `te_general_gemm`, defined only when Transformer Engine imports; without TE the router's forward
    raises NameError. It is set to None, which selects Megatron's own torch path (a TE install keeps
    its kernel). On CPU only: the alltoall token dispatcher's CUDA stream and host copies get their CPU
    twin (`_cpu_alltoall_split_sizes`), and its uneven TP all-gather (TP > 1) gloo's
    (`_uneven_gather_twin`), so slime's dispatcher runs on gloo as it is."""
    global _moe_prepared
    if _moe_prepared:
        return
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not cuda_available():
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoCudaStream()
        MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_alltoall_split_sizes
        mappings._gather_along_first_dim = _uneven_gather_twin(mappings._gather_along_first_dim)
    _moe_prepared = True


def _cp_rank_positions(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Megatron's `get_pos_emb_on_this_cp_rank` (this CP rank's two of 2*CP chunks) without its pinned CUDA
    index tensor: the CPU twin, the same chunks."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    picked = chunks.index_select(seq_dim, index)
    return picked.view(*picked.shape[:seq_dim], -1, *picked.shape[seq_dim + 2:])


def prepare_megatron_mla() -> None:
    """Make Megatron's MLA layer buildable without Transformer Engine; idempotent (call before building one).

    megatron-core 0.16.1's `multi_latent_attention` imports TE's layer classes from
    `megatron.core.extensions.transformer_engine`, which imports without TE by standing a MagicMock in for
    it: the import succeeds, `HAVE_TE` is set True and `TELinear` is a mock, so `MLASelfAttention.__init__`
    raises `isinstance() arg 2 must be a type` (its fp8 check). Without TE this sets the module to what its
    own ImportError branch would (HAVE_TE False, the TE classes None); a TE install is left alone. On CPU, YaRN's
    cos/sin cache under context parallelism gets `_cp_rank_positions` (Megatron pins a CUDA index tensor)."""
    from megatron.core.extensions import transformer_engine as te_extension
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding
    from megatron.core.transformer import multi_latent_attention

    if not te_extension.HAVE_TE and multi_latent_attention.HAVE_TE:
        multi_latent_attention.HAVE_TE = False
        for name in ("TEColumnParallelLinear", "TELinear", "Linear", "set_save_original_input"):
            setattr(multi_latent_attention, name, None)
    if not cuda_available():  # YaRN's cos/sin cache under CP slices with a pinned index tensor (CUDA-only)
        yarn_rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _cp_rank_positions


GPU_ONLY_MOE_KERNELS = {
    "moe_grouped_gemm": (False, "grouped GEMM is a GPU kernel; each local expert runs as its own MLP "
                                "(Megatron's SequentialMLP), the same math"),
    "moe_permute_fusion": (False, "fused token permutation is a GPU kernel; Megatron's unfused permutation "
                                  "runs, the same math"),
    "moe_enable_deepep": (False, "DeepEP is a GPU kernel; Megatron's alltoall dispatcher moves the same "
                                 "tokens to the same experts"),
}


def cpu_moe_overrides(fields: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The MoE TransformerConfig `fields` with GPU-only kernel choices turned off for a CPU build, and
    one note line per change (the numerics do not change: these are kernels, not math)."""
    changed = dict(fields)
    notes = []
    for name, (cpu_value, why) in GPU_ONLY_MOE_KERNELS.items():
        if changed.get(name) and changed[name] != cpu_value:
            changed[name] = cpu_value
            notes.append(f"{name}={fields[name]} on CPU: {why}")
    if changed.get("moe_token_dispatcher_type") == "flex":
        changed["moe_token_dispatcher_type"] = "alltoall"
        notes.append("moe_token_dispatcher_type=flex on CPU (DeepEP/HybridEP, GPU kernels): Megatron's alltoall "
                     "dispatcher runs instead, the same routing")
    return changed, notes
