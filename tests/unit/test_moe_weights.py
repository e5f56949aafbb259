"""MoE weight names and layouts (pure): HF <-> Megatron rows of routers, expert biases, routed and shared
experts, global expert indices under EP, bucket dtypes, and the CPU engine's per-expert views into
transformers' fused experts. No Megatron ranks, no processes."""

from __future__ import annotations

import pytest
import torch

from hpc_rl.config.model import ModelArchitecture
from hpc_rl.weights import hf_mapping
from hpc_rl.weights.stage import global_named_params
from tests.unit import weight_states


def moe_arch(**overrides) -> ModelArchitecture:
    fields = {"family": "qwen3_moe", "num_layers": 2, "hidden_size": 8, "ffn_hidden_size": 12, "num_attention_heads": 4,
              "num_query_groups": 2, "kv_channels": 2, "vocab_size": 10, "qk_layernorm": True, "num_moe_experts": 4,
              "moe_ffn_hidden_size": 6, "moe_router_topk": 2, "moe_layer_freq": [0, 1]}
    fields.update(overrides)
    return ModelArchitecture(**fields)


def glm_moe() -> ModelArchitecture:
    return moe_arch(family="glm4_moe", qk_layernorm=False, add_qkv_bias=True, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                    moe_shared_expert_intermediate_size=6)


def random_hf_state(a: ModelArchitecture) -> dict[str, torch.Tensor]:
    """HF tensors of the right shapes for every name the mapping lists."""
    generator = torch.Generator().manual_seed(0)
    h, q, kv, moe = a.hidden_size, a.num_attention_heads * a.kv_channels, a.num_query_groups * a.kv_channels, 6
    shapes = {"q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "q_proj.bias": (q,),
              "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.weight": (h, q), "q_norm.weight": (a.kv_channels,),
              "k_norm.weight": (a.kv_channels,), "embed_tokens.weight": (a.vocab_size, h),
              "lm_head.weight": (a.vocab_size, h), "gate.weight": (a.num_moe_experts, h),
              "gate.e_score_correction_bias": (a.num_moe_experts,)}
    state = {}
    for _, hf_names in hf_mapping.name_map(a):
        for name in hf_names:
            key = ".".join(name.split(".")[-2:])
            inner = moe if (".experts." in name or ".shared_experts." in name) else a.ffn_hidden_size
            shape = shapes.get(key) or {"gate_proj.weight": (inner, h), "up_proj.weight": (inner, h),
                                        "down_proj.weight": (h, inner)}.get(key, (h,))
            state[name] = torch.randn(shape, generator=generator)
    return state


def test_moe_layer_rows_follow_the_checkpoint_names() -> None:
    names = dict(hf_mapping.name_map(glm_moe()))
    layer = "decoder.layers.1."
    assert names[layer + "pre_mlp_layernorm.weight"] == ["model.layers.1.post_attention_layernorm.weight"]
    assert names[layer + "mlp.router.weight"] == ["model.layers.1.mlp.gate.weight"]
    assert names[layer + "mlp.router.expert_bias"] == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert names[layer + "mlp.experts.local_experts.3.linear_fc1.weight"] == [
        "model.layers.1.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.experts.3.up_proj.weight"]
    assert names[layer + "mlp.experts.local_experts.3.linear_fc2.weight"] == [
        "model.layers.1.mlp.experts.3.down_proj.weight"]
    assert names[layer + "mlp.shared_experts.linear_fc1.weight"] == [
        "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"]
    # layer 0 is dense (moe_layer_freq [0, 1]): GLM-4.5's dense MLP is unfused, unlike GLM4's gate_up_proj
    assert names["decoder.layers.0.mlp.linear_fc1.weight"] == ["model.layers.0.mlp.gate_proj.weight",
                                                               "model.layers.0.mlp.up_proj.weight"]
    assert "decoder.layers.0.mlp.router.weight" not in names
    # Qwen3-MoE: no expert bias, no shared expert
    qwen = dict(hf_mapping.name_map(moe_arch()))
    assert not any("expert_bias" in n or "shared_experts" in n for n in qwen)
    for megatron_name, hf_names in hf_mapping.name_map(glm_moe()):
        assert hf_mapping.hf_names_of(megatron_name, glm_moe()) == hf_names, megatron_name


