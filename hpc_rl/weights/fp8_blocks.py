"""Block-wise FP8 (e4m3) weights as FP8 releases store them: pure functions on tensors and names.

Owns: quantizing a weight into `weight` (float8_e4m3fn) + `weight_scale_inv` (float32, one per block) and
back (`quantize_blocks`, `dequantize_blocks`), the same over named tensors and plans (`quantize_named`,
`dequantize_named`, `send_entries`) and the engine's pairing of the two (`Fp8Intake`). Which checkpoints are
block-FP8 and which of their tensors they quantize is `hpc_rl.config.fp8_scheme` (`Fp8Blocks`, torch-free, so
validation and the controller read it too). Used by the weight sync (trainer side), the CPU engine and the HF
readers; no Megatron, no processes.

Conventions (FP8 releases such as Qwen/Qwen3-4B-Instruct-2507-FP8, Qwen3-30B-A3B-FP8; slime's
quantizer_fp8 and tools/convert_hf_to_fp8.py; SGLang's `block_quant_dequant`):
  * `quantization_config = {quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic",
    weight_block_size: [bn, bk]}` (128 x 128 in every release): `hpc_rl.config.fp8_scheme`.
  * A weight [n, k] is cut into ceil(n/bn) x ceil(k/bk) blocks; a partial block at the end is padded with
    zeros (which change no block maximum). Its scale `s = max(|block|) / 448` (448: e4m3's largest finite
    value; the maximum clamped to 1e-12 so an all-zero block gives zeros, not NaN), the stored weight
    `q = clamp(w / s, -448, 448)` in e4m3, and `weight_scale_inv = s`: despite the name it is the dequant
    multiplier, `w ~= q * weight_scale_inv` (SGLang multiplies by it).
  * ue8m0 scales (slime's `--force-fp8-ue8m0-scale`, DeepGEMM's `per_block_cast_to_fp8(use_ue8m0=True)`):
    `s = 2 ** ceil(log2(max / 448))`, a power of two >= the plain scale, still float32 in the same block
    layout (the packed layout DeepGEMM wants on Blackwell is the engine's to make).

Error of one round trip (round to nearest in e4m3: 3 mantissa bits, subnormal step 2**-9): every element
obeys |dequantize(quantize(w)) - w| <= max(|w| * 2**-4, s * 2**-10), s its block's scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from hpc_rl.config.fp8_scheme import SCALE_SUFFIX, Fp8Blocks

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
_AMAX_FLOOR = 1e-12

def _pad_to_blocks(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = weight.shape
    pad_rows, pad_cols = -rows % block[0], -cols % block[1]
    if pad_rows or pad_cols:
        weight = torch.nn.functional.pad(weight, (0, pad_cols, 0, pad_rows))
    return weight


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128), *,
                    ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [n, k] (any float dtype) -> (e4m3 [n, k], float32 scale_inv [ceil(n/bn), ceil(k/bk)])."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D weights; got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    padded = _pad_to_blocks(weight.detach().to(torch.float32), block)
    n_blocks, k_blocks = padded.shape[0] // block[0], padded.shape[1] // block[1]
    tiles = padded.view(n_blocks, block[0], k_blocks, block[1])
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=_AMAX_FLOOR)
    scale = amax / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    quantized = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    quantized = quantized.view(padded.shape)[:rows, :cols].contiguous()
    return quantized, scale.view(n_blocks, k_blocks).contiguous()


def dequantize_blocks(quantized: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 [n, k] and its block scales -> `dtype` [n, k] (computed in float32, cast once)."""
    rows, cols = quantized.shape
    expected = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale_inv of shape {tuple(scale_inv.shape)} does not fit a {rows}x{cols} weight in "
                         f"{block[0]}x{block[1]} blocks (expected {expected})")
    factors = scale_inv.to(torch.float32).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (quantized.to(torch.float32) * factors[:rows, :cols]).to(dtype)


def quantize_named(named: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Blocks
                   ) -> list[tuple[str, torch.Tensor]]:
    """Each quantized weight as (`name`, e4m3) then (`name_scale_inv`, float32); other tensors unchanged."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        if scheme.quantizes(name, tensor.shape):
            quantized, scale = quantize_blocks(tensor, scheme.block, ue8m0=scheme.ue8m0)
            out.extend(((name, quantized), (name + SCALE_SUFFIX, scale)))
        else:
            out.append((name, tensor))
    return out


def send_entries(hf_entries: Iterable[tuple[str, Sequence[int]]], dtype_of: Callable[[str], torch.dtype],
                 scheme: Fp8Blocks | None) -> list[tuple[str, list[int], torch.dtype]]:
    """What a sync sends for these (name, shape) entries (a plan's rows): each tensor in `dtype_of(name)`; with
    a scheme, each weight it quantizes in e4m3 plus its float32 scale_inv."""
    rows: list[tuple[str, list[int], torch.dtype]] = []
    for name, shape in hf_entries:
        if scheme is not None and scheme.quantizes(name, shape):
            rows.append((name, list(shape), FP8_DTYPE))
            rows.append((name + SCALE_SUFFIX, list(scheme.scale_shape(shape)), torch.float32))
        else:
            rows.append((name, list(shape), dtype_of(name)))
    return rows


class Fp8Intake:
    """Engine side of FP8 weight loads: e4m3 weights and their scales, dequantized in pairs.

    A weight and its `_scale_inv` may arrive in different calls (buckets); the first one waits here for the
    other. `pending()` names what is still waiting (a sync that ends with one is broken)."""

    def __init__(self, block: tuple[int, int], dtype: torch.dtype = torch.float32) -> None:
        self.block, self.dtype = block, dtype
        self._weights: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}

    def take(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The loadable tensors of `named`: the others as they are, each completed FP8 pair dequantized (the
        tensors are copied out of the caller's buffers before they wait)."""
        ready: list[tuple[str, torch.Tensor]] = []
        for name, tensor in named:
            if name.endswith(".weight" + SCALE_SUFFIX):
                weight_name = name.removesuffix(SCALE_SUFFIX)
                self._scales[weight_name] = tensor.clone()
            elif tensor.dtype == FP8_DTYPE:
                weight_name = name
                self._weights[weight_name] = tensor.clone()
            else:
                ready.append((name, tensor))
                continue
            if weight_name in self._weights and weight_name in self._scales:
                ready.append((weight_name, dequantize_blocks(self._weights.pop(weight_name),
                                                             self._scales.pop(weight_name), self.block, self.dtype)))
        return ready

    def pending(self) -> list[str]:
        return sorted({*self._weights, *(name + SCALE_SUFFIX for name in self._scales)})

    def clear(self) -> None:
        self._weights.clear()
        self._scales.clear()


def dequantize_named(named: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                     dtype: torch.dtype = torch.float32, *, source: str = "the checkpoint"
                     ) -> list[tuple[str, torch.Tensor]]:
    """A whole FP8 state (one checkpoint's tensors): every e4m3 weight dequantized with its scale_inv; a weight
    without its scale (or a scale without its weight) is a ValueError naming `source`."""
    intake = Fp8Intake(block, dtype)
    out = intake.take(named)
    if intake.pending():
        raise ValueError(f"{source}: FP8 tensors without their pair (weight and weight_scale_inv): "
                         f"{intake.pending()[:5]}")
    return out
