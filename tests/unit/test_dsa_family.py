"""The deepseek_v32 family's pure pieces: config.json's indexer keys against the model file, the DSA field rules,
the indexer's head layout between HF and Megatron (a permutation: round-trips bit-exact), the CPU twin of the
Hadamard rotation, and slime's --freeze-indexer (flag, submit checks, which parameters it freezes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.config.loading import load_config
from hpc_rl.config.model import ModelArchitecture
from hpc_rl.config.sections.training import TrainingConfig
from hpc_rl.models.deepseek_v32.config_rules import check_config, training_problems
from hpc_rl.models.deepseek_v32.hf_names import megatron_order, to_hf, to_megatron
from tests.unit.test_model_families import TINY_ARCHITECTURES

DSA = TINY_ARCHITECTURES["deepseek_v32"]
HF = {"index_n_heads": 4, "index_head_dim": 16, "index_topk": 4, "rms_norm_eps": 1e-6}


def arch(**changes: object) -> ModelArchitecture:
    return ModelArchitecture(family="deepseek_v32", **{**DSA, **changes})


def test_config_json_indexer_keys_are_checked() -> None:
    assert check_config(arch(), HF) == []
    lines = check_config(arch(dsa_indexer_topk=8), {**HF, "rms_norm_eps": 1e-5})
    assert lines[0] == "dsa_indexer_topk: the model file has 8, config.json's index_topk is 4"
    assert lines[1].startswith("rms_norm_eps: config.json has 1e-05")
    glm5 = check_config(arch(), {**HF, "model_type": "glm_moe_dsa"})
    assert len(glm5) == 1 and "use family glm_moe_dsa" in glm5[0]
    assert check_config(arch(), {**HF, "model_type": "deepseek_v32"}) == []
    assert check_config(arch(dsa_indexer_n_heads=64, dsa_indexer_head_dim=128, dsa_indexer_topk=2048),
                        {"rms_norm_eps": 1e-6}) == []  # DeepseekV32Config's defaults


def test_dsa_fields_are_refused_where_they_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="set dsa_indexer_n_heads"):
        arch(dsa_indexer_n_heads=None, dsa_indexer_head_dim=None, dsa_indexer_topk=None)
    with pytest.raises(ValueError, match="needs dsa_indexer_topk too"):
        arch(dsa_indexer_topk=None)
    with pytest.raises(ValueError, match="must be a power of two"):
        arch(dsa_indexer_head_dim=24)
    with pytest.raises(ValueError, match="needs q_lora_rank"):
        arch(q_lora_rank=None)
    with pytest.raises(ValueError, match="no MTP|MTP layers with sparse attention"):
        arch(mtp_num_layers=1)
    with pytest.raises(ValueError, match="DeepSeek Sparse Attention is built for the families deepseek_v32"):
        ModelArchitecture(family="deepseek_v3", **{**DSA, "mtp_num_layers": 1})


def test_indexer_head_layout_round_trips_bit_exact() -> None:
    assert megatron_order(8, 4) == [4, 5, 6, 7, 0, 2, 1, 3]
    model = arch()
    generator = torch.Generator().manual_seed(0)
    prefix = "decoder.layers.1.self_attention.core_attention.indexer."
    shapes = {"linear_wq_b.weight": (4 * 16, 32), "linear_wk.weight": (16, 64), "k_norm.weight": (16,),
              "k_norm.bias": (16,)}
    for suffix, shape in shapes.items():
        hf = torch.randn(shape, generator=generator)
        ours = to_megatron(prefix + suffix, [hf], model)
        assert ours is not None and not torch.equal(ours, hf), suffix
        ((name, back),) = to_hf(prefix + suffix, ours, model)
        assert name == f"model.layers.1.self_attn.indexer.{suffix.replace('linear_', '')}"
        assert torch.equal(back, hf), suffix
    per_head = to_megatron(prefix + "linear_wq_b.weight", [torch.arange(64.0)[:, None]], model)[:, 0]
    assert per_head[16:32].tolist() == [16.0 + i for i in megatron_order(16, 8)]  # head 1 stays head 1
    assert to_megatron(prefix + "linear_weights_proj.weight", [torch.ones(4, 64)], model) is None


def test_q_dot_k_is_the_same_in_both_layouts() -> None:
    """The permutation applied to q and k (then Megatron's de-interleaved rotary) keeps every score."""
    order = torch.tensor(megatron_order(16, 8))
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(5, 16, dtype=torch.float64, generator=generator)
    k = torch.randn(7, 16, dtype=torch.float64, generator=generator)
    assert torch.allclose(q[:, order] @ k[:, order].T, q @ k.T)


def test_hadamard_twin_has_the_kernels_contract() -> None:
    from hpc_rl.models.deepseek_v32.layers_dsa import hadamard_rotation

    x = torch.tensor([[3.0, 1.0]])
    assert torch.allclose(hadamard_rotation(x), torch.tensor([[4.0, 2.0]]) / 2 ** 0.5)
    generator = torch.Generator().manual_seed(1)
    q, k = torch.randn(6, 16, generator=generator), torch.randn(9, 16, generator=generator)
    assert torch.allclose(hadamard_rotation(q) @ hadamard_rotation(k).T, q @ k.T, atol=1e-5)  # orthogonal (fp32)
    assert hadamard_rotation(torch.ones(2, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="power of two"):
        hadamard_rotation(torch.ones(2, 12))


def test_freeze_indexer_is_slimes_flag_and_checked_at_submit() -> None:
    assert load_config([], ["--freeze-indexer"]).training.freeze_indexer is True
    assert load_config([], []).training.freeze_indexer is False
    qwen3 = ModelArchitecture(family="qwen3", **TINY_ARCHITECTURES["qwen3"])
    (where, message), = training_problems(qwen3, TrainingConfig(freeze_indexer=True))
    assert where == "training.freeze_indexer" and "has none" in message
    assert training_problems(arch(), TrainingConfig(freeze_indexer=True)) == []
    assert [w for w, _ in training_problems(arch(), TrainingConfig(context_parallel_size=2))] == [
        "training.context_parallel_size"]


class FakeDsaLayer(torch.nn.Module):
    """A fake: parameters under Megatron's DSA names (linear_qkv stands in for MLA's projections)."""

    def __init__(self, indexer: bool) -> None:
        super().__init__()
        self.self_attention = torch.nn.Module()
        self.self_attention.linear_proj = torch.nn.Linear(4, 4)
        self.self_attention.core_attention = torch.nn.Module()
        if indexer:
            self.self_attention.core_attention.indexer = torch.nn.Module()
            self.self_attention.core_attention.indexer.linear_wk = torch.nn.Linear(4, 2, bias=False)
            self.self_attention.core_attention.indexer.k_norm = torch.nn.LayerNorm(2)


def test_freeze_indexer_freezes_exactly_the_indexer() -> None:
    from hpc_rl.training.actor import freeze_parameters

    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([FakeDsaLayer(True), FakeDsaLayer(True)])})
    freeze_parameters(model, TrainingConfig(freeze_indexer=True))
    frozen = sorted(name for name, p in model.named_parameters() if not p.requires_grad)
    assert frozen == [f"layers.{i}.self_attention.core_attention.indexer.{s}" for i in (0, 1)
                      for s in ("k_norm.bias", "k_norm.weight", "linear_wk.weight")]
    assert all(p.requires_grad for n, p in model.named_parameters() if "indexer" not in n)
    with pytest.raises(ValueError, match="no DeepSeek Sparse Attention indexer"):
        freeze_parameters(FakeDsaLayer(False), TrainingConfig(freeze_indexer=True))
    untouched = FakeDsaLayer(True)
    freeze_parameters(untouched, TrainingConfig())
    assert all(p.requires_grad for p in untouched.parameters())


