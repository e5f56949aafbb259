"""Block-FP8 checkpoints as their config.json describes them: pure, torch-free (validation and the controller
read it too; the tensor work is `hpc_rl.weights.fp8_blocks`).

Owns: `Fp8Blocks` (block shape, ue8m0 scales, modules kept unquantized) read from an FP8 release's
`quantization_config` (`from_quantization_config`, `read_fp8_blocks`), and which HF tensors such a checkpoint
stores as FP8 (`Fp8Blocks.quantizes`).

Facts (FP8 releases such as Qwen/Qwen3-4B-Instruct-2507-FP8, Qwen3-30B-A3B-FP8; slime's quantizer_fp8 and
tools/convert_hf_to_fp8.py; SGLang's Fp8Config):
  * `quantization_config = {quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic",
    weight_block_size: [bn, bk]}` (128 x 128 in every release); `modules_to_not_convert` lists modules kept
    in bf16, matched at dot boundaries as SGLang's `is_layer_skipped` does; `scale_fmt: "ue8m0"` marks
    power-of-two scales.
  * Quantized: the 2-D linear weights of the decoder layers (attention and MLP projections, routed and
    shared experts, MLA projections), each with `<name>_scale_inv`; not quantized: embeddings, lm_head, norms,
    router gates (`mlp.gate`), biases, and anything in `modules_to_not_convert`.
  * Another quant_method (AWQ, GPTQ, compressed-tensors) is not this module's: `read_fp8_blocks` answers None.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_rl.config.model import load_hf_config

SCALE_SUFFIX = "_scale_inv"
"""`<module>.weight` -> `<module>.weight_scale_inv`."""

_QUANTIZED_LINEAR = re.compile(
    r"^(?:model\.)?(?:layers|mtp\.layers)\.\d+\..*(?:_proj|_proj_with_mqa)\.weight$"
)
"""A decoder layer's projection weight: q/k/v/o_proj, gate/up/down_proj (dense, routed experts
`mlp.experts.E.*_proj`, `mlp.shared_experts.*_proj`), MLA's q_a/q_b/kv_a_proj_with_mqa/kv_b_proj."""


@dataclass(frozen=True)
class Fp8Blocks:
    """One checkpoint's block-FP8 scheme: block shape, scale rounding, modules kept unquantized."""

    block: tuple[int, int] = (128, 128)
    ue8m0: bool = False
    """Scales rounded up to powers of two (slime's --force-fp8-ue8m0-scale)."""
    modules_to_not_convert: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_quantization_config(cls, config: dict[str, Any], *, source: str = "quantization_config",
                                 ue8m0: bool = False) -> Fp8Blocks:
        """The scheme of an FP8 release's `quantization_config`; a ValueError names `source` and the field for
        anything else (another method, per-tensor scales, static activations)."""
        method = config.get("quant_method")
        if method != "fp8":
            raise ValueError(f"{source}: quant_method {method!r} is not 'fp8' (only block-FP8 checkpoints are "
                             "served with FP8 weight syncs)")
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{source}: fmt {config.get('fmt')!r}: only e4m3 is supported")
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"{source}: activation_scheme {config.get('activation_scheme')!r}: only 'dynamic' is "
                             "supported (static input scales are not synced)")
        block = config.get("weight_block_size")
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                             for b in block)):
            raise ValueError(f"{source}: weight_block_size {block!r} must be two positive integers such as "
                             "[128, 128] (per-tensor FP8 checkpoints are not supported)")
        skipped = config.get("modules_to_not_convert") or config.get("ignored_layers") or []
        return cls(block=(int(block[0]), int(block[1])), ue8m0=ue8m0 or config.get("scale_fmt") == "ue8m0",
                   modules_to_not_convert=tuple(str(m) for m in skipped))

    def to_quantization_config(self) -> dict[str, Any]:
        """The config.json entry a checkpoint of this scheme carries."""
        config: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(self.block)}
        if self.modules_to_not_convert:
            config["modules_to_not_convert"] = list(self.modules_to_not_convert)
        if self.ue8m0:
            config["scale_fmt"] = "ue8m0"
        return config

    def skips(self, module: str) -> bool:
        """`module` (a dotted path) is listed in modules_to_not_convert, matched at dot boundaries."""
        dotted = f".{module}."
        return any(f".{entry}." in dotted for entry in self.modules_to_not_convert)

    def quantizes(self, hf_name: str, shape: Sequence[int] | None = None) -> bool:
        """This HF tensor is stored as FP8 blocks (+ its `_scale_inv`) in a checkpoint of this scheme."""
        if shape is not None and len(shape) != 2:
            return False
        if not _QUANTIZED_LINEAR.match(hf_name):
            return False
        return not self.skips(hf_name.removesuffix(".weight"))

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        return (math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1]))


def read_fp8_blocks(checkpoint_dir: str | Path | None, *, ue8m0: bool = False) -> Fp8Blocks | None:
    """The block-FP8 scheme of an HF directory's config.json (None: no such file, unquantized, or another
    quant_method). An FP8 one this cannot serve (per-tensor scales, e5m2, static activations) is a ValueError
    naming the file and field."""
    if not checkpoint_dir or not (Path(checkpoint_dir) / "config.json").is_file():
        return None
    return fp8_blocks_of(load_hf_config(checkpoint_dir), Path(checkpoint_dir) / "config.json", ue8m0=ue8m0)


def fp8_blocks_of(hf_config: dict[str, Any], path: str | Path, *, ue8m0: bool = False) -> Fp8Blocks | None:
    """`read_fp8_blocks` of a config.json already read (`path`: the file, for messages)."""
    config = hf_config.get("quantization_config")
    if not config or config.get("quant_method") != "fp8":
        return None
    return Fp8Blocks.from_quantization_config(config, source=f"{path}: quantization_config", ue8m0=ue8m0)
