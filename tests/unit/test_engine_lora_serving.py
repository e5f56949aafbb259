"""The CPU engine serves base + LoRA adapters (issue 33) with PEFT's numerics: a batch mixing an adapter's rows and
the base's gives PEFT's logits and the base's, on transformers' Qwen3 and on the engine's own; loads from a PEFT
directory and from PEFT-named tensors agree; SGLang's refusals are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpc_rl.engines.cpu.lora_serving import EngineLoraAdapters, LoraAdapterError

TOKENS = torch.tensor([[3, 5, 7, 11, 13, 17, 19, 2], [1, 4, 9, 16, 23, 0, 8, 6]])


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, torch.Tensor]:
    """A PEFT adapter with every matrix random (PEFT starts B at zero), and PEFT's logits for TOKENS."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn_like(param))
        logits = model.eval()(TOKENS).logits
    directory = tmp_path_factory.mktemp("peft")
    model.save_pretrained(directory)
    return directory, logits


def _hf(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _native_logits(model: torch.nn.Module) -> torch.Tensor:
    positions = torch.arange(TOKENS.shape[1]).expand(TOKENS.shape[0], -1)
    return model.forward_cached(TOKENS, positions, torch.ones_like(TOKENS), None, last_only=False)[0]


def test_mixed_batch_rows_get_their_adapter_or_the_base(tiny_model_dir: Path, peft_adapter) -> None:  # noqa: ANN001
    from hpc_rl.engines.cpu.native_qwen3 import load_native_qwen3

    directory, peft_logits = peft_adapter
    hf = _hf(tiny_model_dir)
    with torch.no_grad():
        base_logits = hf(TOKENS).logits
    assert (peft_logits - base_logits).abs().max().item() > 1e-2  # the adapter matters
    adapters = EngineLoraAdapters(hf, max_lora_rank=8)
    adapters.load_dir("policy", directory)
    with torch.no_grad(), adapters.rows_of(["policy", None]):
        mixed = hf(TOKENS).logits
    assert (mixed[0] - peft_logits[0]).abs().max().item() < 1e-5
    assert (mixed[1] - base_logits[1]).abs().max().item() < 1e-6
    with torch.no_grad():
        assert torch.equal(hf(TOKENS).logits, base_logits)  # no rows named: the base

    native = load_native_qwen3(tiny_model_dir)
    served = EngineLoraAdapters(native)
    served.load_dir("policy", directory)
    with served.rows_of([None, "policy"]):
        logits = _native_logits(native)
    assert (logits[1] - peft_logits[1]).abs().max().item() < 1e-5
    assert (logits[0] - base_logits[0]).abs().max().item() < 1e-5


def test_tensors_load_equals_the_directory_and_refusals(tiny_model_dir: Path, peft_adapter) -> None:  # noqa: ANN001
    import json

    from safetensors.torch import load_file

    directory, peft_logits = peft_adapter
    hf = _hf(tiny_model_dir)
    adapters = EngineLoraAdapters(hf, max_lora_rank=4)
    config = json.loads((directory / "adapter_config.json").read_text())
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    adapters.load_tensors("v2", config, tensors)
    with torch.no_grad(), adapters.rows_of(["v2", "v2"]):
        assert (hf(TOKENS).logits - peft_logits).abs().max().item() < 1e-5

    with pytest.raises(LoraAdapterError, match="already loaded"):
        adapters.load_tensors("v2", config, tensors)
    with pytest.raises(LoraAdapterError, match="not a loaded LoRA adapter"):
        adapters.check_request("v3")
    with pytest.raises(LoraAdapterError, match="max-lora-rank 2"):
        EngineLoraAdapters(hf, max_lora_rank=2).load_tensors("big", config, tensors)
    with pytest.raises(LoraAdapterError, match="no DoRA"):
        EngineLoraAdapters(hf).load_tensors("dora", {**config, "use_dora": True}, tensors)
    with pytest.raises(LoraAdapterError, match="no module"):
        renamed = {k.replace("layers.0.", "layers.9."): v for k, v in tensors.items()}
        EngineLoraAdapters(hf).load_tensors("elsewhere", config, renamed)
    adapters.unload("v2")
    with pytest.raises(LoraAdapterError, match="is not loaded"):
        adapters.unload("v2")


def _reference_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1], -1)
    return logprobs.gather(1, torch.tensor(output)[:, None]).squeeze(1).tolist()


