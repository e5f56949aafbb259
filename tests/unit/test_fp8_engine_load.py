"""FP8 checkpoints on the CPU engine and the HF readers: a block-FP8 release (written by
`hpc_rl.weights.fp8_checkpoint`, laid out as Qwen3-*-FP8) loads as its dequantized weights, through the native
Qwen3 and through transformers (MoE, experts included), into the trainer's reader, and an FP8 sync's buckets
reach the engine's model dequantized with the same blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpc_rl.engines.cpu.__main__ import load_model
from hpc_rl.engines.cpu.weight_sync import load_named, named_tensors
from hpc_rl.config.fp8_scheme import Fp8Blocks
from hpc_rl.weights.fp8_blocks import FP8_DTYPE, Fp8Intake, dequantize_blocks, quantize_named
from hpc_rl.weights.fp8_checkpoint import write_fp8_checkpoint
from hpc_rl.weights.hf_import import HFTensorReader

BLOCK = (48, 48)  # smaller than the releases' 128 so the tiny shapes hold several blocks, partial ones included


def _expected(source: Path, fp8_dir: Path) -> dict[str, torch.Tensor]:
    """Each tensor of `source` as the FP8 checkpoint holds it, dequantized."""
    original, stored = load_file(str(source / "model.safetensors")), load_file(str(fp8_dir / "model.safetensors"))
    return {name: (dequantize_blocks(stored[name], stored[name + "_scale_inv"], BLOCK)
                   if stored[name].dtype == FP8_DTYPE else stored[name]) for name in original}


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, Path]:
    from hpc_rl.tiny_model import TinyModelSpec, make_tiny_model

    root = tmp_path_factory.mktemp("fp8")
    source = make_tiny_model(root / "bf", TinyModelSpec(seed=4))
    return source, write_fp8_checkpoint(source, root / "fp8", Fp8Blocks(block=BLOCK))


def test_the_tiny_release_is_laid_out_as_published_ones(dense) -> None:
    source, fp8_dir = dense
    config = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [48, 48] and config["quant_method"] == "fp8"
    assert "model.embed_tokens" in config["modules_to_not_convert"] and "model.norm" in config["modules_to_not_convert"]
    stored = load_file(str(fp8_dir / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == FP8_DTYPE
    assert stored["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)  # 64 x 128 in 48 x 48 blocks
    assert stored["model.layers.0.input_layernorm.weight"].dtype == torch.float32
    assert (fp8_dir / "tokenizer.json").is_file()


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_the_engine_serves_an_fp8_release_dequantized(dense, impl: str) -> None:
    source, fp8_dir = dense
    model = load_model(str(fp8_dir), impl, "eager")
    tensors = named_tensors(model)
    expected = _expected(source, fp8_dir)
    assert all(torch.equal(tensors[name], value) for name, value in expected.items())
    original = load_file(str(source / "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"]
    assert not torch.equal(tensors["model.layers.1.self_attn.q_proj.weight"], original)  # it is the FP8 one


def test_the_trainer_reader_dequantizes(dense) -> None:
    source, fp8_dir = dense
    reader = HFTensorReader(fp8_dir)
    for name, value in _expected(source, fp8_dir).items():
        assert torch.equal(reader[name], value), name


def test_an_fp8_sync_reaches_the_model_dequantized_across_buckets(dense) -> None:
    source, fp8_dir = dense
    model = load_model(str(fp8_dir), "native", "eager")
    generator = torch.Generator().manual_seed(5)
    new = {name: torch.randn(t.shape, generator=generator) for name, t in
           load_file(str(source / "model.safetensors")).items() if "layers.1" in name}
    sent = quantize_named(new.items(), Fp8Blocks(block=BLOCK))
    intake = Fp8Intake(BLOCK)
    for start in range(0, len(sent), 3):  # buckets that split pairs
        load_named(model, intake.take(sent[start:start + 3]))
    assert intake.pending() == []
    tensors, by_name = named_tensors(model), dict(sent)
    for name, value in new.items():
        if name + "_scale_inv" in by_name:
            assert torch.equal(tensors[name], dequantize_blocks(by_name[name], by_name[name + "_scale_inv"], BLOCK))
        else:
            assert torch.equal(tensors[name], value)


def test_moe_experts_of_an_fp8_release_load_dequantized(tmp_path: Path) -> None:
    from hpc_rl.tiny_model import TinyMoeSpec, make_tiny_moe_model

    source = make_tiny_moe_model(tmp_path / "moe", TinyMoeSpec())
    fp8_dir = write_fp8_checkpoint(source, tmp_path / "moe_fp8", Fp8Blocks(block=BLOCK))
    stored = load_file(str(fp8_dir / "model.safetensors"))
    experts = [n for n in stored if ".experts." in n and n.endswith("_proj.weight")]
    assert experts and all(stored[n].dtype == FP8_DTYPE for n in experts)
    assert all(stored[n].dtype != FP8_DTYPE for n in stored if n.endswith("mlp.gate.weight"))  # routers stay
    tensors = named_tensors(load_model(str(fp8_dir), "transformers", "eager"))
    for name in experts:
        assert torch.equal(tensors[name], dequantize_blocks(stored[name], stored[name + "_scale_inv"], BLOCK)), name


def test_unquantized_writes_drop_the_references_quantization_config(dense, tmp_path: Path) -> None:
    from hpc_rl.training.convert import write_hf_checkpoint

    source, fp8_dir = dense
    state = load_file(str(source / "model.safetensors"))
    plain = write_hf_checkpoint(state, tmp_path / "plain", fp8_dir)
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    quantized = write_hf_checkpoint(dict(quantize_named(state.items(), Fp8Blocks(block=BLOCK))), tmp_path / "q",
                                    fp8_dir)
    assert json.loads((quantized / "config.json").read_text())["quantization_config"]["weight_block_size"] == [48, 48]
    # the plain one is an ordinary checkpoint again: the engine loads it as written
    assert torch.equal(named_tensors(load_model(str(plain), "native", "eager"))["model.layers.0.mlp.up_proj.weight"],
                       state["model.layers.0.mlp.up_proj.weight"])
