"""HF base + PEFT LoRA adapter -> one merged HF checkpoint (transformers loads it without PEFT):

    python tools/merge_lora_adapter.py --base HF_DIR --adapter PEFT_DIR --output-dir MERGED

Each adapted projection's weight becomes W + (alpha / r) * B @ A, as PEFT's merge_and_unload; config.json,
tokenizer and generation files are copied from the base. Logic: hpc_rl.training.convert.merge_adapter_dir.
An adapter in a torch_dist checkpoint: tools/convert_torch_dist_to_hf.py --lora-rank ... --merge-lora (or
--lora-adapter-out).
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--base", required=True, help="HF checkpoint directory the adapter was trained on")
    parser.add_argument("--adapter", required=True, help="PEFT adapter directory (adapter_config.json + "
                        "adapter_model.safetensors; what --save-hf writes for a LoRA run)")
    parser.add_argument("--output-dir", required=True, help="merged HF directory to write")
    args = parser.parse_args(argv)

    from hpc_rl.training.convert import merge_adapter_dir

    try:
        print(merge_adapter_dir(args.base, args.adapter, args.output_dir))
    except ValueError as error:
        raise SystemExit(f"merge_lora_adapter: {error}") from None


if __name__ == "__main__":
    main()
