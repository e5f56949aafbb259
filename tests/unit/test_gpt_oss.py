"""gpt-oss as data: its config.json check, slime's flags, the HF name map, fused / MXFP4 experts (no processes)."""

from __future__ import annotations

import dataclasses
import shlex

import pytest
import torch

from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
from hpc_rl.models.gpt_oss.architecture import architecture_fields_from_hf, window_layers
from hpc_rl.models.gpt_oss.checkpoint import (
    PerExpertReader, dequantize_mxfp4, fuse_experts, fused_state, is_mxfp4, unfuse_experts,
)

HF_20B = {  # openai/gpt-oss-20b's config.json, the fields the check reads
    "model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True, "num_local_experts": 32,
    "num_experts_per_tok": 4, "sliding_window": 128, "swiglu_limit": 7.0, "max_position_embeddings": 131072,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
}
SLIME_LINE = (  # slime's scripts/models/gpt-oss-20B.sh (before slime dropped it), MODEL_ARGS
    "--spec slime_plugins.models.gpt_oss get_gpt_oss_spec --num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880 "
    "--num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 64 --seq-length 4096 "
    "--max-position-embeddings 131072 --padded-vocab-size 201088 --make-vocab-size-divisible-by 128 "
    "--tokenizer-type HuggingFaceTokenizer --bf16 --normalization RMSNorm --untie-embeddings-and-output-weights "
    "--no-masked-softmax-fusion --no-rope-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --use-mcore-models "
    "--rotary-percent 1.0 --rotary-base 150000 --position-embedding-type rope --use-rope-scaling "
    "--rope-scaling-factor 32 --num-experts 32 --moe-ffn-hidden-size 2880 --moe-router-topk 4 "
    "--moe-router-score-function softmax --quick-geglu --glu-linear-offset 1.0 --softmax-type learnable "
    "--window-attn-skip-freq 2 --window-size 128,0 --activation-func-clamp-value 7.0")
FIXED_LINE = (SLIME_LINE.replace("--padded-vocab-size", "--vocab-size")
              .replace("--position-embedding-type rope --use-rope-scaling --rope-scaling-factor 32",
                       "--position-embedding-type yarn --rotary-scaling-factor 32")
              .replace("--window-size 128,0", "--window-size 127,0"))


def arch_20b(**changes: object) -> ModelArchitecture:
    return dataclasses.replace(ModelArchitecture(**architecture_fields_from_hf(HF_20B)), **changes)


def test_config_json_check_names_each_gpt_oss_field() -> None:
    assert architecture_mismatches(arch_20b(), HF_20B) == []
    assert window_layers(arch_20b())[:4] == [True, False, True, False]
    cases = {
        "window_size": dict(window_size=[128, 0]),  # slime's 128,0: 129 keys
        "window_attn_skip_freq": dict(window_attn_skip_freq=3),
        "softmax_type": dict(softmax_type="vanilla"),
        "activation_func_clamp_value": dict(activation_func_clamp_value=10.0),
        "glu_linear_offset": dict(glu_linear_offset=0.5),
        "quick_geglu": dict(quick_geglu=False, glu_linear_offset=0.0),
        "yarn_correction_range_round_to_int": dict(yarn_correction_range_round_to_int=True),
        "YaRN factor": dict(rotary_scaling_factor=16.0),
        "YaRN original_max_position_embeddings": dict(original_max_position_embeddings=8192),
        "add_bias_linear": dict(add_bias_linear=False),
        "moe_router_score_function": dict(moe_router_pre_softmax=True),
    }
    for field, change in cases.items():
        problems = architecture_mismatches(arch_20b(**change), HF_20B)
        assert any(p.startswith(field) for p in problems), (field, problems)
    assert "config.json's sliding_window 128 is [127, 0]" in architecture_mismatches(arch_20b(window_size=[128, 0]),
                                                                                     HF_20B)[0]
    other = dict(HF_20B, model_type="qwen3_moe")
    assert any("model_type is 'qwen3_moe'" in p for p in architecture_mismatches(arch_20b(), other))


