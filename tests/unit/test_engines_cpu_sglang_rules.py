"""The CPU engine follows SGLang 0.5.23 where the two were measured to differ (issue 9): text decoded in
context, over-context 400, ignore_eos ignoring stop ids, a dead scheduler failing requests instead of
hanging, batched input_ids, streaming, error and control bodies. In one process (scheduler driven on
the test thread or its own thread, HTTP through aiohttp's test server); the same checks run against
real engine processes (and real SGLang when installed) in tests/integration/test_engine_conformance.py.
"""

from __future__ import annotations

import asyncio
import threading

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from hpc_rl.engines.cpu.requests import GenerationRequest, RequestError, parse_generate_body, render_response
from hpc_rl.engines.cpu.sampling import parse_sampling_params
from hpc_rl.engines.cpu.scheduler import Scheduler, SchedulerDied
from hpc_rl.engines.cpu.server import EngineServer, ServerInfo
from hpc_rl.tiny_model import TINY_VOCAB
from tests.unit.test_engines_cpu import drive, hf_model, make_request, model, scheduler, tokenizer  # noqa: F401 - fixtures

ANSWER, THREE = TINY_VOCAB.index("answer"), TINY_VOCAB.index("3")


def test_text_is_decoded_in_the_prompts_context_keeping_the_leading_space(tokenizer):
    prompt = tokenizer.encode("add 1 + 2 =", add_special_tokens=False)
    request = GenerationRequest(rid="t", input_ids=prompt, params=parse_sampling_params({}),
                                output_ids=[ANSWER, THREE], finish_reason={"type": "length", "length": 2})
    assert render_response(request, tokenizer=tokenizer, weight_version="v0")["text"] == " answer 3"


def test_a_matched_stop_token_is_trimmed_from_text_but_kept_in_output_ids(tokenizer):
    params = parse_sampling_params({"stop_token_ids": [THREE]})
    request = GenerationRequest(rid="t", input_ids=[9, 15], params=params, output_ids=[ANSWER, THREE],
                                finish_reason={"type": "stop", "matched": THREE})
    response = render_response(request, tokenizer=tokenizer, weight_version="v0")
    assert response["text"] == " answer" and response["output_ids"] == [ANSWER, THREE]


def test_prompt_plus_max_new_tokens_over_the_context_is_a_400_as_in_sglang(tokenizer):
    fits = parse_generate_body({"input_ids": [1] * 50, "sampling_params": {"max_new_tokens": 14}},
                               tokenizer=tokenizer, context_length=64)
    assert fits.requests[0].params.max_new_tokens == 12  # exactly the context passes, capped to 64 - 2 - 50
    with pytest.raises(RequestError, match="Requested token count exceeds the model's maximum context length") as over:
        parse_generate_body({"input_ids": [1] * 50, "sampling_params": {"max_new_tokens": 15}},
                            tokenizer=tokenizer, context_length=64)
    assert over.value.body() == {"error": {"message": str(over.value)}}
    with pytest.raises(RequestError, match=r"Input length \(58 tokens\) exceeds the maximum allowed length \(58"):
        parse_generate_body({"input_ids": [1] * 58, "sampling_params": {"max_new_tokens": 1}},
                            tokenizer=tokenizer, context_length=64)


def test_ignore_eos_also_ignores_stop_token_ids(scheduler):
    greedy = scheduler.submit(make_request("g", [5, 6], max_new_tokens=12, temperature=0, ignore_eos=True))
    drive(scheduler, [greedy])
    tokens = greedy.result()["output_ids"]
    ignoring = scheduler.submit(make_request("i", [5, 6], max_new_tokens=12, temperature=0, ignore_eos=True,
                                             stop_token_ids=[tokens[2]]))
    drive(scheduler, [ignoring])
    assert ignoring.result()["output_ids"] == tokens
    assert ignoring.result()["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_zero_new_tokens_report_one_empty_weight_version_span(scheduler):
    future = scheduler.submit(make_request("z", [5, 6], max_new_tokens=0))
    drive(scheduler, [future])
    assert future.result()["meta_info"]["weight_versions"] == [{"version": "v0", "start": 0, "end": 0}]


def test_a_dead_scheduler_fails_every_request_instead_of_hanging(model, tokenizer):
    """An out-of-vocabulary id kills SGLang's process; here the scheduler thread's death fails the request,
    every later one at once, and calls on_fatal (the engine process exits there)."""
    fatal = threading.Event()
    scheduler = Scheduler(model, tokenizer, max_running_requests=4, context_length=256, weight_version="v0",
                          on_fatal=lambda error: fatal.set())
    scheduler.start()
    try:
        bad = scheduler.submit(make_request("oov", [5, len(TINY_VOCAB) + 100], max_new_tokens=3))
        with pytest.raises(SchedulerDied):
            bad.result(timeout=60)
        assert fatal.wait(timeout=10)
        with pytest.raises(SchedulerDied):
            scheduler.submit(make_request("later", [5, 6], max_new_tokens=3)).result(timeout=5)
        with pytest.raises(SchedulerDied):
            scheduler.call(lambda: None).result(timeout=5)
    finally:
        scheduler.stop()


def _serve(model, tokenizer, scenario) -> None:
    async def run() -> None:
        scheduler = Scheduler(model, tokenizer, max_running_requests=8, context_length=256, weight_version="v0")
        info = ServerInfo(model_path="/m", host="127.0.0.1", port=1, api_key=None, max_running_requests=8,
                          context_length=256)
        scheduler.start()
        client = TestClient(TestServer(EngineServer(scheduler, info).build_app()))
        await client.start_server()
        try:
            await scenario(client)
        finally:
            await client.close()

    asyncio.run(run())


def test_http_batched_input_ids_answer_a_list_in_order(model, tokenizer):
    async def scenario(client: TestClient) -> None:
        body = {"rid": "b", "input_ids": [[5, 6], [7], [8, 9, 10]], "return_logprob": True,
                "sampling_params": [{"max_new_tokens": n, "ignore_eos": True} for n in (2, 3, 4)]}
        response = await client.post("/generate", json=body)
        answers = await response.json()
        assert response.status == 200 and isinstance(answers, list)
        assert [a["meta_info"]["id"] for a in answers] == ["b_0", "b_1", "b_2"]
        assert [len(a["output_ids"]) for a in answers] == [2, 3, 4]
        assert [a["meta_info"]["prompt_tokens"] for a in answers] == [2, 1, 3]

    _serve(model, tokenizer, scenario)


def test_http_stream_sends_sse_chunks_then_done(model, tokenizer):
    async def scenario(client: TestClient) -> None:
        body = {"input_ids": [5, 6], "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        response = await client.post("/generate", json=body)
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in (await response.text()).split("\n\n") if line]
        assert all(event.startswith("data: ") for event in events) and events[-1] == "data: [DONE]"
        chunks = [orjson.loads(event[len("data: "):]) for event in events[:-1]]
        assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]  # cumulative, one per token
        assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 3
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}

    _serve(model, tokenizer, scenario)


