"""Megatron torch_dist -> HF safetensors, on one CPU process (no GPU needed):

    python tools/convert_torch_dist_to_hf.py --load CKPT_DIR --model configs/models/qwen3_4B.yaml \
        --output HF_OUT [--hf-reference ORIGINAL_HF_DIR]

CKPT_DIR is a checkpoint root (with latest_checkpointed_iteration.txt) or one iter_XXXXXXX dir.
--hf-reference: config.json, tokenizer and generation files are copied from there (and config.json
is checked against the model file). Logic: hpc_rl.training.convert.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="torch_dist checkpoint root or iteration directory")
    parser.add_argument("--model", required=True, help="architecture file, configs/models/*.yaml")
    parser.add_argument("--output", required=True, help="HF directory to write")
    parser.add_argument("--hf-reference", default=None, help="original HF dir: config.json + tokenizer to copy")
    args = parser.parse_args(argv)

    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.training.convert import torch_dist_to_hf

    out = torch_dist_to_hf(args.load, args.model, args.output, hf_reference=args.hf_reference)
    shutdown_parallel()
    print(out)


if __name__ == "__main__":
    main()
