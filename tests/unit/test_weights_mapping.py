"""hpc_rl.weights.hf_mapping (pure) and bucket planning: no Megatron, no processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.weights import hf_mapping
from tests.unit import weight_states

ROOT = Path(__file__).resolve().parents[2]


def arch(**overrides) -> ModelArchitecture:
    fields = {"family": "qwen3", "num_layers": 2, "hidden_size": 8, "ffn_hidden_size": 12, "num_attention_heads": 4,
                  "num_query_groups": 2, "kv_channels": 2, "vocab_size": 10, "tie_word_embeddings": True, "qk_layernorm": True}
    fields.update(overrides)
    return ModelArchitecture(**fields)


def glm4() -> ModelArchitecture:
    return arch(family="glm4", tie_word_embeddings=False, qk_layernorm=False, add_qkv_bias=True,
                post_sublayer_norms=True, rotary_percent=0.5, rotary_interleaved=True)


def random_hf_state(a: ModelArchitecture) -> dict[str, torch.Tensor]:
    """An HF state dict with the right shapes (derived from the mapping's own name list)."""
    generator = torch.Generator().manual_seed(0)
    q_rows, kv_rows = a.num_attention_heads * a.kv_channels, a.num_query_groups * a.kv_channels
    shapes = {"q_proj.weight": (q_rows, a.hidden_size), "k_proj.weight": (kv_rows, a.hidden_size),
              "v_proj.weight": (kv_rows, a.hidden_size), "q_proj.bias": (q_rows,), "k_proj.bias": (kv_rows,),
              "v_proj.bias": (kv_rows,), "o_proj.weight": (a.hidden_size, q_rows),
              "q_norm.weight": (a.kv_channels,), "k_norm.weight": (a.kv_channels,),
              "gate_proj.weight": (a.ffn_hidden_size, a.hidden_size), "up_proj.weight": (a.ffn_hidden_size, a.hidden_size),
              "gate_up_proj.weight": (2 * a.ffn_hidden_size, a.hidden_size),
              "down_proj.weight": (a.hidden_size, a.ffn_hidden_size), "embed_tokens.weight": (a.vocab_size, a.hidden_size),
              "lm_head.weight": (a.vocab_size, a.hidden_size)}
    state = {}
    for _, hf_names in hf_mapping.name_map(a):
        for name in hf_names:
            key = ".".join(name.split(".")[-2:])
            shape = shapes.get(key, (a.hidden_size,))
            state[name] = torch.randn(shape, generator=generator)
    return state


def test_qkv_is_grouped_per_kv_head() -> None:
    a = arch(hidden_size=1, kv_channels=1)
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # q heads 0..3
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    fused = hf_mapping.to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", [q, k, v], a)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # [q0 q1 k0 v0 | q2 q3 k1 v1]
    back = hf_mapping.to_hf("decoder.layers.0.self_attention.linear_qkv.weight", fused, a)
    assert [t.flatten().tolist() for _, t in back] == [q.flatten().tolist(), k.flatten().tolist(), v.flatten().tolist()]


def test_fc1_tp_shards_are_gate_r_then_up_r() -> None:
    gate, up = torch.arange(4.0)[:, None], torch.arange(10.0, 14.0)[:, None]
    full = torch.cat([gate, up])
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    shards = [hf_mapping.shard(name, full, r, 2) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 10, 11]
    assert shards[1].flatten().tolist() == [2, 3, 12, 13]
    assert torch.equal(hf_mapping.unshard(name, shards), full)


@pytest.mark.parametrize("name,dim", [
    ("decoder.layers.1.self_attention.linear_qkv.weight", 0),
    ("decoder.layers.1.self_attention.linear_proj.weight", 1),
    ("decoder.layers.1.mlp.linear_fc2.weight", 1),
    ("embedding.word_embeddings.weight", 0),
    ("decoder.layers.1.self_attention.q_layernorm.weight", None),
    ("module.decoder.layers.1.input_layernorm.weight", None),
])
def test_shard_unshard_round_trip(name: str, dim: int | None) -> None:
    full = torch.randn(8, 6)
    assert hf_mapping.tp_split(name).dim == dim
    shards = [hf_mapping.shard(name, full, r, 2) for r in range(2)]
    if dim is None:
        assert all(s is full for s in shards)
    assert torch.equal(hf_mapping.unshard(name, shards), full)


def test_canonical_names() -> None:
    assert (hf_mapping.canonical_name("module.module.decoder.layers.3.input_layernorm.weight")
            == "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight")
    assert (hf_mapping.canonical_name("decoder.layers.0.pre_mlp_layernorm.weight")
            == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight")
    assert weight_states.local_spec_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"


@pytest.mark.parametrize("make", [arch, glm4, lambda: arch(family="llama", qk_layernorm=False,
                                                            tie_word_embeddings=False)])
def test_state_round_trip_is_exact_with_vocab_padding(make) -> None:
    a = make()
    hf = random_hf_state(a)
    megatron = weight_states.hf_to_megatron_state(hf, a, padded_vocab=16)
    embedding = megatron["embedding.word_embeddings.weight"]
    assert embedding.shape[0] == 16 and torch.count_nonzero(embedding[a.vocab_size:]) == 0
    assert ("output_layer.weight" in megatron) == (not a.tie_word_embeddings)
    back = weight_states.megatron_to_hf_state(megatron, a)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_glm4_names() -> None:
    names = dict(hf_mapping.name_map(glm4()))
    assert names["decoder.layers.0.mlp.linear_fc1.weight"] == ["model.layers.0.mlp.gate_up_proj.weight"]
    assert names["decoder.layers.1.self_attention.post_self_attn_layernorm.weight"] == [
        "model.layers.1.post_self_attn_layernorm.weight"]
    assert names["decoder.layers.1.mlp.post_mlp_layernorm.weight"] == ["model.layers.1.post_mlp_layernorm.weight"]
    assert len(names["decoder.layers.0.self_attention.linear_qkv.bias"]) == 3
    assert names["output_layer.weight"] == ["lm_head.weight"]


def test_missing_hf_tensor_is_named() -> None:
    a = arch()
    hf = random_hf_state(a)
    del hf["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match="k_norm"):
        weight_states.hf_to_megatron_state(hf, a)


def test_hf_param_shapes_without_data() -> None:
    a = arch()
    shapes = hf_mapping.hf_param_shapes(a, "decoder.layers.0.self_attention.linear_qkv.weight", (16, 8))
    assert shapes == [("model.layers.0.self_attn.q_proj.weight", (8, 8)),
                      ("model.layers.0.self_attn.k_proj.weight", (4, 8)),
                      ("model.layers.0.self_attn.v_proj.weight", (4, 8))]
    assert hf_mapping.hf_param_shapes(a, "embedding.word_embeddings.weight", (16, 8)) == [
        ("model.embed_tokens.weight", (10, 8))]


def test_bucket_plan_keeps_parameters_whole_and_respects_the_size() -> None:
    from hpc_rl.weights.sender import _plan

    entries = [("a", [("a.q", (4, 4)), ("a.k", (2, 4))]), ("b", [("b", (8, 8))]), ("c", [("c", (2,))])]
    plan = _plan(entries, torch.float32, bucket_bytes=200)
    assert [b.megatron_names for b in plan] == [["a"], ["b"], ["c"]]
    assert plan[0].names == ["a.q", "a.k"] and plan[0].num_bytes == 96 and plan[0].dtypes == ["float32"] * 2
    one = _plan(entries, torch.bfloat16, bucket_bytes=10**6)
    assert len(one) == 1 and one[0].num_bytes == 2 * (16 + 8 + 64 + 2)
    assert one[0].to_dict()["shapes"] == [[4, 4], [2, 4], [8, 8], [2]]


def test_architecture_check_names_the_mismatch(tmp_path: Path) -> None:
    from hpc_rl.weights.hf_import import check_architecture

    config = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
              "vocab_size": 24, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_file = ROOT / "configs/models/tiny_qwen3.yaml"
    with pytest.raises(ValueError, match="rotary_base"):
        check_architecture(ModelArchitecture.from_yaml(model_file), tmp_path, model_file)
    config["rope_theta"] = 1e6
    (tmp_path / "config.json").write_text(json.dumps(config))
    check_architecture(ModelArchitecture.from_yaml(model_file), tmp_path, model_file)
