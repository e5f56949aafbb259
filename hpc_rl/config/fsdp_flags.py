"""slime's FSDP backend's flags (`--train-backend fsdp` and its FSDPArgs), read as the Megatron trainer's settings.

Owns: what each flag of slime's FSDP backend (slime/backends/fsdp_utils/arguments.py, THUDM/slime 1e03e9a3 to
0f9d7a0a, the line of scripts/run-qwen3-vl-8B-fsdp.sh) means for hpc_rl, which trains with Megatron-core only:
the settings it becomes (`--gradient-checkpointing` is Megatron's full recompute of every layer,
`--fsdp-cpu-offload` its optimizer CPU offload, `--warmup-ratio` its lr_warmup_fraction), the one line it prints
at submit (logger `hpc_rl.config`, shown by `python -m hpc_rl.submit`), or the reason it is refused. The flags
slime's FSDP line shares with Megatron (--lr, --context-parallel-size, ...) are ordinary fields.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("hpc_rl.config")

_FLASH = ("flash_attention_2", "flash_attention_3", "sdpa", "eager", "flex_attention")


@dataclass(frozen=True)
class FsdpFlag:
    """One FSDP-backend flag: its accepted values (None: any), the settings a value gives, the line printed."""

    note: str
    accepted: tuple[Any, ...] | None = None
    settings: Callable[[Any], dict[str, Any]] | None = None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


FSDP_FLAGS: dict[str, FsdpFlag] = {
    "train_backend": FsdpFlag(
        "hpc_rl trains with Megatron-core: the same policy loss, optimizer and weight sync as slime's FSDP backend; "
        "parallelism comes from the Megatron flags (default TP 1, PP 1: data parallel over every trainer GPU, the "
        "distributed optimizer sharding optimizer state across it as FSDP shards it)", accepted=("fsdp",)),
    "gradient_checkpointing": FsdpFlag(
        "Megatron's full activation recompute of every layer (recompute_granularity full, method uniform, 1 layer "
        "per unit): what FSDP's gradient checkpointing does", accepted=(True,),
        settings=lambda _: {"training.recompute_granularity": "full", "training.recompute_method": "uniform",
                            "training.recompute_num_layers": 1}),
    "attn_implementation": FsdpFlag(
        "names transformers' attention kernel; Megatron's attention runs Transformer Engine's fused attention "
        "(flash where the GPU has it) on cuda and an unfused float32 softmax on cpu", accepted=_FLASH),
    "fsdp_full_params": FsdpFlag(
        "the weight sync always gathers each tensor whole (TP/EP shards joined) under its HF name, bucket by "
        "bucket; no rank holds the whole model", accepted=(True, False)),
    "fsdp_state_dict_cpu_offload": FsdpFlag(
        "checkpoints are Megatron torch_dist, each rank writing its own shards; no full state dict is gathered on "
        "a GPU", accepted=(True, False)),
    "fsdp_cpu_offload": FsdpFlag(
        "Megatron's optimizer CPU offload (optimizer state in host memory, the optimizer step on the CPU)",
        accepted=(True,), settings=lambda _: {"optimizer.optimizer_cpu_offload": True}),
    "fsdp_cpu_backend": FsdpFlag(
        "host tensors move over gloo, device tensors over NCCL (gloo for everything on cpu)", accepted=("gloo",)),
    "warmup_ratio": FsdpFlag(
        "Megatron's lr_warmup_fraction (warm-up as a fraction of the decay iterations)",
        settings=lambda value: {"optimizer.lr_warmup_fraction": float(value)}),
}
"""slime FSDP flag -> what it does here (each prints one line at submit)."""

FSDP_REFUSED: dict[str, str] = {
    "fp16": "hpc_rl trains in bf16 on cuda (float32 on cpu); fp16 with loss scaling is not offered: drop it",
    "deterministic_mode": ("not offered: hpc_rl's GPU kernels (Transformer Engine, NCCL reductions) are not run in a "
                           "bitwise-deterministic mode; drop it"),
    "use_pytorch_profiler": "not offered: hpc_rl has no built-in profiler; run the trainer under nsys or torch.profiler",
    "profile_step_start": "not offered: hpc_rl has no built-in profiler (--use-pytorch-profiler)",
    "profile_step_end": "not offered: hpc_rl has no built-in profiler (--use-pytorch-profiler)",
    "memory_snapshot_path": "not offered: hpc_rl records no CUDA memory snapshots",
}
"""slime FSDP flags hpc_rl refuses, with the reason."""


class FsdpFlagError(ValueError):
    """A refused FSDP flag or value; the message says why."""


def fsdp_flag_settings(name: str, value: Any) -> dict[str, Any]:
    """The field settings of one FSDP flag (possibly none), after printing its one line; FsdpFlagError when refused.
    `--train-backend megatron` is hpc_rl's own behaviour and prints nothing."""
    if name in FSDP_REFUSED:
        raise FsdpFlagError(f"{_flag(name)} is refused: {FSDP_REFUSED[name]}")
    flag = FSDP_FLAGS[name]
    if name == "train_backend" and value == "megatron":
        return {}
    accepted = flag.accepted
    if accepted is not None and not any(isinstance(a, bool) == isinstance(value, bool) and a == value for a in accepted):
        raise FsdpFlagError(f"{_flag(name)} {value!r} is refused (accepted: {', '.join(map(repr, accepted))}): "
                            f"{flag.note}")
    shown = "" if value is True else f" {value}"
    log.info("%s%s: %s", _flag(name), shown, flag.note)
    return flag.settings(value) if flag.settings is not None else {}
