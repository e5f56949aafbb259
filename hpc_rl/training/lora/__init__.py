"""LoRA on Megatron's tensor-parallel layers (issue 33): adapters beside a frozen base, saved and loaded as PEFT.

`adapter` owns one adapter's parameters and TP math, `attach` puts adapters on a model and freezes its base,
`peft_files` writes and reads PEFT's adapter files. The settings are `hpc_rl.config.lora.LoraConfig`.
"""
