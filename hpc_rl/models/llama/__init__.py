"""Llama (dense): GQA without q/k norms; also what Megatron's plain GPT flags describe (no --qk-layernorm).

Layers: Megatron's GPT layer (`hpc_rl.training.layer_specs.gpt_layer_spec`); names: the shared GQA rows.
"""

from hpc_rl.models.registry import ModelFamily, lazy_hook

FAMILY = ModelFamily(
    name="llama",
    hf_model_types=("llama",),
    hf_architectures=("LlamaForCausalLM",),
    description="Llama-style dense decoders",
    hf_defaults={"use_qk_norm": False},
    make_tiny=lazy_hook("hpc_rl.models.llama.tiny:make_tiny"),
)
