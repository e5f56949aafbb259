"""The CPU engine's `--enable-return-routed-experts`: each answer carries the experts its forward passes
used for every token (prompt and output but the last), as SGLang 0.5.23 encodes them, through batching,
aborts and a retract-and-continue, for Qwen3-MoE and GLM-4.5 MoE (transformers' own model classes, tiny,
in memory). The reference is one plain forward pass over the whole sequence with the routers observed."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, \
    Qwen3MoeForCausalLM

from hpc_rl.engines.cpu.requests import parse_generate_body
from hpc_rl.engines.cpu.routed_experts import RoutedExpertsCapture
from hpc_rl.engines.cpu.scheduler import Scheduler
from hpc_rl.engines.http_api import RequestError
from hpc_rl.tiny_model import TINY_VOCAB, build_tokenizer

EOS = TINY_VOCAB.index("<|im_end|>")
LAYERS, TOPK = 3, 2
COMMON = dict(vocab_size=len(TINY_VOCAB), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_experts_per_tok=TOPK, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=EOS, pad_token_id=2)


def decisive_routers(model: torch.nn.Module) -> torch.nn.Module:
    """Router weights far from zero: no near-ties between the cached and the plain forward."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def moe_model(request) -> torch.nn.Module:
    torch.manual_seed(0)
    if request.param == "qwen3_moe":  # layer 1 dense (mlp_only_layers)
        config = Qwen3MoeConfig(**COMMON, num_experts=8, mlp_only_layers=[1])
        model = Qwen3MoeForCausalLM
    else:  # layer 0 dense (first_k_dense_replace)
        config = Glm4MoeConfig(**COMMON, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                               topk_group=1)
        model = Glm4MoeForCausalLM
    config._attn_implementation = "eager"
    return decisive_routers(model(config))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def reference_routing(model: torch.nn.Module, sequence: list[int]) -> np.ndarray:
    """[len - 1, layers, topk] sorted expert ids of one plain forward over sequence[:-1] (0 for dense layers)."""
    found: dict[int, torch.Tensor] = {}
    handles = [layer.mlp.gate.register_forward_hook(lambda module, args, out, i=i: found.__setitem__(i, out[-1]))
               for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model(torch.tensor([sequence[:-1]]))
    finally:
        for handle in handles:
            handle.remove()
    out = np.zeros((len(sequence) - 1, LAYERS, TOPK), dtype=np.int64)
    for layer, ids in found.items():
        out[:, layer] = ids.sort(-1).values.numpy()
    return out


def decoded(answer: dict) -> np.ndarray:
    ids = np.frombuffer(base64.b64decode(answer["meta_info"]["routed_experts"]), dtype="<i4")
    return np.sort(ids.reshape(-1, LAYERS, TOPK), axis=-1)


def submit(scheduler: Scheduler, tokenizer, body: dict):
    parsed = parse_generate_body(body, tokenizer=tokenizer, context_length=256)
    scheduler.submit_all(parsed.requests)
    return parsed.requests


def drain(scheduler: Scheduler) -> None:
    while scheduler.run_iteration():
        pass


def test_answers_carry_every_tokens_routing_through_batching_aborts_and_retracts(moe_model, tokenizer) -> None:
    capture = RoutedExpertsCapture(moe_model)
    scheduler = Scheduler(moe_model, tokenizer, max_running_requests=8, context_length=256, weight_version="v0",
                          routed_experts=capture)
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    batch = submit(scheduler, tokenizer, {"input_ids": [[5, 6, 7, 8, 9], [10, 11]], "sampling_params": params,
                                          "return_routed_experts": True})
    drain(scheduler)
    for request in batch:
        answer = request.future.result()
        sequence = request.input_ids + answer["output_ids"]
        assert decoded(answer).shape == (len(sequence) - 1, LAYERS, TOPK)
        assert (decoded(answer) == reference_routing(moe_model, sequence)).all()
    # aborted after 2 decode steps; a second request retracted by a pause, then continued
    aborted, = submit(scheduler, tokenizer, {"input_ids": [7, 8, 9], "sampling_params": params, "rid": "a",
                                             "return_routed_experts": True})
    retracted, = submit(scheduler, tokenizer, {"input_ids": [12, 13], "sampling_params": params, "rid": "r",
                                               "return_routed_experts": True})
    for _ in range(3):
        scheduler.run_iteration()
    scheduler.call(lambda: scheduler.abort("a", abort_all=False))
    scheduler.call(lambda: scheduler.pause("retract"))
    scheduler.run_iteration()
    scheduler.call(scheduler.resume_generation)
    drain(scheduler)
    for request in (aborted, retracted):
        answer = request.future.result()
        sequence = request.input_ids + answer["output_ids"]
        assert 1 <= len(answer["output_ids"]) and (decoded(answer) == reference_routing(moe_model, sequence)).all()
    assert aborted.future.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(retracted.future.result()["output_ids"]) == 6
    capture.close()


def test_start_len_cuts_the_rows_and_requests_without_the_flag_get_none(moe_model, tokenizer) -> None:
    capture = RoutedExpertsCapture(moe_model)
    scheduler = Scheduler(moe_model, tokenizer, max_running_requests=8, context_length=256, weight_version="v0",
                          routed_experts=capture)
    params = {"max_new_tokens": 3, "temperature": 0.0}
    cut, = submit(scheduler, tokenizer, {"input_ids": [5, 6, 7, 8], "sampling_params": params,
                                         "return_routed_experts": True, "routed_experts_start_len": 3})
    plain, = submit(scheduler, tokenizer, {"input_ids": [5, 6, 7, 8], "sampling_params": params})
    drain(scheduler)
    answer = cut.future.result()
    full = reference_routing(moe_model, cut.input_ids + answer["output_ids"])
    assert (decoded(answer) == full[3:]).all()
    assert "routed_experts" not in plain.future.result()["meta_info"]
    with pytest.raises(RequestError, match="routed_experts_start_len=5 is higher than the number of input tokens"):
        parse_generate_body({"input_ids": [1, 2, 3, 4], "return_routed_experts": True, "routed_experts_start_len": 5},
                            tokenizer=tokenizer, context_length=256)
    capture.close()
    without = Scheduler(moe_model, tokenizer, max_running_requests=8, context_length=256, weight_version="v0")
    asked, = submit(without, tokenizer, {"input_ids": [5, 6], "sampling_params": params, "return_routed_experts": True})
    drain(without)
    assert "routed_experts" not in asked.future.result()["meta_info"]  # an engine started without the flag


def test_a_dense_model_cannot_return_routed_experts() -> None:
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="has no MoE routers"):
        RoutedExpertsCapture(dense)