DSA_FLAGS = ("--disable-bias-linear --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
             "--kv-channels 16 --normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu "
             "--untie-embeddings-and-output-weights --vocab-size 24 --multi-latent-attention --q-lora-rank 32 "
             "--kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --qk-layernorm "
             "--rotary-base 10000 --rope-type rope --max-position-embeddings 512 --num-experts 4 "
             "--moe-layer-freq [0,1] --moe-ffn-hidden-size 32 --moe-router-topk 2 "
             "--moe-shared-expert-intermediate-size 32 --moe-router-pre-softmax "
             "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-group-topk 1 "
             "--moe-router-num-groups 2 --moe-router-topk-scaling-factor 2.5 --experimental-attention-variant dsa "
             "--dsa-indexer-n-heads 4 --dsa-indexer-head-dim 16 --dsa-indexer-topk 4").split()
"""The tiny DeepSeek-V3.2's MODEL_ARGS as Megatron-LM's DSA flags write them."""


def test_megatrons_dsa_flags_give_the_tiny_model_file() -> None:
    from hpc_rl.config.megatron_model import architecture_from_argv

    built, problems = architecture_from_argv(DSA_FLAGS)
    assert problems == []
    tiny = Path(__file__).resolve().parents[2] / "configs" / "models" / "tiny_deepseek_v32.yaml"
    assert built == ModelArchitecture.from_yaml(tiny)
    flags = [f for f in DSA_FLAGS if f != "--experimental-attention-variant" and f != "dsa"]
    with pytest.raises(ValueError, match="without --experimental-attention-variant dsa"):
        architecture_from_argv(flags)
    with pytest.raises(ValueError, match="indexer's KL loss off"):
        architecture_from_argv([*DSA_FLAGS, "--dsa-indexer-loss-coeff", "0.01"])


