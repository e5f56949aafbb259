"""Write a tiny Qwen3 (or, with --family qwen3_moe / glm4_moe, MoE) checkpoint with a locally built tokenizer:
`python tools/make_tiny_model.py OUT_DIR [--family qwen3_moe]`."""
from hpc_rl.tiny_model import main

if __name__ == "__main__":
    main()
