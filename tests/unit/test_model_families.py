"""The model-family registry (`hpc_rl.models`): every family folder is found, and each family's hooks work on
the tiny checkpoint its own `make_tiny` writes (config.json check, HF name rows, layer spec, CPU engine loader)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
from safetensors import safe_open

from hpc_rl.config.model import ModelArchitecture, architecture_mismatches
from hpc_rl.models import (
    ModelFamily, all_families, family, family_for_hf_model_type, family_for_slime_spec, family_names, register,
)
from hpc_rl.models.deepseek_v3.hf_names import is_mtp_copy
from hpc_rl.weights.hf_mapping import name_map

MODELS = Path(__file__).resolve().parents[2] / "hpc_rl" / "models"
SHAPE = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             kv_channels=16, vocab_size=24, rotary_base=1e6, norm_epsilon=1e-6, max_position_embeddings=512)
MOE = dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, tie_word_embeddings=False)
MLA = dict(SHAPE, **MOE, rotary_base=10000.0, num_query_groups=4, qk_layernorm=True, moe_layer_freq=[0, 1],
           moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid", moe_router_pre_softmax=True,
           moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_num_groups=2,
           moe_router_group_topk=1, multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=16, mtp_num_layers=1)
TINY_ARCHITECTURES = {
    "qwen3": dict(SHAPE, tie_word_embeddings=True, qk_layernorm=True),
    "llama": dict(SHAPE, tie_word_embeddings=True),
    "glm4": dict(SHAPE, tie_word_embeddings=True, rotary_percent=0.5, rotary_interleaved=True, add_qkv_bias=True,
                 post_sublayer_norms=True),
    "qwen3_moe": dict(SHAPE, **MOE, qk_layernorm=True),
    "glm4_moe": dict(SHAPE, **MOE, rotary_percent=0.5, add_qkv_bias=True, moe_shared_expert_intermediate_size=32,
                     moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "deepseek_v3": MLA,
    "glm4_moe_lite": MLA,
    "deepseek_v32": dict(MLA, mtp_num_layers=None, dsa_indexer_n_heads=4, dsa_indexer_head_dim=16, dsa_indexer_topk=4),
    "glm_moe_dsa": dict(MLA, mtp_num_layers=None, dsa_indexer_n_heads=4, dsa_indexer_head_dim=16, dsa_indexer_topk=4,
                        norm_epsilon=1e-5),
}
"""Each family's model file for the checkpoint its `make_tiny` writes with the default spec."""


def test_every_family_folder_is_registered() -> None:
    folders = {path.parent.name for path in MODELS.glob("*/__init__.py")}
    assert set(TINY_ARCHITECTURES) <= set(family_names())
    assert {"qwen3", "llama", "glm4", "qwen3_moe", "glm4_moe", "deepseek_v3"} <= folders
    for folder in folders:  # each folder's FAMILY / FAMILIES is in the registry
        module = importlib.import_module(f"hpc_rl.models.{folder}")
        declared = [getattr(module, "FAMILY", None), *getattr(module, "FAMILIES", ())]
        assert [f for f in declared if f is not None], f"hpc_rl/models/{folder}/__init__.py declares no FAMILY"
        assert all(family(f.name) is f for f in declared if f is not None)


def test_lookups_by_name_and_hf_model_type() -> None:
    assert family("glm4_moe_lite").mla and family("glm4_moe_lite").moe and not family("glm4").moe
    assert family_for_hf_model_type("qwen3_moe") is family("qwen3_moe")
    assert family_for_hf_model_type("mistral") is None and family_for_hf_model_type(None) is None
    assert family_for_slime_spec(["slime_plugins.models.glm4", "get_glm_spec"]) is family("glm4")
    assert family_for_slime_spec(None) is None and family_for_slime_spec(("my.spec", "get")) is None
    with pytest.raises(KeyError, match="not one of deepseek_v3"):
        family("gpt2")
    with pytest.raises(ValueError, match="model_type 'qwen3' is family 'qwen3'"):
        register(ModelFamily(name="qwen3_copy", hf_model_types=("qwen3",), hf_architectures=("Qwen3ForCausalLM",)))
    with pytest.raises(ValueError, match="registered twice"):
        register(ModelFamily(name="qwen3", hf_model_types=("qwen3_other",), hf_architectures=()))


@pytest.mark.parametrize("name", sorted(TINY_ARCHITECTURES))
def test_hooks_work_on_the_familys_tiny_checkpoint(name: str, tmp_path: Path) -> None:
    this = family(name)
    assert this.make_tiny is not None, f"{name}: no tiny checkpoint maker"
    checkpoint = Path(this.make_tiny(tmp_path / name))
    hf = json.loads((checkpoint / "config.json").read_text())
    assert family_for_hf_model_type(hf["model_type"]) is this
    assert set(hf["architectures"]) <= set(this.hf_architectures)
    arch = ModelArchitecture(family=name, **TINY_ARCHITECTURES[name])
    assert architecture_mismatches(arch, hf) == []
    assert this.check_config(arch, hf) == []
    assert this.architecture_problem(arch) is None
    wrong = ModelArchitecture(family=name, **{**TINY_ARCHITECTURES[name], "num_layers": 3,
                                              **({"moe_layer_freq": [0, 1, 1]} if this.mla else {})})
    assert any(line.startswith("num_layers:") for line in architecture_mismatches(wrong, hf))

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as weights:
        on_disk = {key for key in weights.keys() if not is_mtp_copy(key, arch)}
    mapped = [hf_name for _, hf_names in name_map(arch) for hf_name in hf_names]
    assert len(mapped) == len(set(mapped))
    assert set(mapped) == on_disk

    spec = this.layer_spec(arch, arch.num_layers - 1, use_te=False, moe=arch.moe_layers()[-1], moe_grouped_gemm=False)
    assert type(spec).__name__ == "ModuleSpec"
    if this.cpu_engine_loader is not None:
        import torch

        assert this.cpu_engine_support is not None and this.cpu_engine_support(hf) is None
        model = this.cpu_engine_loader(str(checkpoint), torch.float32)
        assert set(model.state_dict()) >= {n for n in on_disk if n != "lm_head.weight"}
