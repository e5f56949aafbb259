"""Megatron torch_dist -> HF safetensors on one CPU process (no GPU needed), with slime's command line:

    python tools/convert_torch_dist_to_hf.py --input-dir CKPT/iter_0000020 --output-dir HF_OUT --origin-hf-dir HF_DIR
    python tools/convert_torch_dist_to_hf.py ${MODEL_ARGS[@]} --input-dir CKPT --output-dir HF_OUT --origin-hf-dir HF_DIR

The architecture comes from MODEL_ARGS (Megatron's model flags), --model FILE, or the model.yaml that
tools/convert_hf_to_torch_dist.py and hpc_rl.submit write beside checkpoints (looked up in the input
dir and the two above it). --origin-hf-dir: config.json, tokenizer and generation files are copied
from there (and config.json is checked against the architecture). The older spellings --load,
--output and --hf-reference still work. Logic: hpc_rl.training.convert.

A LoRA run's checkpoint (adapters beside the frozen base) takes the run's LoRA flags (miles' names: --lora-rank,
--lora-alpha, --lora-type, --target-modules, --exclude-modules) and --merge-lora (the HF output is the base with the
adapter merged; without it, the base) and/or --lora-adapter-out DIR (the adapter as a PEFT directory):

    python tools/convert_torch_dist_to_hf.py --input-dir CKPT --output-dir MERGED --origin-hf-dir HF_DIR \
        --lora-rank 8 --lora-alpha 16 --target-modules all-linear --merge-lora --lora-adapter-out PEFT_DIR
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

MODEL_FILE_NAME = "model.yaml"


def _model_file_beside(checkpoint: str) -> str | None:
    start = Path(checkpoint).resolve()
    for directory in (start, start.parent, start.parent.parent):
        if (directory / MODEL_FILE_NAME).is_file():
            return str(directory / MODEL_FILE_NAME)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--input-dir", "--load", dest="input_dir", required=True,
                        help="torch_dist checkpoint root or iteration directory")
    parser.add_argument("--output-dir", "--output", dest="output_dir", required=True, help="HF directory to write")
    parser.add_argument("--origin-hf-dir", "--hf-reference", dest="origin_hf_dir", default=None,
                        help="original HF dir: config.json + tokenizer to copy")
    parser.add_argument("--model", default=None, help="architecture file (or give MODEL_ARGS)")
    parser.add_argument("--lora-rank", type=int, default=0, help="a LoRA run's checkpoint: its rank (0: no LoRA)")
    parser.add_argument("--lora-alpha", type=int, default=16)
    parser.add_argument("--lora-type", default="lora", choices=["lora", "canonical_lora"])
    parser.add_argument("--target-modules", default=None)
    parser.add_argument("--exclude-modules", default=None)
    parser.add_argument("--merge-lora", action="store_true", help="write the base with the adapter merged")
    parser.add_argument("--lora-adapter-out", default=None, help="write the adapter as a PEFT directory here")
    args, model_flags = parser.parse_known_args(argv)

    import yaml

    from hpc_rl.config.megatron_model import architecture_from_argv

    base_file = args.model or (None if model_flags else _model_file_beside(args.input_dir))
    try:
        arch, unused = architecture_from_argv(model_flags, hf_dir=args.origin_hf_dir, base_file=base_file)
    except ValueError as error:
        raise SystemExit(f"convert_torch_dist_to_hf: {error}\n  (looked for {MODEL_FILE_NAME} beside "
                         f"{args.input_dir})") from None
    if unused:
        print(f"convert_torch_dist_to_hf: not used for conversion: {', '.join(unused)}", file=sys.stderr)

    from hpc_rl.config.lora import LoraConfig, target_projections
    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.training.convert import torch_dist_to_hf

    lora = LoraConfig(lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_type=args.lora_type,
                      target_modules=args.target_modules, exclude_modules=args.exclude_modules)
    if lora.enabled:
        try:
            if not target_projections(lora):
                raise ValueError("no module to adapt: give the run's --target-modules (and --exclude-modules)")
        except ValueError as error:
            raise SystemExit(f"convert_torch_dist_to_hf: {error}") from None
    with tempfile.TemporaryDirectory() as scratch:
        model_file = Path(scratch) / MODEL_FILE_NAME
        model_file.write_text(yaml.safe_dump(arch.to_dict(), sort_keys=False))
        try:
            out = torch_dist_to_hf(args.input_dir, str(model_file), args.output_dir, hf_reference=args.origin_hf_dir,
                                   lora=lora, adapter_out=args.lora_adapter_out, merge_lora=args.merge_lora)
        except ValueError as error:
            raise SystemExit(f"convert_torch_dist_to_hf: {error}") from None
    shutdown_parallel()
    print(out)


if __name__ == "__main__":
    main()
