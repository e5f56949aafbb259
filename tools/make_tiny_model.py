"""Write a tiny Qwen3 checkpoint with a locally built tokenizer: `python tools/make_tiny_model.py OUT_DIR`."""
from hpc_rl.tiny_model import main

if __name__ == "__main__":
    main()
