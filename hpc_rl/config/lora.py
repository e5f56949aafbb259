"""LoRA settings (miles' `add_lora_arguments` flags, with miles' meanings) and their submit-time checks.

Owns: the `lora` section of the run config, the names a target module may be given by (HF's projection names or
Megatron's layer names, and `all-linear`), resolving `target_modules` minus `exclude_modules` to the Megatron layers
and HF projections they adapt, and every LoRA problem a config can have (each names its field and what to do).
Does not own the adapters themselves (`hpc_rl.training.lora`) nor their sync to the engines.

The flags (miles' `miles/utils/arguments.py`): `--lora-rank` (0: off), `--lora-alpha` (scale alpha / rank, as PEFT),
`--lora-dropout`, `--lora-type lora|canonical_lora` (lora: one adapter per Megatron layer, so a fused QKV or gate/up
layer shares its A across its slices; canonical_lora: one adapter per HF projection, PEFT's own layout),
`--target-modules` (all-linear, or comma-separated HF or Megatron names), `--exclude-modules`, `--lora-adapter-path`
(a PEFT adapter directory to start from), `--lora-sync-from-tensor`, `--lora-base-cpu-backup`, `--lora-train-only`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_rl.config.model import ModelArchitecture
    from hpc_rl.config.schema import RunConfig

LORA_TYPES = ("lora", "canonical_lora")
ALL_LINEAR = "all-linear"
HF_PROJECTIONS: dict[str, tuple[str, str]] = {
    "q_proj": ("linear_qkv", "q"), "k_proj": ("linear_qkv", "k"), "v_proj": ("linear_qkv", "v"),
    "o_proj": ("linear_proj", ""), "gate_proj": ("linear_fc1", "gate"), "up_proj": ("linear_fc1", "up"),
    "down_proj": ("linear_fc2", ""),
}
"""HF projection name -> (the Megatron layer that holds it, its slice of that layer's output; '' = the whole)."""
MEGATRON_LAYERS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",),
}
"""Megatron layer name -> the HF projections it holds (in its output's order)."""
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_ADAPTER_FILES = ("adapter_config.json",)


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA: train low-rank adapters on a frozen base (miles' flags)."""

    lora_rank: int = 0
    """LoRA rank r (0: LoRA off, full fine-tuning)."""
    lora_alpha: int = 16
    """LoRA alpha: the adapter's output is scaled by alpha / rank (PEFT's scaling)."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's lora_dropout)."""
    lora_type: str = "lora"
    """lora: one adapter per Megatron layer (the fused QKV and gate/up layers share one A over their slices) |
    canonical_lora: one adapter per HF projection (q, k, v, gate, up apart), PEFT's layout on the HF model."""
    target_modules: str | None = None
    """Layers to adapt (required with lora_rank > 0): all-linear, or comma-separated HF names
    (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj) or Megatron names (linear_qkv,linear_proj,
    linear_fc1,linear_fc2)."""
    exclude_modules: str | None = None
    """Comma-separated names (HF or Megatron) taken out of target_modules."""
    lora_adapter_path: str | None = None
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) the adapters start from."""
    lora_sync_from_tensor: bool = False
    """Sync the adapter to the engines as tensors (SGLang's /load_lora_adapter_from_tensors) instead of a PEFT
    directory on the shared filesystem."""
    lora_base_cpu_backup: bool = False
    """Colocated: the engines keep a CPU copy of the base weights and skip re-sending the base each step."""
    lora_train_only: bool = False
    """Train adapters, but the engines keep serving the frozen base (no adapter sync, no SGLang LoRA)."""

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scaling(self) -> float:
        """PEFT's scaling of the adapter's output: alpha / rank."""
        return self.lora_alpha / self.lora_rank


def _names(text: str | None) -> list[str]:
    return [name.strip() for name in (text or "").split(",") if name.strip()]


def _as_projections(names: list[str]) -> tuple[list[str], list[str]]:
    """(HF projections the names mean, in HF order; names that are neither HF nor Megatron names)."""
    wanted, unknown = set(), []
    for name in names:
        if name in HF_PROJECTIONS:
            wanted.add(name)
        elif name in MEGATRON_LAYERS:
            wanted.update(MEGATRON_LAYERS[name])
        else:
            unknown.append(name)
    return [name for name in HF_PROJECTIONS if name in wanted], unknown


def target_projections(lora: LoraConfig) -> list[str]:
    """The HF projections adapted (target_modules minus exclude_modules, in HF order); ValueError naming the field
    for a name that is neither an HF projection nor a Megatron layer."""
    targets = _names(lora.target_modules)
    if targets == [ALL_LINEAR]:
        targets = list(HF_PROJECTIONS)
    wanted, unknown = _as_projections(targets)
    excluded, unknown_excluded = _as_projections(_names(lora.exclude_modules))
    for field, bad in (("lora.target_modules", unknown), ("lora.exclude_modules", unknown_excluded)):
        if bad:
            raise ValueError(f"{field}: {', '.join(map(repr, bad))} is not a module LoRA can adapt: use {ALL_LINEAR} or "
                             f"HF names ({','.join(HF_PROJECTIONS)}) or Megatron names ({','.join(MEGATRON_LAYERS)})")
    return [name for name in wanted if name not in excluded]


def adapted_layers(lora: LoraConfig) -> dict[str, tuple[str, ...]]:
    """Megatron layer name -> the HF projections of it that get adapters (only layers with at least one)."""
    projections = target_projections(lora)
    return {layer: tuple(name for name in held if name in projections) for layer, held in MEGATRON_LAYERS.items()
            if any(name in projections for name in held)}


def _architecture_problems(lora: LoraConfig, arch: ModelArchitecture, projections: list[str]) -> list[tuple[str, str]]:
    problems = []
    mlp = [name for name in projections if name not in ATTENTION_PROJECTIONS]
    if arch.is_moe and mlp:
        problems.append(("lora.target_modules", f"{','.join(mlp)} on a MoE model would adapt the routed experts, whose "
                         "adapters are not built (Megatron's grouped expert GEMMs need per-expert adapters and SGLang "
                         "its MoE LoRA layout): adapt the attention only (--exclude-modules "
                         "gate_proj,up_proj,down_proj)"))
    if arch.multi_latent_attention and any(name in ATTENTION_PROJECTIONS for name in projections):
        problems.append(("lora.target_modules", "multi-latent attention's projections (q_a/q_b/kv_a/kv_b) have no "
                         "adapters here: adapt the dense MLP only (--target-modules gate_proj,up_proj,down_proj) or "
                         "train without LoRA"))
    return problems


def lora_problems(config: RunConfig, arch: ModelArchitecture | None, *, check_files: bool = True
                  ) -> list[tuple[str, str]]:
    """(field, message) for every LoRA problem of `config`; empty when LoRA is off and no LoRA flag is set."""
    lora = config.lora
    if lora.lora_rank < 0:
        return [("lora.lora_rank", f"{lora.lora_rank} must be >= 0 (0: LoRA off)")]
    if not lora.enabled:
        set_flags = [name for name in ("target_modules", "exclude_modules", "lora_adapter_path", "lora_sync_from_tensor",
                                       "lora_base_cpu_backup", "lora_train_only") if getattr(lora, name)]
        return [(f"lora.{name}", "is set but lora_rank is 0 (LoRA off): give --lora-rank N, or drop it")
                for name in set_flags]
    problems: list[tuple[str, str]] = []
    if lora.lora_alpha <= 0:
        problems.append(("lora.lora_alpha", f"{lora.lora_alpha} must be > 0 (the scale is alpha / rank)"))
    if not 0.0 <= lora.lora_dropout < 1.0:
        problems.append(("lora.lora_dropout", f"{lora.lora_dropout} must be in [0, 1)"))
    if lora.lora_type not in LORA_TYPES:
        problems.append(("lora.lora_type", f"{lora.lora_type!r} must be one of {', '.join(LORA_TYPES)}"))
    if not lora.target_modules:
        problems.append(("lora.target_modules", f"is required with lora_rank > 0: give --target-modules {ALL_LINEAR} "
                         "(or e.g. q_proj,k_proj,v_proj,o_proj)"))
    else:
        try:
            projections = target_projections(lora)
        except ValueError as error:
            field, message = str(error).split(": ", 1)
            problems.append((field, message))
        else:
            if not projections:
                problems.append(("lora.exclude_modules", f"{lora.exclude_modules!r} excludes every target module: "
                                 "exclude fewer, or turn LoRA off (--lora-rank 0)"))
            elif arch is not None:
                problems += _architecture_problems(lora, arch, projections)
    if lora.lora_sync_from_tensor and lora.lora_train_only:
        problems.append(("lora.lora_sync_from_tensor", "and lora_train_only contradict each other (train-only engines "
                         "never receive the adapter): drop one"))
    if lora.lora_base_cpu_backup and not config.cluster.colocate:
        problems.append(("lora.lora_base_cpu_backup", "only applies to colocated engines (--colocate): drop it"))
    training = config.training
    if training.only_train_params_name_list or training.freeze_params_name_list:
        problems.append(("training.only_train_params_name_list", "LoRA trains the adapters only (the base is frozen): "
                         "drop --only-train-params-name-list / --freeze-params-name-list"))
    if check_files and lora.lora_adapter_path:
        path = Path(lora.lora_adapter_path)
        missing = [name for name in LORA_ADAPTER_FILES if not (path / name).is_file()]
        if missing:
            problems.append(("lora.lora_adapter_path", f"{path} has no {', '.join(missing)}: give a PEFT adapter "
                             "directory (what PeftModel.save_pretrained or --save-hf writes)"))
    problems += _run_problems(config)
    return problems


def _run_problems(config: RunConfig) -> list[tuple[str, str]]:
    """What a LoRA run can do today: the trainer trains adapters; the adapter sync to engines is not built."""
    problems = []
    if config.training.pipeline_model_parallel_size > 1 and config.checkpoint.save_hf:
        problems.append(("checkpoint.save_hf", "a LoRA actor's PEFT adapter is written by one pipeline stage: with "
                         "pipeline_model_parallel_size > 1 drop --save-hf (the torch_dist checkpoint holds the "
                         "adapters)"))
    if config.cluster.debug_train_only:
        return problems
    return problems + [("lora.lora_rank", "LoRA with rollout engines needs the adapter-only weight sync, which hpc_rl does not "
             "have yet: run trainer-only (--debug-train-only, e.g. SFT), or train without LoRA (--lora-rank 0)")]
