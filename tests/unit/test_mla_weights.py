"""MLA and MTP weight names and layouts (issue 20): HF <-> Megatron rows of multi-latent attention (with and without
a q latent), Transformer Engine's fused latent norms, TP splits, the MTP layer at HF layer num_layers + k (the names
SGLang's NextN draft loads), DeepSeek's per-MTP-layer copies, the weight-sync plan, and the CPU engine holding the
MTP layer where SGLang's draft does (updates by name, shapes checked, the copies skipped as SGLang skips them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.weights import hf_mapping
from hpc_rl.models.deepseek_v3.hf_names import is_mtp_copy, mtp_copies
from hpc_rl.weights.sender import _plan
from tests.unit import weight_states

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets" / "tiny_deepseek_v3"


def tiny() -> ModelArchitecture:
    return ModelArchitecture.from_yaml(ROOT / "configs/models/tiny_deepseek_v3.yaml")


def test_mla_attention_rows_follow_the_checkpoint_names() -> None:
    names = dict(hf_mapping.name_map(tiny()))
    layer = "decoder.layers.1.self_attention."
    assert names[layer + "linear_q_down_proj.weight"] == ["model.layers.1.self_attn.q_a_proj.weight"]
    assert names[layer + "q_layernorm.weight"] == ["model.layers.1.self_attn.q_a_layernorm.weight"]
    assert names[layer + "linear_q_up_proj.weight"] == ["model.layers.1.self_attn.q_b_proj.weight"]
    assert names[layer + "linear_kv_down_proj.weight"] == ["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    assert names[layer + "kv_layernorm.weight"] == ["model.layers.1.self_attn.kv_a_layernorm.weight"]
    assert names[layer + "linear_kv_up_proj.weight"] == ["model.layers.1.self_attn.kv_b_proj.weight"]
    assert names[layer + "linear_proj.weight"] == ["model.layers.1.self_attn.o_proj.weight"]
    assert names[layer + "linear_qkv.layer_norm_weight"] == ["model.layers.1.input_layernorm.weight"]
    no_q_latent = dict(hf_mapping.name_map(ModelArchitecture(**{**tiny().to_dict(), "q_lora_rank": None})))
    assert no_q_latent[layer + "linear_q_proj.weight"] == ["model.layers.1.self_attn.q_proj.weight"]  # Moonlight
    assert layer + "q_layernorm.weight" not in no_q_latent


def test_the_mtp_layer_is_hf_layer_num_layers_with_the_names_sglangs_nextn_draft_loads() -> None:
    arch = tiny()
    rows = dict(hf_mapping.name_map(arch))
    assert rows["mtp.layers.0.enorm.weight"] == ["model.layers.2.enorm.weight"]
    assert rows["mtp.layers.0.hnorm.weight"] == ["model.layers.2.hnorm.weight"]
    assert rows["mtp.layers.0.eh_proj.weight"] == ["model.layers.2.eh_proj.weight"]
    assert rows["mtp.layers.0.final_layernorm.weight"] == ["model.layers.2.shared_head.norm.weight"]
    assert rows["mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight"] == [
        "model.layers.2.self_attn.kv_b_proj.weight"]
    assert rows["mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight"] == [
        "model.layers.2.mlp.experts.3.gate_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight"]
    assert rows["mtp.layers.0.transformer_layer.pre_mlp_layernorm.weight"] == [
        "model.layers.2.post_attention_layernorm.weight"]  # a MoE layer's own pre-MLP norm
    for megatron_name, hf_names in rows.items():
        assert hf_mapping.hf_names_of(megatron_name, arch) == hf_names, megatron_name
    from safetensors import safe_open

    with safe_open(str(TINY / "model.safetensors"), framework="pt") as handle:
        on_disk = set(handle.keys())
    mapped = {name for names in rows.values() for name in names}
    assert mapped == {name for name in on_disk if not is_mtp_copy(name, arch)}  # every tensor but the copies
    assert {copy for copy, _ in mtp_copies(arch)} == {"model.layers.2.embed_tokens.weight",
                                                      "model.layers.2.shared_head.head.weight"}


@pytest.mark.parametrize(("name", "canonical"), [
    ("module.decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
     "decoder.layers.0.self_attention.q_layernorm.weight"),  # Transformer Engine fuses the latent norms
    ("decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight",
     "decoder.layers.0.self_attention.kv_layernorm.weight"),
    ("decoder.layers.0.input_layernorm.weight", "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"),
    ("mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.layer_norm_weight",
     "mtp.layers.0.transformer_layer.self_attention.q_layernorm.weight"),
])
def test_te_and_local_spec_names_share_canonical_names(name: str, canonical: str) -> None:
    assert hf_mapping.canonical_name(name) == canonical


@pytest.mark.parametrize(("suffix", "dim"), [
    ("self_attention.linear_q_down_proj.weight", None), ("self_attention.linear_kv_down_proj.weight", None),
    ("self_attention.q_layernorm.weight", None), ("self_attention.linear_q_up_proj.weight", 0),
    ("self_attention.linear_q_proj.weight", 0), ("self_attention.linear_kv_up_proj.weight", 0),
    ("self_attention.linear_proj.weight", 1),
])
def test_mla_tp_splits(suffix: str, dim: int | None) -> None:
    assert hf_mapping.tp_split(f"decoder.layers.0.{suffix}").dim == dim
    assert hf_mapping.tp_split(f"mtp.layers.0.transformer_layer.{suffix}").dim == dim
    assert hf_mapping.tp_split("mtp.layers.0.eh_proj.weight").dim == 0


def test_hf_megatron_round_trip_of_every_tensor() -> None:
    from safetensors.torch import load_file

    arch = tiny()
    hf = {n: t for n, t in load_file(str(TINY / "model.safetensors")).items() if not is_mtp_copy(n, arch)}
    megatron = weight_states.hf_to_megatron_state(hf, arch, padded_vocab=128)
    assert megatron["embedding.word_embeddings.weight"].shape == (128, 64)
    back = weight_states.megatron_to_hf_state(megatron, arch)
    assert set(back) == set(hf)
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name
    for megatron_name in ("decoder.layers.1.self_attention.linear_kv_up_proj.weight", "mtp.layers.0.eh_proj.weight"):
        full = megatron[megatron_name]
        shards = [hf_mapping.shard(megatron_name, full, rank, 2) for rank in range(2)]
        assert torch.equal(hf_mapping.unshard(megatron_name, shards), full)


def test_the_weight_sync_plan_carries_the_mtp_layer_but_not_the_copies() -> None:
    from safetensors.torch import load_file

    arch = tiny()
    hf = load_file(str(TINY / "model.safetensors"))
    megatron = weight_states.hf_to_megatron_state({n: t for n, t in hf.items() if not is_mtp_copy(n, arch)}, arch)
    entries = [(name, hf_mapping.hf_param_shapes(arch, name, megatron[name].shape)) for name, _ in hf_mapping.name_map(arch)]
    planned = {name for bucket in _plan(entries, torch.float32, 20_000) for name in bucket.names}
    assert "model.layers.2.eh_proj.weight" in planned and "model.layers.2.mlp.experts.0.gate_proj.weight" in planned
    assert planned == set(hf) - {"model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}


@pytest.fixture(scope="module")
def engine_model():
    from hpc_rl.engines.cpu.__main__ import load_model

    return load_model(str(TINY), "auto", "eager")


def test_cpu_engine_holds_the_mtp_layer_where_sglangs_draft_does(engine_model) -> None:
    from safetensors.torch import load_file

    from hpc_rl.engines.cpu.nextn_draft import draft_tensors
    from hpc_rl.engines.cpu.weight_sync import load_from_disk, load_named, named_tensors

    assert type(engine_model).__name__ == "DeepseekV3ForCausalLM"
    draft = draft_tensors(engine_model)
    hf = load_file(str(TINY / "model.safetensors"))
    assert set(draft) == {n for n in hf if n.startswith("model.layers.2.")} - {
        "model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}
    new = torch.full_like(hf["model.layers.2.eh_proj.weight"], 0.5)
    load_named(engine_model, [("model.layers.2.eh_proj.weight", new),
                              ("model.layers.2.embed_tokens.weight", torch.zeros(3))])  # a copy: skipped, as SGLang
    assert torch.equal(named_tensors(engine_model)["model.layers.2.eh_proj.weight"], new)
    with pytest.raises(ValueError, match="does not match"):
        load_named(engine_model, [("model.layers.2.hnorm.weight", torch.zeros(3))])
    with pytest.raises(KeyError, match="unknown parameter names"):
        load_named(engine_model, [("model.layers.2.self_attn.q_proj.weight", torch.zeros(3))])
    load_from_disk(engine_model, str(TINY))  # a whole checkpoint, MTP layer and copies included
    assert torch.equal(draft_tensors(engine_model)["model.layers.2.eh_proj.weight"], hf["model.layers.2.eh_proj.weight"])