def test_http_endpoints_load_generate_with_lora_path_and_unload(tiny_model_dir: Path, peft_adapter) -> None:  # noqa: ANN001
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer
    from peft import PeftModel

    from hpc_rl.engines.cpu.engine_tokenizer import load_engine_tokenizer
    from hpc_rl.engines.cpu.scheduler import Scheduler
    from hpc_rl.engines.cpu.server import EngineServer, ServerInfo

    directory, _ = peft_adapter
    model, tokenizer = _hf(tiny_model_dir), load_engine_tokenizer(str(tiny_model_dir))
    peft = PeftModel.from_pretrained(_hf(tiny_model_dir), str(directory)).eval()
    info = ServerInfo(model_path="/m", host="127.0.0.1", port=1, api_key=None, max_running_requests=4,
                      context_length=256)
    prompt = [3, 5, 7, 11]
    params = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    async def scenario() -> None:
        plain = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="v0")
        served = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="v0",
                           lora=EngineLoraAdapters(model, max_lora_rank=8))
        for scheduler in (plain, served):
            scheduler.start()
        without = TestClient(TestServer(EngineServer(plain, info).build_app()))
        client = TestClient(TestServer(EngineServer(served, info).build_app()))
        await without.start_server()
        await client.start_server()
        try:
            refused = await without.post("/load_lora_adapter", json={"lora_name": "p", "lora_path": str(directory)})
            assert refused.status == 400 and "--enable-lora" in (await refused.json())["error_message"]
            body = {"input_ids": [prompt, prompt], "lora_path": ["policy-v1", None], "return_logprob": True,
                    "sampling_params": params}
            unknown = await client.post("/generate", json=body)
            assert unknown.status == 400 and "not a loaded LoRA adapter" in await unknown.text()
            loaded = await client.post("/load_lora_adapter", json={"lora_name": "policy-v1",
                                                                   "lora_path": str(directory)})
            answer = await loaded.json()
            assert loaded.status == 200 and answer["success"] and answer["loaded_adapters"] == {
                "policy-v1": str(directory)}
            twice = await client.post("/load_lora_adapter", json={"lora_name": "policy-v1",
                                                                  "lora_path": str(directory)})
            assert twice.status == 400 and "already loaded" in (await twice.json())["error_message"]
            results = await (await client.post("/generate", json=body)).json()
            for result, reference in zip(results, (peft, model)):
                got = [item[0] for item in result["meta_info"]["output_token_logprobs"]]
                output = [item[1] for item in result["meta_info"]["output_token_logprobs"]]
                expected = _reference_logprobs(reference, prompt, output)
                assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4, (got, expected)
            assert results[0]["output_ids"] != results[1]["output_ids"] or \
                results[0]["meta_info"]["output_token_logprobs"] != results[1]["meta_info"]["output_token_logprobs"]
            unloaded = await client.post("/unload_lora_adapter", json={"lora_name": "policy-v1"})
            assert unloaded.status == 200 and (await unloaded.json())["loaded_adapters"] == {}
            assert (await client.post("/generate", json=body)).status == 400
        finally:
            await without.close()
            await client.close()
            plain.stop()
            served.stop()

    asyncio.run(scenario())


