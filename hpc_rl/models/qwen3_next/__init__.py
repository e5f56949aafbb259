"""The Qwen3-Next / Qwen3.5 / Qwen3.6 family: hybrid Gated DeltaNet linear attention and gated full attention.

Its modules: `gdn_kernels` (the CPU twins of fla's gated delta rule and causal-conv1d), `cpu_twin` (installing
them, and packed samples, into Megatron's own GatedDeltaNet).
"""
