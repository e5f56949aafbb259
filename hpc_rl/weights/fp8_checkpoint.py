"""Write a block-FP8 release of an HF checkpoint, laid out as the published ones (Qwen3-*-FP8).

Owns: `write_fp8_checkpoint(src, out, scheme)`: every weight `scheme.quantizes` becomes `<name>` in e4m3 plus
`<name>_scale_inv` (float32 blocks, `hpc_rl.weights.fp8_blocks`), every other tensor is copied as it is, the
other files (tokenizer, chat template) are copied, and config.json gains `quantization_config` (with
`modules_to_not_convert`: the modules of the tensors left unquantized, as slime's convert_hf_to_fp8 writes it).
Used by tests (a tiny FP8 engine checkpoint) and by `tools/make_fp8_checkpoint.py`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hpc_rl.config.fp8_scheme import Fp8Blocks
from hpc_rl.weights.fp8_blocks import quantize_named


def write_fp8_checkpoint(source_dir: str | Path, output_dir: str | Path, scheme: Fp8Blocks | None = None) -> Path:
    """`source_dir` (config.json + *.safetensors) as a block-FP8 checkpoint in `output_dir`; returns it."""
    from safetensors.torch import load_file, save_file

    source, output = Path(source_dir), Path(output_dir)
    scheme = scheme or Fp8Blocks()
    config = json.loads((source / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{source / 'config.json'}: the checkpoint is quantized already (quantization_config)")
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{source}: no *.safetensors files")
    output.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json",
                                                                                   "model.safetensors.index.json"):
            shutil.copyfile(path, output / path.name)
    kept: set[str] = set()
    weight_map: dict[str, str] = {}
    for path in files:
        state = load_file(str(path))
        kept.update(name.rsplit(".", 1)[0] for name, tensor in state.items()
                    if name.endswith(".weight") and not scheme.quantizes(name, tensor.shape))
        quantized = dict(quantize_named(state.items(), scheme))
        save_file({name: tensor.contiguous() for name, tensor in quantized.items()}, str(output / path.name),
                  metadata={"format": "pt"})
        weight_map.update({name: path.name for name in quantized})
    if len(files) > 1:
        total = sum((output / f.name).stat().st_size for f in files)
        (output / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    listed = Fp8Blocks(block=scheme.block, ue8m0=scheme.ue8m0,
                       modules_to_not_convert=tuple(sorted(kept | set(scheme.modules_to_not_convert))))
    config["quantization_config"] = listed.to_quantization_config()
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return output