def test_load_from_tensors_endpoint_serves_the_adapter_and_refuses_a_pickle(tiny_model_dir: Path,
                                                                            peft_adapter) -> None:  # noqa: ANN001
    """/load_lora_adapter_from_tensors with SGLang 0.5.23's body: a shared-memory share (the CPU twin of its pickled
    CUDA IPC handles) serves PEFT's logits; the pickle SGLang takes on a GPU is refused, and so is what SGLang
    refuses (LoRA off, a name already loaded, a rank over --max-lora-rank)."""
    import asyncio
    import json

    from aiohttp.test_utils import TestClient, TestServer
    from safetensors.torch import load_file

    from hpc_rl.engines.cpu.engine_tokenizer import load_engine_tokenizer
    from hpc_rl.engines.cpu.scheduler import Scheduler
    from hpc_rl.engines.cpu.server import EngineServer, ServerInfo
    from hpc_rl.weights.colocated import serialize_adapter_share, serialize_tensor_dict
    from hpc_rl.weights.lora_sync import load_from_tensors_request

    directory, peft_logits = peft_adapter
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    config = json.loads((directory / "adapter_config.json").read_text())
    model, tokenizer = _hf(tiny_model_dir), load_engine_tokenizer(str(tiny_model_dir))
    info = ServerInfo(model_path="/m", host="127.0.0.1", port=1, api_key=None, max_running_requests=4,
                      context_length=256)
    lora = EngineLoraAdapters(model, max_lora_rank=4)
    share, bucket = serialize_adapter_share(sorted(tensors.items()))
    assert bucket is not None

    async def scenario() -> None:
        scheduler = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="v0",
                              lora=lora)
        plain = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="v0")
        scheduler.start()
        plain.start()
        client = TestClient(TestServer(EngineServer(scheduler, info).build_app()))
        without = TestClient(TestServer(EngineServer(plain, info).build_app()))
        await client.start_server()
        await without.start_server()
        try:
            body = load_from_tensors_request("policy-v1", config, [share])
            off = await without.post("/load_lora_adapter_from_tensors", json=body)
            assert off.status == 400 and "--enable-lora" in (await off.json())["error_message"]
            pickled = load_from_tensors_request("p", config, [serialize_tensor_dict(sorted(tensors.items()))])
            refused = await client.post("/load_lora_adapter_from_tensors", json=pickled)
            assert refused.status == 400 and "does not unpickle" in (await refused.json())["error_message"]
            loaded = await client.post("/load_lora_adapter_from_tensors", json=body)
            answer = await loaded.json()
            assert loaded.status == 200 and answer["loaded_adapters"] == {"policy-v1": "__tensor__"}, answer
            twice = await client.post("/load_lora_adapter_from_tensors", json=body)
            assert twice.status == 400 and "already loaded" in (await twice.json())["error_message"]
            big = load_from_tensors_request("big", {**config, "r": 8}, [share])
            assert (await client.post("/load_lora_adapter_from_tensors", json=big)).status == 400
            bad = await client.post("/load_lora_adapter_from_tensors", json={"lora_name": "x"})
            assert bad.status == 400 and "config_dict" in (await bad.json())["error_message"]
        finally:
            await client.close()
            await without.close()
            scheduler.stop()
            plain.stop()

    try:
        asyncio.run(scenario())
    finally:
        bucket.close()
    with torch.no_grad(), lora.rows_of(["policy-v1", None]):
        logits = model(TOKENS).logits
    assert (logits[0] - peft_logits[0]).abs().max().item() < 1e-5


def test_weights_cpu_backup_keeps_the_base_across_a_release() -> None:
    """SGLang's --enable-weights-cpu-backup (colocated LoRA, --lora-base-cpu-backup): released weights come back on
    resume; without it the memory saver discards them and generation is refused until a reload."""
    from hpc_rl.engines.cpu.memory_occupation import MemoryOccupation

    for backup in (True, False):
        model = torch.nn.Linear(3, 2)
        before = [p.detach().clone() for p in model.parameters()]
        memory = MemoryOccupation(model, memory_saver=True, weights_cpu_backup=backup)
        memory.release(["weights", "kv_cache"], requests_running=False)
        assert all(torch.isnan(p).all() for p in model.parameters())  # the device memory is gone meanwhile
        memory.resume(["weights", "kv_cache"])
        if backup:
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            assert memory.generation_refusal() is None
        else:
            assert "resumed without a reload" in (memory.generation_refusal() or "")
