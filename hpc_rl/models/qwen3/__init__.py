"""Qwen3 (dense): GQA with per-head q/k RMSNorm, no biases; the CPU engine's own forward (`native_qwen3`).

Layers: Megatron's GPT layer (`hpc_rl.training.layer_specs.gpt_layer_spec`); names: the shared GQA rows.
"""

from hpc_rl.models.registry import ModelFamily, lazy_hook

FAMILY = ModelFamily(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_architectures=("Qwen3ForCausalLM",),
    description="Qwen3 dense (0.6B-32B)",
    hf_defaults={"use_qk_norm": True},
    make_tiny=lazy_hook("hpc_rl.models.qwen3.tiny:make_tiny_model"),
    cpu_engine_loader=lazy_hook("hpc_rl.engines.cpu.native_qwen3:load_native_qwen3"),
    cpu_engine_support=lazy_hook("hpc_rl.engines.cpu.native_qwen3:native_support"),
)