def test_architecture_rules_refuse_what_megatron_cannot_build() -> None:
    with pytest.raises(ValueError, match="glu_linear_offset without quick_geglu"):
        arch_20b(quick_geglu=False)
    with pytest.raises(ValueError, match="looks ahead"):
        arch_20b(window_size=[127, 4])
    with pytest.raises(ValueError, match="every gpt-oss layer is a MoE layer"):
        arch_20b(moe_layer_freq=[0] + [1] * 23)
    with pytest.raises(ValueError, match="softmax_type"):
        arch_20b(softmax_type="off_by_two")


def test_slime_gpt_oss_line_reads_with_megatron_meanings() -> None:
    from hpc_rl.config.megatron_model import architecture_from_argv

    with pytest.raises(ValueError) as refused:
        architecture_from_argv(shlex.split(SLIME_LINE))
    assert "--use-rope-scaling is refused" in str(refused.value) and "--rotary-scaling-factor 32" in str(refused.value)
    arch, _ = architecture_from_argv(shlex.split(FIXED_LINE))
    assert arch.family == "gpt_oss" and arch.window_size == [127, 0] and arch.window_attn_skip_freq == 2
    assert arch.softmax_type == "learnable" and arch.quick_geglu and arch.activation_func_clamp_value == 7.0
    assert arch.rotary_scaling_factor == 32.0 and not arch.yarn_correction_range_round_to_int
    assert architecture_mismatches(arch, HF_20B) == []
    with pytest.raises(ValueError, match="for gpt-oss only"):
        architecture_from_argv(shlex.split("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 "
                                           "--num-attention-heads 4 --vocab-size 32 --normalization RMSNorm "
                                           "--position-embedding-type rope --swiglu --softmax-type learnable"))


def test_mxfp4_block_dequantises_as_computed_by_hand() -> None:
    # One row of 32 values: bytes 0x21 (low nibble 1 = +0.5 first, high 2 = +1.0), 0xF8 (8 = -0.0, 15 = -6.0),
    # 0x7A (10 = -1.0, 7 = +6.0), then 0x00; the scale byte 128 is 2^(128 - 127) = 2.
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, :3] = torch.tensor([0x21, 0xF8, 0x7A], dtype=torch.uint8)
    values = dequantize_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8), torch.float32)
    assert values.shape == (1, 32)
    assert values[0, :6].tolist() == [1.0, 2.0, -0.0, -12.0, -2.0, 12.0] and values[0, 6:].abs().sum() == 0
    small = dequantize_mxfp4(blocks, torch.tensor([[125]], dtype=torch.uint8), torch.float32)  # 2^-2
    assert small[0, :6].tolist() == [0.125, 0.25, -0.0, -1.5, -0.25, 1.5]
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.to(torch.int32), torch.tensor([[128]], dtype=torch.uint8))
    assert is_mxfp4(HF_20B) and not is_mxfp4({"model_type": "gpt_oss"})
    with pytest.raises(ValueError, match="quant_method 'fp8'"):
        is_mxfp4({"quantization_config": {"quant_method": "fp8"}})


def _fused(experts: int = 3, hidden: int = 64, inner: int = 32) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"gate_up_proj": torch.randn(experts, hidden, 2 * inner, generator=generator),
            "gate_up_proj_bias": torch.randn(experts, 2 * inner, generator=generator),
            "down_proj": torch.randn(experts, inner, hidden, generator=generator),
            "down_proj_bias": torch.randn(experts, hidden, generator=generator)}


