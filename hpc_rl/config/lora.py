"""LoRA settings (miles' `add_lora_arguments` flags, with miles' meanings) and what they resolve to.

Owns: the `lora` section of the run config, the names a target module may be given by (HF's projection names or
Megatron's layer names, and `all-linear`), resolving `target_modules` minus `exclude_modules` to the Megatron layers
and HF projections they adapt. Does not own the submit-time checks (`hpc_rl.config.lora_checks`), the adapters
themselves (`hpc_rl.training.lora`) nor their sync to the engines.

The flags (miles' `miles/utils/arguments.py`): `--lora-rank` (0: off), `--lora-alpha` (scale alpha / rank, as PEFT),
`--lora-dropout`, `--lora-type lora|canonical_lora` (lora: one adapter per Megatron layer, so a fused QKV or gate/up
layer shares its A across its slices; canonical_lora: one adapter per HF projection, PEFT's own layout),
`--target-modules` (all-linear, or comma-separated HF or Megatron names), `--exclude-modules`, `--lora-adapter-path`
(a PEFT adapter directory to start from), `--lora-sync-from-tensor`, `--lora-base-cpu-backup`, `--lora-train-only`.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    directory on the shared filesystem: CUDA IPC handles, so colocated engines only (--colocate, which implies it)."""
    lora_base_cpu_backup: bool = False
    """Colocated: the engines keep a host copy of the base weights across a memory release (SGLang's
    --enable-weights-cpu-backup), so a sync sends the adapter alone instead of the base and the adapter."""
    lora_train_only: bool = False
    """Train adapters, but the engines keep serving the frozen base (no adapter sync, no SGLang LoRA)."""
    save_hf_merged: bool = False
    """With --save-hf: also write the merged model (base + adapter, W + alpha/r B@A: an HF checkpoint transformers
    loads without PEFT) under <save_hf dir>/merged, beside the PEFT adapter files."""

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


def syncs_adapters(lora: LoraConfig) -> bool:
    """Whether the engines serve the trained adapter (LoRA on and not lora_train_only): they start from the base with
    SGLang's LoRA options (`engine_lora_options`) and every weight sync sends only the adapter."""
    return lora.enabled and not lora.lora_train_only


def engine_lora_options(lora: LoraConfig) -> dict[str, object]:
    """SGLang 0.5.23's server options (its own names) for engines that serve the run's adapter on the base; empty
    when they serve the base alone."""
    if not syncs_adapters(lora):
        return {}
    options: dict[str, object] = {"enable_lora": True, "max_lora_rank": lora.lora_rank,
                                  "lora_target_modules": target_projections(lora)}
    if lora.lora_base_cpu_backup:  # miles': colocated engines keep the base on the host across a release
        options["enable_weights_cpu_backup"] = True
    return options
