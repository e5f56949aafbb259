"""Write a block-FP8 copy of an HF checkpoint, laid out as FP8 releases (Qwen3-*-FP8) are:
`python tools/make_fp8_checkpoint.py SRC_DIR OUT_DIR [--block-size 128 128] [--ue8m0]`.

Real releases use 128 x 128 blocks; a tiny test model may use smaller ones (its config.json says which)."""

from __future__ import annotations

import argparse

from hpc_rl.config.fp8_scheme import Fp8Blocks
from hpc_rl.weights.fp8_checkpoint import write_fp8_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source", help="HF directory (config.json + *.safetensors), unquantized")
    parser.add_argument("output", help="directory to write the FP8 checkpoint to")
    parser.add_argument("--block-size", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"))
    parser.add_argument("--ue8m0", action="store_true", help="round block scales up to powers of two")
    args = parser.parse_args(argv)
    out = write_fp8_checkpoint(args.source, args.output, Fp8Blocks(block=tuple(args.block_size), ue8m0=args.ue8m0))
    print(out)


if __name__ == "__main__":
    main()