def test_fused_experts_split_by_interleave_and_fuse_back_bit_exact() -> None:
    prefix = "model.layers.0.mlp.experts"
    fused = _fused()
    per_expert = unfuse_experts(prefix, fused)
    x = torch.randn(5, 64)
    gate_up = x @ fused["gate_up_proj"][1] + fused["gate_up_proj_bias"][1]  # transformers: gate even, up odd
    gate = torch.nn.functional.linear(x, per_expert[f"{prefix}.1.gate_proj.weight"], per_expert[f"{prefix}.1.gate_proj.bias"])
    up = torch.nn.functional.linear(x, per_expert[f"{prefix}.1.up_proj.weight"], per_expert[f"{prefix}.1.up_proj.bias"])
    assert torch.allclose(gate, gate_up[:, 0::2], atol=1e-5) and torch.allclose(up, gate_up[:, 1::2], atol=1e-5)
    assert torch.equal(per_expert[f"{prefix}.2.down_proj.weight"], fused["down_proj"][2].t())
    back = fuse_experts(prefix, per_expert, 3)
    assert set(back) == {f"{prefix}.{name}" for name in fused}
    for name, tensor in fused.items():
        assert torch.equal(back[f"{prefix}.{name}"], tensor), name
    other = "model.layers.1.mlp.experts"
    state = {"model.norm.weight": torch.ones(2), **per_expert, **unfuse_experts(other, _fused(experts=2))}
    whole = fused_state(state)  # what the converter and --save-hf write
    assert set(whole) == {"model.norm.weight", *back, *(f"{other}.{name}" for name in fused)}
    assert torch.equal(whole[f"{prefix}.gate_up_proj"], fused["gate_up_proj"])
    assert whole[f"{other}.down_proj_bias"].shape == (2, 64)


def test_reader_serves_mxfp4_experts_under_per_expert_names() -> None:
    prefix = "model.layers.0.mlp.experts"
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 64, 2, 16), dtype=torch.uint8, generator=generator)  # E=2, 2I=64, H=64
    scales = torch.randint(120, 130, (2, 64, 2), dtype=torch.uint8, generator=generator)
    down_blocks = torch.randint(0, 256, (2, 64, 1, 16), dtype=torch.uint8, generator=generator)  # H=64, I=32
    down_scales = torch.randint(120, 130, (2, 64, 1), dtype=torch.uint8, generator=generator)
    state = {f"{prefix}.gate_up_proj_blocks": blocks, f"{prefix}.gate_up_proj_scales": scales,
             f"{prefix}.down_proj_blocks": down_blocks, f"{prefix}.down_proj_scales": down_scales,
             f"{prefix}.gate_up_proj_bias": torch.randn(2, 64), f"{prefix}.down_proj_bias": torch.randn(2, 64),
             "model.norm.weight": torch.ones(64)}
    reader = PerExpertReader(state)
    weight = dequantize_mxfp4(blocks, scales)  # [E, 2I, H]: rows are output features
    assert torch.equal(reader[f"{prefix}.1.gate_proj.weight"], weight[1, 0::2])
    assert torch.equal(reader[f"{prefix}.1.up_proj.weight"], weight[1, 1::2])
    assert torch.equal(reader[f"{prefix}.0.down_proj.weight"], dequantize_mxfp4(down_blocks, down_scales)[0])
    assert torch.equal(reader[f"{prefix}.1.up_proj.bias"], state[f"{prefix}.gate_up_proj_bias"][1, 1::2])
    assert f"{prefix}.1.down_proj.bias" in reader and "model.norm.weight" in reader
    assert f"{prefix}.2.down_proj.bias" not in reader and f"{prefix}.gate_up_proj_blocks" not in reader.keys()
    assert len(reader.keys()) == 1 + 2 * 6