@pytest.mark.parametrize("make", [moe_arch, glm_moe])
def test_moe_state_round_trip_is_exact(make) -> None:
    a = make()
    hf = random_hf_state(a)
    megatron = weight_states.hf_to_megatron_state(hf, a, padded_vocab=16)
    fc1 = megatron["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([hf["model.layers.1.mlp.experts.2.gate_proj.weight"],
                                       hf["model.layers.1.mlp.experts.2.up_proj.weight"]]))
    back = weight_states.megatron_to_hf_state(megatron, a)
    assert set(back) == set(hf)
    assert all(torch.equal(back[name], tensor) for name, tensor in hf.items())
    # local-spec names: a MoE layer's pre-MLP norm keeps its own name, a dense layer's is the fused fc1 norm
    local = {weight_states.local_spec_name(name): t for name, t in megatron.items()}
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in local and "decoder.layers.0.pre_mlp_layernorm.weight" in local
    assert set(weight_states.megatron_to_hf_state(local, a)) == set(hf)


def test_expert_helpers_and_tp_layout() -> None:
    name = "decoder.layers.5.mlp.experts.local_experts.6.linear_fc1.weight"
    assert hf_mapping.is_expert_param(name) and not hf_mapping.is_expert_param("decoder.layers.5.mlp.router.weight")
    assert not hf_mapping.is_expert_param("decoder.layers.5.mlp.shared_experts.linear_fc1.weight")
    assert hf_mapping.expert_index(name) == 6
    assert hf_mapping.with_expert_index(name, 1) == "decoder.layers.5.mlp.experts.local_experts.1.linear_fc1.weight"
    assert [hf_mapping.expert_owner(g, 8, 4) for g in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert hf_mapping.tp_split(name).gated and hf_mapping.tp_split(name.replace("fc1", "fc2")).dim == 1
    for replicated in ("decoder.layers.5.mlp.router.weight", "decoder.layers.5.mlp.router.expert_bias",
                       "decoder.layers.5.pre_mlp_layernorm.weight"):
        assert hf_mapping.tp_split(replicated).dim is None
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert hf_mapping.tensor_send_dtype(bias, torch.bfloat16) == torch.float32
    assert hf_mapping.tensor_send_dtype("model.layers.1.mlp.gate.weight", torch.bfloat16) == torch.bfloat16


class FakeMoELayer(torch.nn.Module):
    """Stands in for Megatron's MoELayer: what `global_named_params` reads (router, local_expert_indices)."""

    def __init__(self, local_indices: list[int], grouped: bool) -> None:
        super().__init__()
        self.local_expert_indices = local_indices
        self.router = torch.nn.Module()
        self.router.weight = torch.nn.Parameter(torch.zeros(4, 2))
        self.router.register_buffer("expert_bias", torch.zeros(4))
        self.router.register_buffer("local_tokens_per_expert", torch.zeros(4), persistent=False)
        self.experts = torch.nn.Module()
        if grouped:  # Transformer Engine's TEGroupedMLP: linear_fc1.weight0, weight1, ...
            self.experts.linear_fc1 = torch.nn.Module()
            for k in range(len(local_indices)):
                self.experts.linear_fc1.register_parameter(f"weight{k}", torch.nn.Parameter(torch.zeros(2, 2)))
        else:  # Megatron's SequentialMLP
            self.experts.local_experts = torch.nn.ModuleList()
            for _ in local_indices:
                expert = torch.nn.Module()
                expert.linear_fc1 = torch.nn.Linear(2, 2, bias=False)
                self.experts.local_experts.append(expert)


class FakeLayer(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module, number: int) -> None:
        super().__init__()
        self.layer_number = number
        self.pre_mlp_layernorm = torch.nn.RMSNorm(2)
        self.mlp = mlp


class FakeGPT(torch.nn.Module):
    """A one-stage model shaped like Megatron's GPTModel (`decoder.layers`, pre/post_process)."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.pre_process = self.post_process = True
        self.decoder = torch.nn.Module()
        dense = torch.nn.Module()
        dense.linear_fc1 = torch.nn.Linear(2, 2, bias=False)
        self.decoder.layers = torch.nn.ModuleList([FakeLayer(dense, 1), FakeLayer(mlp, 2)])


@pytest.mark.parametrize("grouped", [False, True], ids=["sequential", "te_grouped"])
def test_global_names_of_an_ep_ranks_experts(grouped: bool) -> None:
    model = FakeGPT(FakeMoELayer([2, 3], grouped))  # EP rank 1 of 2: experts 2 and 3
    names = set(global_named_params(model))
    assert {"decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
            "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"} <= names
    assert not any(".local_experts.0." in n or ".local_experts.1." in n or "weight0" in n for n in names)
    assert "decoder.layers.1.mlp.router.expert_bias" in names  # the buffer travels like a weight
    assert not any("local_tokens_per_expert" in n for n in names)
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in names  # a MoE layer's own norm
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names  # a dense layer's fused-fc1 name


def test_a_bucket_with_the_float32_expert_bias_is_aligned_and_typed() -> None:
    from hpc_rl.weights.bucket_layout import compute_layout
    from hpc_rl.weights.sender import _plan

    entries = [("norm", [("n", (3,))]), ("bias", [("model.layers.1.mlp.gate.e_score_correction_bias", (4,))]),
               ("w", [("w", (2, 2))])]
    (bucket,) = _plan(entries, torch.bfloat16, bucket_bytes=10**6)
    assert bucket.names[0].endswith("e_score_correction_bias") and bucket.dtypes == ["float32", "bfloat16", "bfloat16"]
    assert bucket.num_bytes == 4 * 4 + 2 * 3 + 2 * 4
    assert compute_layout(bucket.names, bucket.dtypes, bucket.shapes).total_bytes == bucket.num_bytes


def test_cpu_engine_addresses_fused_experts_by_checkpoint_name(tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hpc_rl.engines.cpu.weight_sync import load_named, named_tensors
    from hpc_rl.tiny_model import TinyMoeSpec, make_tiny_moe_model

    path = make_tiny_moe_model(tmp_path / "glm", TinyMoeSpec(family="glm4_moe", dense_layers=1, hidden_size=16,
                                                              num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    on_disk = load_file(str(path / "model.safetensors"))
    tensors = named_tensors(model)
    assert set(on_disk) <= set(tensors)
    assert all(torch.equal(tensors[name], value) for name, value in on_disk.items())
    new_up = torch.full_like(on_disk["model.layers.1.mlp.experts.2.up_proj.weight"], 0.5)
    load_named(model, [("model.layers.1.mlp.experts.2.up_proj.weight", new_up)])
    fused = model.model.layers[1].mlp.experts.gate_up_proj[2]
    inner = fused.shape[0] // 2
    assert torch.equal(fused[inner:], new_up)
    assert torch.equal(fused[:inner], on_disk["model.layers.1.mlp.experts.2.gate_proj.weight"])


def test_cpu_moe_overrides_turn_off_gpu_kernels_with_a_note_each() -> None:
    from hpc_rl.training.cpu_switch import cpu_moe_overrides

    fields = {"moe_grouped_gemm": True, "moe_permute_fusion": True, "moe_enable_deepep": False,
              "moe_token_dispatcher_type": "flex", "moe_router_topk": 2}
    changed, notes = cpu_moe_overrides(fields)
    assert changed == {"moe_grouped_gemm": False, "moe_permute_fusion": False, "moe_enable_deepep": False,
                       "moe_token_dispatcher_type": "alltoall", "moe_router_topk": 2}
    assert len(notes) == 3 and all("same" in note for note in notes)
    unchanged = {"moe_token_dispatcher_type": "alltoall"}
    assert cpu_moe_overrides(unchanged) == (unchanged, [])


def test_alltoall_split_sizes_become_host_ints_at_the_copy_point() -> None:
    from types import SimpleNamespace

    from hpc_rl.training.cpu_switch import _cpu_alltoall_split_sizes

    fake_dispatcher = SimpleNamespace(drop_and_pad=False, cuda_dtoh_point="before_ep_alltoall",
                                      input_splits=torch.tensor([3, 1]), output_splits=torch.tensor([2, 2]))
    tokens = torch.tensor([4])
    assert _cpu_alltoall_split_sizes(fake_dispatcher, "before_permutation_1", tokens) is tokens
    assert torch.is_tensor(fake_dispatcher.input_splits)  # not the copy point yet
    _cpu_alltoall_split_sizes(fake_dispatcher, "before_ep_alltoall", tokens)
    assert fake_dispatcher.input_splits == [3, 1] and fake_dispatcher.output_splits == [2, 2]
    assert all(type(size) is int for size in fake_dispatcher.input_splits)


def test_moe_layouts_megatron_cannot_train_are_refused_before_building() -> None:
    from hpc_rl.config.sections.training import TrainingConfig
    from hpc_rl.training.model_provider import check_moe_training

    arch = moe_arch()
    with pytest.raises(ValueError, match="sequence_parallel"):
        check_moe_training(arch, TrainingConfig(tensor_model_parallel_size=2))
    with pytest.raises(ValueError, match="allgather.*use alltoall"):
        check_moe_training(arch, TrainingConfig(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather"))
    check_moe_training(arch, TrainingConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                            expert_model_parallel_size=2))
    check_moe_training(arch, TrainingConfig(moe_token_dispatcher_type="allgather"))  # EP 1: nothing to all-gather
    check_moe_training(moe_arch(family="qwen3", num_moe_experts=None, moe_ffn_hidden_size=None, moe_layer_freq=None),
                       TrainingConfig(tensor_model_parallel_size=2))  # dense models are not concerned
