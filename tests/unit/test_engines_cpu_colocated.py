"""The CPU engine in colocated mode (one process, the tiny Qwen3 built in memory): released weights are
discarded as SGLang's memory saver discards them, a bare resume refuses generation, and
`/update_weights_from_tensor` loads a shared-memory share (and refuses pickles)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from transformers import Qwen3Config, Qwen3ForCausalLM

from hpc_rl.engines.cpu.scheduler import EngineStateError, Scheduler
from hpc_rl.engines.cpu.server import EngineServer, ServerInfo
from hpc_rl.engines.cpu.weight_sync import named_tensors
from hpc_rl.tiny_model import TINY_VOCAB, build_tokenizer
from hpc_rl.weights.colocated import serialize_named_tensors, update_weights_from_tensor_body, write_shared_memory_bucket

EOS = TINY_VOCAB.index("<|im_end|>")


def tiny_model(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(TINY_VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=EOS, pad_token_id=2)
    config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config).eval()


def hf_weights(model: Qwen3ForCausalLM) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def test_memory_saver_release_discards_weights_and_keeps_buffers() -> None:
    model = tiny_model(0)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    scheduler = Scheduler(model, build_tokenizer(), max_running_requests=4, context_length=256, weight_version="0",
                          memory_saver=True)
    scheduler.release_memory(["kv_cache", "weights"])
    assert all(torch.isnan(p).all() for p in model.parameters())
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())
    with pytest.raises(EngineStateError, match="already released"):
        scheduler.release_memory(["weights"])
    scheduler.resume_memory(["weights", "kv_cache"])
    assert scheduler.memory.generation_refusal() is not None


def test_without_the_memory_saver_weights_survive_a_release() -> None:
    model = tiny_model(0)
    before = hf_weights(model)
    scheduler = Scheduler(model, build_tokenizer(), max_running_requests=4, context_length=256, weight_version="0")
    scheduler.release_memory(["weights"])
    scheduler.resume_memory(["weights"])
    assert all(torch.equal(p, w) for p, (_, w) in zip(model.parameters(), before))
    assert scheduler.memory.generation_refusal() is None


def test_bare_resume_refuses_generation_and_a_reload_through_shared_memory_serves_the_new_weights() -> None:
    served, trained = tiny_model(0), tiny_model(1)
    tokenizer = build_tokenizer()
    scheduler = Scheduler(served, tokenizer, max_running_requests=4, context_length=256, weight_version="0",
                          memory_saver=True)
    info = ServerInfo(model_path="tiny", host="127.0.0.1", port=0, api_key=None, max_running_requests=4,
                      context_length=256)
    prompt = [5, 6, 7]
    generate = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
                "return_logprob": True}

    async def scenario() -> None:
        scheduler.start()
        client = TestClient(TestServer(EngineServer(scheduler, info).build_app()))
        await client.start_server()
        try:
            for path, body in [("/pause_generation", {"mode": "retract"}),
                               ("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
                               ("/resume_memory_occupation", {"tags": ["weights"]}),
                               ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
                               ("/continue_generation", {})]:
                assert (await client.post(path, json=body)).status == 200, path
            refused = await client.post("/generate", json=generate)
            assert refused.status == 500
            assert "resumed without a reload" in (await refused.json())["error"]["message"]

            bucket = write_shared_memory_bucket(hf_weights(trained))
            try:
                body = update_weights_from_tensor_body([bucket.descriptor], weight_version="1")
                outside = await client.post("/update_weights_from_tensor", json=body)
                assert outside.status == 400 and "begin_weight_update" in (await outside.json())["message"]
                assert (await client.post("/begin_weight_update", json={})).status == 200
                pickled = update_weights_from_tensor_body([serialize_named_tensors(hf_weights(trained)[:1])])
                refused_pickle = await client.post("/update_weights_from_tensor", json=pickled)
                assert refused_pickle.status == 400 and "does not unpickle" in (await refused_pickle.json())["message"]
                loaded = await client.post("/update_weights_from_tensor", json=body)
                assert loaded.status == 200, await loaded.text()
                assert (await client.post("/end_weight_update", json={})).status == 200
            finally:
                bucket.close()
            answer = await client.post("/generate", json=generate)
            assert answer.status == 200
            result = await answer.json()
            assert result["meta_info"]["weight_version"] == "1"
            output = result["output_ids"]
            with torch.no_grad():
                logits = trained(torch.tensor([prompt + output])).logits[0]
            want = torch.log_softmax(logits, -1)[[len(prompt) - 1 + i for i in range(len(output))], output]
            got = [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]
            assert torch.allclose(torch.tensor(got), want, atol=1e-5)
            for name, tensor in named_tensors(served).items():
                assert torch.equal(tensor, dict(trained.named_parameters(remove_duplicate=False)).get(
                    name, dict(trained.named_buffers()).get(name))), name
        finally:
            await client.close()
            scheduler.stop()

    asyncio.run(scenario())
