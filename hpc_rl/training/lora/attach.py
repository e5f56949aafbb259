"""Putting LoRA adapters on a built Megatron GPTModel stage: which layers, their shapes under TP, initial values, and
freezing the base.

Owns: `apply_lora` (run after the model is built and its base weights loaded, before Megatron's DDP and optimizer
see it: every base parameter gets requires_grad False, so DDP gives it no gradient buffer and the optimizer no
state, and only the adapters are reduced and stepped), and PEFT's initial values (A: Kaiming-uniform with
a=sqrt(5), B: zeros), drawn whole from a generator seeded by the layer and sliced, so every TP rank holds its
part of the same matrix. Does not own the adapter's math (`adapter`, which also finds a model's adapters:
`adapters_of`) nor PEFT's files (`peft_files`).

MoE layers (routed experts) and multi-latent attention are refused with the reason (config.lora checks at submit).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator

import torch

from hpc_rl.config.lora import LoraConfig, adapted_layers
from hpc_rl.training.lora.adapter import LayerGeometry, LoraAdapter, LoraAdapters, SliceShape

MODULE_OF_LAYER = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp",
                   "linear_fc2": "mlp"}
HF_MODULE = {"self_attention": "self_attn", "mlp": "mlp"}


def _geometry(layer_name: str, base: torch.nn.Module, config, tp_size: int) -> LayerGeometry:  # noqa: ANN001
    out_local, in_local = base.weight.shape
    if layer_name == "linear_qkv":
        heads, groups, dim = config.num_attention_heads, config.num_query_groups or config.num_attention_heads, \
            config.kv_channels
        q, kv = heads * dim // tp_size, groups * dim // tp_size
        slices = (SliceShape("q_proj", q), SliceShape("k_proj", kv), SliceShape("v_proj", kv))
        geometry = LayerGeometry("column", in_local, out_local, slices, query_groups_local=groups // tp_size)
    elif layer_name == "linear_fc1":
        if not config.gated_linear_unit:
            raise ValueError("LoRA on linear_fc1 needs a gated MLP (gate_proj and up_proj): this model's is not")
        half = out_local // 2
        geometry = LayerGeometry("column", in_local, out_local, (SliceShape("gate_proj", half),
                                                                 SliceShape("up_proj", half)))
    else:
        hf_name = "o_proj" if layer_name == "linear_proj" else "down_proj"
        geometry = LayerGeometry("row", in_local, out_local, (SliceShape(hf_name, out_local),))
    if sum(s.out_local for s in geometry.slices) != out_local:
        raise ValueError(f"LoRA: {layer_name}'s weight {tuple(base.weight.shape)} does not match the model config's "
                         f"heads and sizes at TP={tp_size}")
    return geometry


def _tp() -> tuple[object, int, int]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None, 1, 0
    return (parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())


def _initial_values(adapter: LoraAdapter, layer_number: int, layer_name: str, seed: int, tp_rank: int) -> None:
    """PEFT's default initialisation: each A Kaiming-uniform (a=sqrt(5)) over its whole [r, in], B zeros."""
    geometry = adapter.geometry
    in_full = geometry.in_local * (adapter.tp_size if geometry.kind == "row" else 1)
    with torch.no_grad():
        for name, param in adapter.lora_A.items():
            generator = torch.Generator().manual_seed(seed + zlib.crc32(f"{layer_number}.{layer_name}.{name}".encode()))
            full = torch.empty(adapter.rank, in_full)
            torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
            if geometry.kind == "row":
                full = full[:, tp_rank * geometry.in_local:(tp_rank + 1) * geometry.in_local]
            param.copy_(full)
        for param in adapter.lora_B.values():
            param.zero_()


def _layers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        raise ValueError("LoRA: the model has no Megatron decoder (a GPTModel stage is expected)")
    yield from decoder.layers


def apply_lora(model: torch.nn.Module, lora: LoraConfig, *, seed: int = 1234) -> list[LoraAdapter]:
    """Adapters on the layers `lora.target_modules` names, on every transformer layer of this stage; the base
    frozen. Returns the adapters."""
    layers_wanted = adapted_layers(lora)
    tp_group, tp_size, tp_rank = _tp()
    for param in model.parameters():
        param.requires_grad_(False)
    made = []
    for layer in _layers(model):
        for layer_name, projections in layers_wanted.items():
            owner = getattr(layer, MODULE_OF_LAYER[layer_name])
            base = getattr(owner, layer_name, None)
            if base is None or getattr(owner, "experts", None) is not None or hasattr(owner, "router"):
                raise ValueError(f"LoRA: layer {layer.layer_number} has no dense {layer_name} (a MoE layer's experts "
                                 "get no adapters): exclude the MLP (--exclude-modules gate_proj,up_proj,down_proj)")
            config = base.config
            geometry = _geometry(layer_name, base, config, tp_size)
            norm = None
            if hasattr(base, "layer_norm_weight"):  # Transformer Engine's fused-norm column layer (GPU)
                norm = (base.layer_norm_weight, config.layernorm_epsilon, config.normalization)
            adapter = LoraAdapter(geometry, projections, rank=lora.lora_rank, scaling=lora.scaling,
                                  dropout=lora.lora_dropout, shared_a=lora.lora_type == "lora" and len(projections) > 1,
                                  dtype=base.weight.dtype, device=base.weight.device, tp_group=tp_group,
                                  tp_size=tp_size, sequence_parallel=bool(config.sequence_parallel), norm=norm)
            adapter.hf_prefix = f"model.layers.{layer.layer_number - 1}.{HF_MODULE[MODULE_OF_LAYER[layer_name]]}"
            _initial_values(adapter, layer.layer_number, layer_name, seed, tp_rank)
            if not isinstance(getattr(owner, "lora", None), LoraAdapters):
                owner.lora = LoraAdapters()
            owner.lora[layer_name] = adapter
            base.register_forward_hook(adapter.hook, with_kwargs=True)
            made.append(adapter)
    model.lora_settings = lora  # what `adapter_settings` reads back (the PEFT export's adapter_config)
    if not made:
        raise ValueError("LoRA: no layer of this model stage was adapted (check lora.target_modules)")
    return made


def adapter_settings(model: torch.nn.Module) -> LoraConfig | None:
    """The LoRA settings `apply_lora` put on `model` (found through any wrapper), or None for a model without
    adapters."""
    for module in model.modules():
        settings = getattr(module, "lora_settings", None)
        if isinstance(settings, LoraConfig):
            return settings
    return None


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (Megatron's, from named_parameters) is an adapter's."""
    return ".lora." in f".{name}"


def lora_actor(model: torch.nn.Module, lora: LoraConfig, *, seed: int, start_from_adapter: bool) -> torch.nn.Module:
    """The actor's stage with adapters (when lora.lora_rank > 0): the base frozen, the adapters from
    lora.lora_adapter_path when the run starts from it (not on a resume, whose checkpoint holds them)."""
    if not lora.enabled:
        return model
    apply_lora(model, lora, seed=seed)
    if start_from_adapter and lora.lora_adapter_path:
        from hpc_rl.training.lora.peft_files import load_peft_adapter

        load_peft_adapter(model, lora.lora_adapter_path)
    return model
