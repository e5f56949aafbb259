"""HF safetensors -> Megatron torch_dist, with slime's command line. One rank, or torchrun (TP x PP x EP ranks):

    python tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint HF_DIR --save OUT_DIR
    python tools/convert_hf_to_torch_dist.py --model configs/models/qwen3_4B.yaml --hf-checkpoint HF_DIR --save OUT_DIR
    torchrun --nproc-per-node 2 tools/convert_hf_to_torch_dist.py ... --tensor-model-parallel-size 2
    torchrun --nproc-per-node 2 tools/convert_hf_to_torch_dist.py ... --expert-model-parallel-size 2   (MoE)
    torchrun --nproc-per-node 2 tools/convert_hf_to_torch_dist.py ... --pipeline-model-parallel-size 2 \
        --decoder-last-pipeline-num-layers 23                                          (uneven stages)

MODEL_ARGS are Megatron's model flags as in slime's scripts/models/*.sh (they may also override a
--model file's fields). The architecture is checked against HF_DIR/config.json and written to
OUT_DIR/model.yaml. Writes OUT_DIR/iter_0000000 and OUT_DIR/latest_checkpointed_iteration.txt;
loadable at any TP, PP and EP size as checkpoint.ref_load / checkpoint.load. Logic: hpc_rl.training.convert.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--hf-checkpoint", required=True, help="HF directory (config.json + *.safetensors)")
    parser.add_argument("--save", required=True, help="output checkpoint root")
    parser.add_argument("--model", default=None, help="architecture file, configs/models/*.yaml (or give MODEL_ARGS)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP ranks (MoE models)")
    parser.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                        help="expert TP ranks (MoE; default: the TP size, as Megatron)")
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                        help="layers of the first pipeline stage (default: an even split)")
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                        help="layers of the last pipeline stage (default: an even split)")
    args, model_flags = parser.parse_known_args(argv)

    import yaml

    from hpc_rl.config.megatron_model import architecture_from_argv

    try:
        arch, unused = architecture_from_argv(model_flags, hf_dir=args.hf_checkpoint, base_file=args.model)
    except ValueError as error:
        raise SystemExit(f"convert_hf_to_torch_dist: the model flags have problems:\n{error}") from None
    if unused:
        print(f"convert_hf_to_torch_dist: not used for conversion: {', '.join(unused)}", file=sys.stderr)
    model_file = Path(args.save) / "model.yaml"
    model_file.parent.mkdir(parents=True, exist_ok=True)
    model_file.write_text(yaml.safe_dump(arch.to_dict(), sort_keys=False))

    from hpc_rl.training.parallel import shutdown_parallel
    from hpc_rl.training.convert import hf_to_torch_dist

    out = hf_to_torch_dist(args.hf_checkpoint, str(model_file), args.save,
                           tensor_parallel_size=args.tensor_model_parallel_size,
                           pipeline_parallel_size=args.pipeline_model_parallel_size,
                           expert_parallel_size=args.expert_model_parallel_size,
                           expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                           first_stage_layers=args.decoder_first_pipeline_num_layers,
                           last_stage_layers=args.decoder_last_pipeline_num_layers)
    shutdown_parallel()
    print(out)


if __name__ == "__main__":  # dist_checkpointing.save spawns a helper process
    main()
