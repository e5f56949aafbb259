"""HF safetensors -> Megatron torch_dist. Run as a script (one rank) or under torchrun (TP x PP ranks):

    python tools/convert_hf_to_torch_dist.py --hf-checkpoint HF_DIR --model configs/models/qwen3_4B.yaml \
        --save OUT_DIR [--tensor-model-parallel-size N] [--pipeline-model-parallel-size M]
    torchrun --nproc-per-node 2 tools/convert_hf_to_torch_dist.py ... --tensor-model-parallel-size 2

Writes OUT_DIR/iter_0000000 and OUT_DIR/latest_checkpointed_iteration.txt; loadable at any TP and
PP size as checkpoint.ref_load / checkpoint.load. Logic: hpc_rl.training.convert.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-checkpoint", required=True, help="HF directory (config.json + *.safetensors)")
    parser.add_argument("--model", required=True, help="architecture file, configs/models/*.yaml")
    parser.add_argument("--save", required=True, help="output checkpoint root")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    args = parser.parse_args(argv)

    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.training.convert import hf_to_torch_dist

    out = hf_to_torch_dist(args.hf_checkpoint, args.model, args.save,
                           tensor_parallel_size=args.tensor_model_parallel_size,
                           pipeline_parallel_size=args.pipeline_model_parallel_size)
    shutdown_parallel()
    print(out)


if __name__ == "__main__":  # dist_checkpointing.save spawns a helper process
    main()
