"""LoRA's sizes from the model's shapes: adapter parameters per trainer GPU and the bytes one adapter sync moves.

Owns: the [r, in] / [out, r] shapes of every adapted HF projection of a dense layer (q/k/v/o, gate/up/down), how a
trainer GPU holds them under TP (column-parallel layers: A whole, B split; row-parallel: A split, B whole; with
lora_type lora one A per fused layer), and the bytes of the whole adapter in PEFT's layout (each projection its own
A), which is what an adapter sync sends. Pure arithmetic; `memory_plan` uses it for the frozen-base plan and
`--dry-run` prints its note.
"""

from __future__ import annotations

from hpc_rl.config.lora import MEGATRON_LAYERS, LoraConfig, adapted_layers
from hpc_rl.config.model import ModelArchitecture

COLUMN_LAYERS = ("linear_qkv", "linear_fc1")


def projection_shapes(arch: ModelArchitecture) -> dict[str, tuple[int, int]]:
    """HF projection -> (in, out) features of one dense layer."""
    h, d = arch.hidden_size, arch.kv_channels
    q, kv, ffn = arch.num_attention_heads * d, arch.num_query_groups * d, arch.ffn_hidden_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, ffn),
            "up_proj": (h, ffn), "down_proj": (ffn, h)}


def layer_adapter_parameters(arch: ModelArchitecture, lora: LoraConfig, tp: int = 1) -> int:
    """Adapter parameters of one transformer layer that one TP rank holds (tp=1: the whole layer's)."""
    shapes, r, total = projection_shapes(arch), lora.lora_rank, 0
    for layer, projections in adapted_layers(lora).items():
        column = layer in COLUMN_LAYERS
        shared = lora.lora_type == "lora" and len(projections) > 1
        for index, name in enumerate(projections):
            fan_in, fan_out = shapes[name]
            a = r * fan_in // (1 if column else tp)
            b = fan_out * r // (tp if column else 1)
            total += b + (0 if shared and index else a)
    return total


def adapter_sync_bytes(arch: ModelArchitecture, lora: LoraConfig, dtype_bytes: int = 2) -> int:
    """Bytes of the whole adapter in PEFT's layout (every projection its own A and B), all layers: what one adapter
    sync sends to an engine."""
    shapes, r = projection_shapes(arch), lora.lora_rank
    per_layer = sum(r * shapes[name][0] + shapes[name][1] * r
                    for projections in adapted_layers(lora).values() for name in projections)
    return per_layer * arch.num_layers * dtype_bytes


def lora_note(arch: ModelArchitecture, lora: LoraConfig, adapters: int, params_on_gpu: int) -> str:
    """The memory plan's note on a LoRA run (`--dry-run`)."""
    sync = adapter_sync_bytes(arch, lora)
    modules = ",".join(name for held in MEGATRON_LAYERS.values() for name in held
                       if any(name in p for p in adapted_layers(lora).values()))
    return (f"LoRA r={lora.lora_rank} on {modules}: {adapters:,} adapter parameters per trainer GPU trained "
            f"({100 * adapters / max(1, params_on_gpu):.2f}% of its {params_on_gpu:,}); the frozen base has no "
            f"gradients and no optimizer state; an adapter sync sends {sync / 2**20:.1f} MiB (bf16)")