def test_name_map_has_sinks_router_bias_and_expert_biases_and_round_trips() -> None:
    from hpc_rl.weights import hf_mapping

    arch = ModelArchitecture(**{**architecture_fields_from_hf({**HF_20B, "num_hidden_layers": 2,
                                                               "layer_types": ["sliding_attention", "full_attention"],
                                                               "num_local_experts": 2, "num_experts_per_tok": 2,
                                                               "hidden_size": 64,
                                                               "intermediate_size": 32, "num_attention_heads": 4,
                                                               "num_key_value_heads": 2, "head_dim": 16,
                                                               "vocab_size": 24})})
    rows = dict(hf_mapping.name_map(arch))
    assert rows["decoder.layers.1.self_attention.core_attention.softmax_offset"] == ["model.layers.1.self_attn.sinks"]
    assert rows["decoder.layers.0.mlp.router.bias"] == ["model.layers.0.mlp.router.bias"]
    assert rows["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.bias"] == [
        "model.layers.0.mlp.experts.1.gate_proj.bias", "model.layers.0.mlp.experts.1.up_proj.bias"]
    assert rows["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.bias"] == [
        "model.layers.0.mlp.experts.1.down_proj.bias"]
    for name, hf_names in rows.items():
        assert hf_mapping.hf_names_of(name, arch) == hf_names, name
    assert hf_mapping.tp_split("decoder.layers.0.self_attention.core_attention.softmax_offset").dim == 0
    generator = torch.Generator().manual_seed(2)
    shapes = {"linear_fc1.bias": (64,), "linear_fc2.bias": (64,), "softmax_offset": (4,)}
    for name, hf_names in rows.items():
        shape = next((s for key, s in shapes.items() if name.endswith(key)), None)
        if shape is None:
            continue
        full = torch.randn(shape, generator=generator)
        pairs = hf_mapping.to_hf(name, full, arch)
        assert [n for n, _ in pairs] == hf_names
        assert torch.equal(hf_mapping.to_megatron(name, [t for _, t in pairs], arch), full)


def test_cpu_engine_updates_fused_experts_by_per_expert_names() -> None:
    from transformers import GptOssConfig, GptOssForCausalLM

    from hpc_rl.engines.cpu.weight_sync import load_named, named_tensors

    config = GptOssConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=32, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=24, num_local_experts=3,
                          num_experts_per_tok=2, layer_types=["sliding_attention"], sliding_window=4)
    model = GptOssForCausalLM(config)  # H = 2I: a [E, 2I, H] reading of gate_up_proj would have the right shapes
    prefix = "model.layers.0.mlp.experts"
    new = unfuse_experts(prefix, _fused(experts=3, hidden=64, inner=32))
    assert set(new) <= set(named_tensors(model))
    load_named(model, list(new.items()))
    expected = fuse_experts(prefix, new, 3)
    experts = model.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert torch.equal(getattr(experts, name).detach(), expected[f"{prefix}.{name}"]), name


def test_submit_refuses_expert_tp_with_biases() -> None:
    from hpc_rl.config import load_config
    from hpc_rl.config.validation import collect_problems

    line = shlex.split(FIXED_LINE) + ["--hf-checkpoint", "/nonexistent/gpt-oss", "--tensor-model-parallel-size", "2",
                                      "--sequence-parallel"]
    found = {p.where: p.message for p in collect_problems(load_config([], line), check_files=False)}
    assert "Megatron builds MoE biases at expert TP 1 only" in found["training.expert_tensor_parallel_size"]
    fine = {p.where for p in collect_problems(load_config([], line + [
        "--expert-tensor-parallel-size", "1", "--update-weight-transport", "disk",
        "--update-weight-disk-dir", "/nonexistent/weights"]), check_files=False)}
    assert not fine & {"training.expert_tensor_parallel_size", "rollout.update_weight_transport"}
    # every transport syncs gpt-oss's experts fused since (tests/unit/test_gpt_oss_sync.py)


def test_mxfp4_experts_equal_transformers_dequantisation() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    prefix = "model.layers.0.mlp.experts"
    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 64, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(118, 134, (2, 64, 2), dtype=torch.uint8, generator=generator)
    down_blocks = torch.randint(0, 256, (2, 64, 1, 16), dtype=torch.uint8, generator=generator)
    down_scales = torch.randint(118, 134, (2, 64, 1), dtype=torch.uint8, generator=generator)
    reader = PerExpertReader({f"{prefix}.gate_up_proj_blocks": blocks, f"{prefix}.gate_up_proj_scales": scales,
                              f"{prefix}.down_proj_blocks": down_blocks, f"{prefix}.down_proj_scales": down_scales})
    theirs = unfuse_experts(prefix, {"gate_up_proj": convert_moe_packed_tensors(blocks, scales),
                                     "down_proj": convert_moe_packed_tensors(down_blocks, down_scales)})
    assert set(theirs) == set(reader.keys())
    for name, tensor in theirs.items():
        assert reader[name].dtype == torch.bfloat16 and torch.equal(reader[name], tensor), name