def test_http_error_and_control_bodies_are_sglangs(model, tokenizer):
    async def scenario(client: TestClient) -> None:
        missing = await client.get("/no_such_endpoint")
        assert missing.status == 404 and await missing.json() == {"detail": "Not Found"}
        wrong_method = await client.get("/generate")
        assert wrong_method.status == 405 and await wrong_method.json() == {"detail": "Method Not Allowed"}
        over = await client.post("/generate", json={"input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 10}})
        assert over.status == 400 and "maximum context length" in (await over.json())["error"]["message"]
        paused = await client.post("/pause_generation", json={"mode": "abort"})
        assert await paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        bad_mode = await client.post("/pause_generation", json={"mode": "sideways"})
        assert bad_mode.status == 400 and (await bad_mode.json())["object"] == "error"
        resumed = await client.post("/continue_generation", json={})
        assert await resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}

        # Paused, the request cannot finish on its own (a fixed sleep before the abort raced a fast engine):
        # abort until its answer comes back, then continue.
        await client.post("/pause_generation", json={"mode": "retract"})
        body = {"rid": "long", "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        pending = asyncio.ensure_future(client.post("/generate", json=body))
        while not pending.done():
            await client.post("/abort_request", json={"rid": "long"})
            await asyncio.wait({pending}, timeout=0.05)
        aborted = await pending.result().json()
        await client.post("/continue_generation", json={})
        assert aborted["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                         "err_type": None}

    _serve(model, tokenizer, scenario)


def test_the_rollout_client_clips_max_new_tokens_to_the_context(tmp_path):
    """SGLang answers 400 to prompt + max_new_tokens over the context; the client asks for what fits."""
    from hpc_rl.rollout.engine_client import clip_to_context, engine_context_length

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 64}')
    context = engine_context_length(tmp_path)
    assert context == 64 and engine_context_length(tmp_path, {"context_length": 32}) == 32
    payload = {"rid": "r", "input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 10, "temperature": 1.0}}
    clipped = clip_to_context(payload, context)
    assert clipped["sampling_params"] == {"max_new_tokens": 4, "temperature": 1.0}
    assert payload["sampling_params"]["max_new_tokens"] == 10  # the caller's payload is left alone
    assert clip_to_context({**payload, "input_ids": [1] * 10}, context)["sampling_params"]["max_new_tokens"] == 10


def test_a_sample_that_filled_the_context_ends_as_length_without_a_request(model, tokenizer):
    """SGLang refuses prompts of context - 6 tokens or more with a 400; the client answers them itself as a
    length finish (slime truncates such samples), and what it still sends is served."""
    from hpc_rl.rollout.engine_client import EngineClient, StaticEngineDirectory

    async def scenario(client: TestClient) -> None:
        url = str(client.make_url("")).rstrip("/")
        async with EngineClient(StaticEngineDirectory([url]), context_length=256) as engine:
            served = await engine.generate({"rid": "a", "input_ids": [5] * 249,
                                            "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}})
            assert served.engine_url == url and len(served.body["output_ids"]) == 256 - 2 - 249
            full = await engine.generate({"rid": "b", "input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 5}})
            assert full.engine_url is None and full.body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        refused = await client.post("/generate", json={"input_ids": [5] * 250, "sampling_params": {"max_new_tokens": 5}})
        assert refused.status == 400  # what the client avoided

    _serve(model, tokenizer, scenario)
