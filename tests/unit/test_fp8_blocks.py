"""hpc_rl.weights.fp8_blocks and hpc_rl.config.fp8_scheme: block-wise e4m3 quantization as FP8 releases store it,
and which checkpoints and tensors are FP8 (pure, no processes).

The error bound checked: round to nearest in e4m3 keeps 3 mantissa bits (relative error <= 2**-4) and steps
by 2**-9 below its smallest normal 2**-6, so every element obeys |dq - w| <= max(|w| * 2**-4, s * 2**-10), s
its block's scale (max |block| / 448; ue8m0: that rounded up to a power of two)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpc_rl.config.fp8_scheme import Fp8Blocks, read_fp8_blocks
from hpc_rl.weights.fp8_blocks import (
    FP8_DTYPE, Fp8Intake, dequantize_blocks, dequantize_named, quantize_blocks, quantize_named, send_entries,
)

RELEASE_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]}


def _bound(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, cols = weight.shape
    per_element = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return torch.maximum(weight.abs() * 2**-4, per_element * 2**-10)


@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (5, 7)])  # whole blocks, partial blocks, one partial
def test_round_trip_is_within_fp8_error(shape: tuple[int, int], ue8m0: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(shape, generator=generator) * torch.logspace(-3, 0, shape[1])).to(torch.bfloat16)
    quantized, scale = quantize_blocks(weight, (128, 128), ue8m0=ue8m0)
    assert quantized.dtype == FP8_DTYPE and tuple(quantized.shape) == shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    restored = dequantize_blocks(quantized, scale, (128, 128))
    error = (restored - weight.float()).abs()
    assert (error <= _bound(weight.float(), scale, (128, 128))).all(), error.max()
    assert error.max() > 0  # the bound is met by rounding, not by a copy


def test_hand_checked_tiny_block() -> None:
    # one 2x2 block: max 896 -> scale 2, so the values become 448, -1, 0.25 and 3.5 (all exact in e4m3)
    weight = torch.tensor([[896.0, -2.0], [0.5, 7.0]])
    quantized, scale = quantize_blocks(weight, (2, 2))
    assert scale.tolist() == [[2.0]]
    assert quantized.float().tolist() == [[448.0, -1.0], [0.25, 3.5]]
    # scale 2 again: 9 / 2 = 4.5 is in e4m3 (steps of 0.5 between 4 and 8); 19 / 2 = 9.5 is not (steps of 1
    # between 8 and 16) and rounds to 10 (a tie, to the even mantissa): its dequantized value is 20
    weight = torch.tensor([[896.0, 19.0], [9.0, 0.0]])
    quantized, scale = quantize_blocks(weight, (2, 2))
    assert dequantize_blocks(quantized, scale, (2, 2)).tolist() == [[896.0, 20.0], [9.0, 0.0]]


def test_partial_blocks_are_padded_with_zeros_and_zero_blocks_stay_zero() -> None:
    # 3x3 in 2x2 blocks: the right column and bottom row are partial blocks; their maxima are their own values
    weight = torch.tensor([[1.0, 2.0, 44.8], [3.0, 4.0, 0.0], [0.0, 0.0, 0.0]])
    quantized, scale = quantize_blocks(weight, (2, 2))
    assert torch.allclose(scale, torch.tensor([[4.0, 44.8], [1e-12, 1e-12]]) / 448)
    assert torch.equal(dequantize_blocks(quantized, scale, (2, 2))[2], torch.zeros(3))  # no NaN from 0 / 0
    assert quantized.float()[0, 2].item() == 448.0


def test_ue8m0_scales_are_powers_of_two_at_least_the_plain_scale() -> None:
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(300, 260, generator=generator) * 3
    _, plain = quantize_blocks(weight, (128, 128))
    quantized, scale = quantize_blocks(weight, (128, 128), ue8m0=True)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()  # exactly 2**e
    assert (scale >= plain).all() and (scale < 2 * plain).all()
    assert quantized.float().abs().max() <= 448
    # hand-checked: max 100 -> 100 / 448 = 0.2232 -> 2**-2
    assert quantize_blocks(torch.tensor([[100.0]]), (1, 1), ue8m0=True)[1].item() == 0.25


def test_which_names_a_release_quantizes() -> None:
    scheme = Fp8Blocks.from_quantization_config(
        {**RELEASE_CONFIG, "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.down_proj"]})
    quantized = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.3.mlp.experts.17.down_proj.weight",
                 "model.layers.3.mlp.shared_experts.up_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    kept = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias",
            "model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.down_proj.weight"]
    assert [name for name in quantized if scheme.quantizes(name)] == quantized
    assert [name for name in kept if scheme.quantizes(name)] == []
    # dot boundaries: "mlp.gate" skips the router, not gate_proj
    assert Fp8Blocks(modules_to_not_convert=("mlp.gate",)).quantizes("model.layers.0.mlp.gate_proj.weight")


def test_quantize_named_and_the_plan_agree() -> None:
    scheme = Fp8Blocks(block=(4, 4))
    named = [("model.layers.0.mlp.up_proj.weight", torch.randn(6, 8)), ("model.norm.weight", torch.ones(8))]
    sent = quantize_named(named, scheme)
    planned = send_entries([(n, t.shape) for n, t in named], lambda _: torch.bfloat16, scheme)
    assert [(n, list(t.shape), t.dtype) for n, t in sent] == [
        (n, s, torch.float32 if d == torch.bfloat16 else d) for n, s, d in planned]
    assert [row[0] for row in planned] == ["model.layers.0.mlp.up_proj.weight",
                                           "model.layers.0.mlp.up_proj.weight_scale_inv", "model.norm.weight"]
    assert planned[1][1] == [2, 2] and planned[0][2] == FP8_DTYPE and planned[2][2] == torch.bfloat16
    assert send_entries([(n, t.shape) for n, t in named], lambda _: torch.bfloat16, None)[0][2] == torch.bfloat16


def test_intake_pairs_a_weight_and_its_scale_across_calls() -> None:
    weight = torch.randn(6, 8)
    quantized, scale = quantize_blocks(weight, (4, 4))
    intake = Fp8Intake((4, 4))
    assert intake.take([("a.weight", quantized), ("model.norm.weight", torch.ones(2))])[0][0] == "model.norm.weight"
    assert intake.pending() == ["a.weight"]
    (name, restored), = intake.take([("a.weight_scale_inv", scale)])
    assert name == "a.weight" and torch.equal(restored, dequantize_blocks(quantized, scale, (4, 4)))
    assert intake.pending() == []
    with pytest.raises(ValueError, match="ckpt: FP8 tensors without their pair.*b.weight_scale_inv"):
        dequantize_named([("b.weight_scale_inv", scale)], (4, 4), source="ckpt")


def test_bad_quantization_configs_name_the_file_and_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {**RELEASE_CONFIG,
                                                                              "weight_block_size": None}}))
    with pytest.raises(ValueError, match=r"config.json: quantization_config: weight_block_size None"):
        read_fp8_blocks(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {**RELEASE_CONFIG, "fmt": "e5m2"}}))
    with pytest.raises(ValueError, match="fmt 'e5m2': only e4m3"):
        read_fp8_blocks(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq"}}))
    assert read_fp8_blocks(tmp_path) is None  # another method: not FP8 rollouts' business
    with pytest.raises(ValueError, match="quant_method 'awq' is not 'fp8'"):
        Fp8Blocks.from_quantization_config({"quant_method": "awq"})
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": RELEASE_CONFIG}))
    assert read_fp8_blocks(tmp_path) == Fp8Blocks(block=(128, 128))
    assert read_fp8_blocks(tmp_path, ue8m0=True).ue8m0
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert read_fp8_blocks(tmp_path) is None
    assert Fp8Blocks.from_quantization_config(Fp8Blocks(block=(32, 64)).to_quantization_config()).block == (32, 64)


def test_an_fp8_plan_quantizes_experts_and_keeps_routers_and_the_bias() -> None:
    from hpc_rl.weights.bucket_layout import compute_layout, pack_bucket
    from hpc_rl.weights.sender import _plan, wire_tensors

    layer = "model.layers.1.mlp"
    hf = {f"{layer}.experts.0.gate_proj.weight": (12, 8), f"{layer}.experts.0.up_proj.weight": (12, 8),
          f"{layer}.gate.weight": (4, 8), f"{layer}.gate.e_score_correction_bias": (4,),
          "model.layers.1.post_attention_layernorm.weight": (8,)}
    entries = [("fc1", list(hf.items())[:2]), ("router", list(hf.items())[2:4]), ("norm", list(hf.items())[4:])]
    scheme = Fp8Blocks(block=(8, 8))
    (bucket,) = _plan(entries, torch.bfloat16, bucket_bytes=10**6, fp8=scheme)
    dtypes = dict(zip(bucket.names, bucket.dtypes))
    assert dtypes == {f"{layer}.experts.0.gate_proj.weight": "float8_e4m3fn",
                      f"{layer}.experts.0.gate_proj.weight_scale_inv": "float32",
                      f"{layer}.experts.0.up_proj.weight": "float8_e4m3fn",
                      f"{layer}.experts.0.up_proj.weight_scale_inv": "float32",
                      f"{layer}.gate.weight": "bfloat16", f"{layer}.gate.e_score_correction_bias": "float32",
                      "model.layers.1.post_attention_layernorm.weight": "bfloat16"}
    assert bucket.num_bytes == 2 * (12 * 8) + 2 * 2 * 4 + 4 * 8 * 2 + 4 * 4 + 8 * 2
    assert compute_layout(bucket.names, bucket.dtypes, bucket.shapes).total_bytes == bucket.num_bytes
    # what send_bucket packs (float32 trainer weights) matches the plan tensor for tensor
    generator = torch.Generator().manual_seed(3)
    named = wire_tensors([(n, torch.randn(s, generator=generator)) for n, s in hf.items()], torch.bfloat16, scheme)
    position = {name: i for i, name in enumerate(bucket.names)}
    named.sort(key=lambda item: position[item[0]])
    _, layout = pack_bucket(named)
    assert layout.request_fields() == {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes}


def test_fp8_engines_get_their_own_mismatch_limit_and_unservable_ones_are_refused_at_submit(tmp_path: Path) -> None:
    from hpc_rl.config.model_checks import fp8_problems
    from hpc_rl.controller.logprob_guard import FP8_ENGINES_THRESHOLD, threshold_for
    from hpc_rl.config import load_config

    assert read_fp8_blocks("") is None and read_fp8_blocks(tmp_path / "absent") is None
    assert threshold_for("cpu", None, fp8_engines=True) == FP8_ENGINES_THRESHOLD
    assert threshold_for("cpu", None) == 1e-4 and threshold_for("cpu", 0.5, fp8_engines=True) == 0.5
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {**RELEASE_CONFIG,
                                                                              "activation_scheme": "static"}}))
    config = load_config([Path(__file__).resolve().parents[2] / "configs/tiny_cpu.yaml"])
    config.checkpoint.hf_checkpoint = str(tmp_path)
    (problem,) = fp8_problems(config)
    assert problem.where == "checkpoint.hf_checkpoint" and "activation_scheme 'static'" in problem.message
