"""The CPU engine on families whose transformers cache is not keys/values alone: the hybrid Gated DeltaNet families
(conv and recurrent states), DeepSeek-V3.2 and GLM-5 (indexer keys), each on its tiny checkpoint, on both ways of
holding it (registry `cpu_engine_cache`: "batched_states", `engines/cpu/state_batch`, the families' own; "per_request",
`engines/cpu/row_caches`). Greedy and sampled answers, through continuous batching (a second wave joining running
requests, rows of different lengths leaving), carry the log-probs of a plain forward pass over each prefix;
every checkpoint tensor (the names a weight sync sends) reaches transformers' model; a model whose cache the
key/value batch cannot hold and whose family does not say so is refused by name."""

from __future__ import annotations

import pytest
import torch

from hpc_rl.engines.cpu import kv_batch
from hpc_rl.engines.cpu.__main__ import load_model
from hpc_rl.engines.cpu.requests import parse_generate_body
from hpc_rl.engines.cpu.scheduler import Scheduler
from hpc_rl.engines.cpu.weight_sync import load_named, named_tensors
from hpc_rl.models.registry import family
from hpc_rl.tiny_model import build_tokenizer

FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "deepseek_v32", "glm_moe_dsa"]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    # DeepSeek-V3.2 with 16 indexer heads, not the tiny default 4: with 4, exact zero index scores tie often and
    # torch.topk breaks ties by the row's length (tests/integration/test_hybrid_engine_runs.INDEX_HEADS)
    extra = {"index_n_heads": 16} if request.param in ("deepseek_v32", "glm_moe_dsa") else {}
    return family(request.param).make_tiny(tmp_path_factory.mktemp(request.param), **extra)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(str(checkpoint), "auto", "eager")


def submit(scheduler: Scheduler, tokenizer, body: dict):
    parsed = parse_generate_body(body, tokenizer=tokenizer, context_length=256)
    scheduler.submit_all(parsed.requests)
    return parsed.requests


def plain_logprobs(model: torch.nn.Module, sequence: list[int], prompt_len: int) -> torch.Tensor:
    """Log-probs of sequence[prompt_len:], token k's from one plain forward pass (no cache) over sequence[:k]: the
    tokens the engine had when it sampled it. (Not one pass over the whole sequence: DeepSeek-V3.2's indexer scores
    a key exactly 0 when every head's ReLU is off, which the tiny checkpoint's 4 heads make common, and torch.topk
    breaks ties among those zeros by the row's length, so a full-sequence pass may pick other keys than the same
    model run over the prefix: it does at position 9 of one sampled answer here.)"""
    found = []
    with torch.no_grad():
        for k in range(prompt_len, len(sequence)):
            logits = model(torch.tensor([sequence[:k]]), use_cache=False).logits[0, -1].float()
            found.append(torch.log_softmax(logits, dim=-1)[sequence[k]])
    return torch.stack(found)


def test_family_says_batched_states(model):
    assert kv_batch.cache_kind(model) == "batched_states"


@pytest.mark.parametrize("kind", ["batched_states", "per_request"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_answers_carry_a_plain_forward_passes_logprobs(model, temperature, kind, monkeypatch):
    monkeypatch.setattr(kv_batch, "cache_kind", lambda model: kind)
    tokenizer = build_tokenizer()
    scheduler = Scheduler(model, tokenizer, max_running_requests=8, context_length=256, weight_version="v0")
    body = {"return_logprob": True}
    first = submit(scheduler, tokenizer, {**body, "input_ids": [[5, 6, 7, 8, 9], [10, 11]], "sampling_params": [
        {"max_new_tokens": 6, "temperature": temperature, "ignore_eos": True},
        {"max_new_tokens": 4, "temperature": temperature, "ignore_eos": True}]})
    for _ in range(3):  # the second wave joins two running requests mid-way; the 4-token one leaves first
        scheduler.run_iteration()
    second = submit(scheduler, tokenizer, {**body, "input_ids": [[12, 13, 14], [7]], "sampling_params": {
        "max_new_tokens": 6, "temperature": temperature, "ignore_eos": True}})
    batch_types = set()
    while scheduler.run_iteration():
        batch_types.add(type(scheduler._batch).__name__)
    assert batch_types >= {"StateBatch" if kind == "batched_states" else "RowCaches"}
    for request in first + second:
        answer = request.future.result()
        assert len(answer["output_ids"]) == request.params.max_new_tokens
        engine = torch.tensor([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
        reference = plain_logprobs(model, request.input_ids + answer["output_ids"], len(request.input_ids))
        sequence = request.input_ids + answer["output_ids"]
        assert (engine - reference).abs().max().item() < 1e-5, (str(sequence), (engine - reference).tolist())


def test_every_checkpoint_tensor_reaches_the_model(model, checkpoint):
    from safetensors.torch import load_file

    weights = [(name, tensor) for file in sorted(checkpoint.glob("*.safetensors"))
               for name, tensor in load_file(str(file)).items()]
    targets = named_tensors(model)
    assert [name for name, _ in weights if name not in targets] == []
    scaled = [(name, tensor * 0.5) for name, tensor in weights]
    load_named(model, scaled, update=True)
    try:
        for name, tensor in scaled:
            assert torch.equal(targets[name], tensor.to(targets[name].dtype)), name
    finally:
        load_named(model, weights, update=True)


def test_an_undeclared_non_kv_cache_is_refused_by_name(model, monkeypatch):
    monkeypatch.setattr(kv_batch, "cache_kind", lambda model: "batched")
    with pytest.raises(RuntimeError, match="cpu_engine_cache='batched_states'|cannot hold"):
        kv_batch.prefill(model, [[5, 6, 7], [8, 9]])


def test_lora_and_routed_experts_are_refused_on_transformers_caches(model):
    from hpc_rl.engines.cpu.routed_experts import RoutedExpertsCapture

    if not getattr(model.config, "num_experts_per_tok", 0):
        pytest.skip("a dense family has no routers to capture")
    with pytest.raises(ValueError, match="without --enable-lora and --enable-return-routed-experts"):
        Scheduler(model, build_tokenizer(), max_running_requests=2, context_length=64, weight_version="v0",
                  routed_experts=RoutedExpertsCapture(model))
