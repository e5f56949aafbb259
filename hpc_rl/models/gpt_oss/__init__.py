"""gpt-oss (OpenAI's gpt-oss-20b / -120b; transformers' GptOssForCausalLM) as an hpc_rl model family.

Owns, one module each: the architecture rules and config.json check (`architecture`), the Megatron
TransformerConfig fields and GPTModel's rotary (`layers`, the trainer's tier), the HF name map and layouts (`names`), reading the released
checkpoints (fused bf16 experts and the MXFP4 release) under the per-expert names (`checkpoint`), and the tiny
random checkpoint (`tiny`). The layers are Megatron's own: attention sinks are DotProductAttention's learnable
softmax offset, sliding windows its window_size / window_attn_skip_freq, the clamped SwiGLU with its linear
offset Megatron's gated MLP (quick GELU, glu_linear_offset, activation_func_clamp_value), the router and expert
biases add_bias_linear, YaRN GPTModel's yarn rotary.
"""
