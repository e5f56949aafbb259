"""Unit tests of the CPU engine in one process: scheduler driven step by step, and the HTTP layer.

The model is the tiny Qwen3 built in memory (no checkpoint on disk), as transformers' module and as the
engine's own forward (`native_qwen3`) with the same weights: each scheduler test runs on both, checked
against transformers' plain forward pass. The scheduler is driven with `run_iteration()` on the test
thread, so aborts and pauses land at known steps.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from transformers import Qwen3Config, Qwen3ForCausalLM

from hpc_rl.engines.cpu.native_qwen3 import NativeQwen3ForCausalLM
from hpc_rl.engines.cpu.requests import GenerationRequest, parse_generate_body
from hpc_rl.engines.cpu.sampling import make_generator, parse_sampling_params
from hpc_rl.engines.cpu.scheduler import EngineStateError, Scheduler
from hpc_rl.engines.cpu.server import EngineServer, ServerInfo
from hpc_rl.engines.cpu.weight_sync import load_named
from hpc_rl.tiny_model import TINY_VOCAB, build_tokenizer

EOS = TINY_VOCAB.index("<|im_end|>")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(TINY_VOCAB), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=EOS, pad_token_id=2)
    config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module", params=["transformers", "native"])
def model(request, hf_model):
    if request.param == "transformers":
        return hf_model
    native = NativeQwen3ForCausalLM(hf_model.config.to_dict()).eval()
    load_named(native, list(hf_model.state_dict().items()))
    return native


@pytest.fixture
def scheduler(model, tokenizer):
    return Scheduler(model, tokenizer, max_running_requests=8, context_length=256, weight_version="v0")


def make_request(rid: str, prompt: list[int], **sampling) -> GenerationRequest:
    params = parse_sampling_params(sampling)
    return GenerationRequest(rid=rid, input_ids=prompt, params=params, return_logprob=True,
                             generator=make_generator(params))


def reference_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(output)]


def drive(scheduler: Scheduler, futures, max_iterations: int = 1000) -> None:
    for _ in range(max_iterations):
        if all(f.done() for f in futures):
            return
        scheduler.run_iteration()
    raise AssertionError("requests did not finish")


def test_continuous_batching_logprobs_match_a_forward_pass(scheduler, hf_model):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17]]
    futures = [scheduler.submit(make_request(f"r{i}", p, max_new_tokens=12, ignore_eos=True, sampling_seed=i))
               for i, p in enumerate(prompts[:2])]
    for _ in range(3):
        scheduler.run_iteration()
    futures += [scheduler.submit(make_request(f"r{i + 2}", p, max_new_tokens=6 + i, ignore_eos=True))
                for i, p in enumerate(prompts[2:])]  # join a running batch
    drive(scheduler, futures)
    for prompt, future in zip(prompts, futures):
        response = future.result()
        output = response["output_ids"]
        got = [entry[0] for entry in response["meta_info"]["output_token_logprobs"]]
        assert [entry[1] for entry in response["meta_info"]["output_token_logprobs"]] == output
        assert max(abs(a - b) for a, b in zip(got, reference_logprobs(hf_model, prompt, output))) < 1e-4
        assert response["meta_info"]["finish_reason"] == {"type": "length", "length": len(output)}
        assert response["meta_info"]["weight_versions"] == [{"version": "v0", "start": 0, "end": len(output)}]


def test_seeded_sampling_is_reproducible(scheduler):
    runs = []
    for _ in range(2):
        future = scheduler.submit(make_request("s", [5, 6], max_new_tokens=8, ignore_eos=True, sampling_seed=42))
        drive(scheduler, [future])
        runs.append(future.result()["output_ids"])
    assert runs[0] == runs[1]


def test_abort_by_rid_and_all_return_partial_output(scheduler):
    futures = [scheduler.submit(make_request(rid, [5, 6], max_new_tokens=50, ignore_eos=True))
               for rid in ("a", "b", "c")]
    for _ in range(4):
        scheduler.run_iteration()
    scheduler.call(lambda: scheduler.abort("b", abort_all=False))
    scheduler.call(lambda: scheduler.abort("unknown-rid", abort_all=False))  # silent no-op
    scheduler.run_iteration()
    assert futures[1].done() and not futures[0].done()
    partial = futures[1].result()
    assert partial["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(partial["output_ids"]) < 50
    scheduler.call(lambda: scheduler.abort(None, abort_all=True))
    scheduler.run_iteration()
    assert all(f.result()["meta_info"]["finish_reason"]["type"] == "abort" for f in futures)


def test_pause_retract_resumes_with_recomputed_kv(scheduler, hf_model):
    future = scheduler.submit(make_request("p", [7, 8, 9], max_new_tokens=10, ignore_eos=True))
    for _ in range(4):
        scheduler.run_iteration()
    scheduler.call(lambda: scheduler.pause("retract"))
    assert not scheduler.run_iteration() and scheduler.num_waiting == 1 and scheduler.num_running == 0
    late = scheduler.submit(make_request("late", [5], max_new_tokens=2, ignore_eos=True))
    assert not scheduler.run_iteration() and not late.done()  # waits while paused
    scheduler.call(scheduler.resume_generation)
    drive(scheduler, [future, late])
    response = future.result()
    assert len(response["output_ids"]) == 10
    got = [entry[0] for entry in response["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, reference_logprobs(hf_model, [7, 8, 9], response["output_ids"]))) < 1e-4


def test_pause_abort_ends_in_flight_requests(scheduler):
    future = scheduler.submit(make_request("x", [5, 6], max_new_tokens=40, ignore_eos=True))
    scheduler.run_iteration()
    scheduler.call(lambda: scheduler.pause("abort"))
    scheduler.run_iteration()
    assert future.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert scheduler.paused


def test_stop_rules(scheduler, tokenizer):
    greedy = scheduler.submit(make_request("g", [5, 6], max_new_tokens=20, temperature=0, ignore_eos=True))
    drive(scheduler, [greedy])
    tokens = greedy.result()["output_ids"]
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    by_id = scheduler.submit(make_request("i", [5, 6], max_new_tokens=20, temperature=0, stop_token_ids=[stop_at]))
    word = tokenizer.convert_ids_to_tokens(stop_at)
    by_str = scheduler.submit(make_request("t", [5, 6], max_new_tokens=20, temperature=0, stop=[word]))
    held = scheduler.submit(make_request("m", [5, 6], max_new_tokens=20, temperature=0, stop_token_ids=[stop_at],
                                         min_new_tokens=first + 2))
    none = scheduler.submit(make_request("z", [5, 6], max_new_tokens=0))
    drive(scheduler, [by_id, by_str, held, none])
    assert by_id.result()["output_ids"] == tokens[: first + 1]
    assert by_id.result()["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert by_str.result()["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert word not in by_str.result()["text"].split()
    assert stop_at not in held.result()["output_ids"][: first + 2]
    assert none.result()["output_ids"] == [] and none.result()["meta_info"]["finish_reason"]["type"] == "length"


def test_memory_misuse_is_refused(scheduler):
    future = scheduler.submit(make_request("r", [5], max_new_tokens=30, ignore_eos=True))
    scheduler.run_iteration()
    with pytest.raises(EngineStateError, match="pause"):
        scheduler.release_memory(["kv_cache"])
    with pytest.raises(EngineStateError, match="not released"):
        scheduler.resume_memory(["weights"])
    scheduler.pause("retract")
    scheduler.release_memory(["kv_cache", "weights"])
    scheduler.resume_generation()
    assert not scheduler.run_iteration()  # released memory: nothing runs
    scheduler.resume_memory(["kv_cache", "weights"])
    drive(scheduler, [future])


def test_generate_body_validation(tokenizer):
    parsed = parse_generate_body({"text": "add 1 + 2 =", "rid": "q"}, tokenizer=tokenizer, context_length=64)
    request, = parsed.requests
    assert request.rid == "q" and len(request.input_ids) == 5 and not parsed.batched
    ids_win = parse_generate_body({"input_ids": [1], "text": "a"}, tokenizer=tokenizer, context_length=64)
    assert ids_win.requests[0].input_ids == [1]  # as SGLang: ids win over text
    for body, match in [({"rid": "x"}, "Either text, input_ids"), ({"rid": ["a"], "input_ids": [1]}, "rid"),
                        ({"input_ids": [1] * 70}, "context length"),
                        ({"input_ids": [[1], [2]], "rid": ["a"]}, "mismatch"),
                        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "bogus")]:
        with pytest.raises(ValueError, match=match):
            parse_generate_body(body, tokenizer=tokenizer, context_length=64)


def test_http_layer_auth_sessions_and_errors(model, hf_model, tokenizer, tmp_path):
    checkpoint = tmp_path / "ckpt"
    async def scenario() -> None:
        scheduler = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="v0")
        info = ServerInfo(model_path="/m", host="127.0.0.1", port=1, api_key="key", max_running_requests=4,
                          context_length=256)
        scheduler.start()
        client = TestClient(TestServer(EngineServer(scheduler, info).build_app()))
        await client.start_server()
        auth = {"Authorization": "Bearer key"}
        try:
            assert (await client.get("/health")).status == 200
            assert (await client.get("/health_generate")).status == 200
            assert (await client.post("/pause_generation", json={})).status == 401
            wrong = {"Authorization": "Bearer kex"}
            assert (await client.post("/pause_generation", json={}, headers=wrong)).status == 401
            generate = {"input_ids": [5, 6], "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            for path in ("/generate", "/server_info", "/model_info"):  # as SGLang: all but /health* need it
                assert (await client.post(path, json=generate)).status == 401, path
            response = await client.post("/generate", json=generate, headers={"Authorization": "bearer key"})
            body = await response.json()
            assert response.status == 200 and len(body["meta_info"]["output_token_logprobs"]) == 3
            bad = await client.post("/generate", json={"input_ids": [5], "sampling_params": {"nope": 1}},
                                    headers=auth)
            assert bad.status == 400 and "nope" in (await bad.json())["error"]
            update = {"names": [], "dtypes": [], "shapes": [], "group_name": "g"}
            assert (await client.post("/update_weights_from_distributed", json=update, headers=auth)).status == 400
            assert (await client.post("/end_weight_update", json={}, headers=auth)).status == 400
            assert (await client.post("/begin_weight_update", json={}, headers=auth)).status == 200
            assert (await client.post("/begin_weight_update", json={}, headers=auth)).status == 400
            assert (await client.post("/end_weight_update", json={}, headers=auth)).status == 200
            missing = await client.post("/resume_memory_occupation", json={"tags": ["weights"]}, headers=auth)
            assert missing.status == 400 and "not released" in (await missing.json())["message"]
            info_body = await (await client.get("/model_info", headers=auth)).json()
            assert info_body["weight_version"] == "v0"
            hf_model.save_pretrained(checkpoint)
            disk = await client.post("/update_weights_from_disk",
                                     json={"model_path": str(checkpoint), "weight_version": "disk-1"}, headers=auth)
            assert disk.status == 200, await disk.text()
            assert (await (await client.get("/model_info", headers=auth)).json())["weight_version"] == "disk-1"
            weights = await client.post("/get_weights_by_name", json={"name": "lm_head.weight", "truncate_size": 2},
                                        headers=auth)
            assert len(await weights.json()) == 2
        finally:
            await client.close()

    asyncio.run(scenario())


def test_admin_calls_need_the_job_engine_key(model, tokenizer):
    """The engine key derived from the job secret: without it an admin call (pause) or a /generate gets
    401; with it (EngineAdmin / EngineClient given the key, as the controller is) they succeed."""
    from hpc_rl.controller.engine_admin import EngineAdmin, EngineAdminError
    from hpc_rl.protocol.http_client import EngineConnections
    from hpc_rl.protocol.secret import Secret, engine_api_key
    from hpc_rl.rollout.engine_client import EngineClient, EngineHTTPError, StaticEngineDirectory

    key = engine_api_key(Secret(key=b"j" * 32))

    async def scenario() -> None:
        scheduler = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="v0")
        info = ServerInfo(model_path="/m", host="127.0.0.1", port=1, api_key=key, max_running_requests=4,
                          context_length=256)
        scheduler.start()
        server = TestServer(EngineServer(scheduler, info).build_app())
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        body = {"rid": "k1", "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
        try:
            pools = [EngineConnections(), EngineConnections(api_key=key[::-1]), EngineConnections(api_key=key)]
            without, wrong, admin = (EngineAdmin(url, pool) for pool in pools)
            for refused in (without, wrong):
                with pytest.raises(EngineAdminError, match="pause_generation answered HTTP 401"):
                    await refused.pause("abort")
                assert await refused.healthy()  # /health stays open (probes)
            await admin.pause("abort")
            await admin.resume_generation()
            assert (await admin.model_info())["weight_version"] == "v0"
            for pool in pools:
                await pool.close()
            async with EngineClient(StaticEngineDirectory([url])) as client:
                with pytest.raises(EngineHTTPError, match="HTTP 401"):
                    await client.generate(dict(body))
            async with EngineClient(StaticEngineDirectory([url]), api_key=key) as client:
                answer = await client.generate(dict(body))
                assert len(answer.body["output_ids"]) == 2
                assert await client.abort_all() == 1
        finally:
            await server.close()

    asyncio.run(scenario())