def test_glm5_config_json_is_checked_and_index_share_refused() -> None:
    """GLM-5 (glm_moe_dsa): the indexer keys as DeepSeek-V3.2's, rms_norm_eps free (its indexer and latent norms
    are built at 1e-6), and IndexShare layers ('shared' indexer_types, however config.json spells them) refused."""
    from hpc_rl.models.glm_moe_dsa.config_rules import check_config as glm5_check, indexer_types

    glm5 = ModelArchitecture(family="glm_moe_dsa", **{**TINY_ARCHITECTURES["glm_moe_dsa"]})
    hf = {**HF, "model_type": "glm_moe_dsa", "rms_norm_eps": 1e-5, "num_hidden_layers": 2}
    assert glm5_check(glm5, hf) == []
    assert indexer_types({"num_hidden_layers": 6, "index_topk_freq": 2}) == ["full", "full", "shared", "full",
                                                                            "shared", "full"]
    for shared in ({"indexer_types": ["full", "shared"]}, {"index_topk_pattern": "FS"}, {"index_topk_freq": 2,
                                                                                         "index_skip_topk_offset": 1}):
        lines = glm5_check(glm5, {**hf, **shared})
        assert len(lines) == 1 and "layers [1] are 'shared' (IndexShare" in lines[0], (shared, lines)
    assert "is not glm_moe_dsa" in glm5_check(glm5, {**hf, "model_type": "deepseek_v32"})[0]


def test_glm5_indexer_head_layout_round_trips_bit_exact() -> None:
    """GLM-5's indexer rotates interleaved pairs of its first dims; Megatron's the pairs of its last: a rotation of
    the head's dims, per head for wq_b."""
    from hpc_rl.models.glm_moe_dsa import hf_names

    assert hf_names.megatron_order(8, 4) == [4, 5, 6, 7, 0, 1, 2, 3]
    glm5 = ModelArchitecture(family="glm_moe_dsa", **{**TINY_ARCHITECTURES["glm_moe_dsa"]})
    name = "decoder.layers.1.self_attention.core_attention.indexer.linear_wq_b.weight"
    hf = torch.randn(4 * 16, 32, generator=torch.Generator().manual_seed(1))
    ours = hf_names.to_megatron(name, [hf], glm5)
    assert torch.equal(ours[16 - 8:16], hf[:8]) and torch.equal(ours[:8], hf[8:16])  # head 0: rotary dims last
    [(hf_name, back)] = hf_names.to_hf(name, ours, glm5)
    assert hf_name == "model.layers.1.self_attn.indexer.wq_b.weight" and torch.equal(back, hf)
