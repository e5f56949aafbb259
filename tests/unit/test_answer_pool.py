"""/generate exchanged and parsed in worker processes (rollout/answer_pool.py, answer_workers.py): compact arrays,
the same samples and the same errors as the loop's own exchange, a dead worker replaced."""

from __future__ import annotations

import asyncio
import os
import signal
from array import array

import orjson
import pytest

from hpc_rl.data.samples import Sample
from hpc_rl.rollout.answer_pool import AnswerPool
from hpc_rl.rollout.answer_workers import PREFIX, compact_answers, encode_frame, join_arrays, split_arrays
from hpc_rl.rollout.engine_client import EngineClient, EngineHTTPError, StaticEngineDirectory, TransportError
from hpc_rl.rollout.generate import GenerationSession, generate_turn
from tests.unit.test_rollout_fake_engine import FakeSglangEngine
from tests.unit.waiting import wait_until


def answer(ids: list[int], logprobs: list[object]) -> dict[str, object]:
    return {"text": "x", "output_ids": ids,
            "meta_info": {"id": "r", "finish_reason": {"type": "stop"}, "weight_version": "2",
                          "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids)]}}


def test_compact_answers_turns_token_lists_into_arrays_of_the_same_numbers() -> None:
    ok, body = compact_answers(orjson.dumps(answer([5, 6, 7], [-0.25, 0, -1.5e-9])))
    assert ok
    assert isinstance(body["output_ids"], array) and body["output_ids"].tolist() == [5, 6, 7]
    logprobs = body["meta_info"]["output_token_logprobs"]
    assert isinstance(logprobs, array) and logprobs.tolist() == [-0.25, 0.0, -1.5e-9]
    assert body["meta_info"]["weight_version"] == "2" and body["text"] == "x"


def test_compact_answers_compacts_each_answer_of_a_batch_and_keeps_malformed_lists() -> None:
    ok, body = compact_answers(orjson.dumps([answer([1], [-0.5]), answer([2, 3], [None, -0.5])]))
    assert ok and isinstance(body, list)
    assert body[0]["meta_info"]["output_token_logprobs"].tolist() == [-0.5]
    # a None log-prob is not a number: the list stays, for generate.output_logprobs to read as before
    assert body[1]["meta_info"]["output_token_logprobs"] == [[None, 2, None], [-0.5, 3, None]]
    assert body[1]["output_ids"].tolist() == [2, 3]


def test_compact_answers_reports_a_body_that_is_not_json() -> None:
    ok, message = compact_answers(b"<html>bad gateway</html>")
    assert not ok and isinstance(message, str) and message


def test_answers_split_into_json_and_arrays_join_back_equal() -> None:
    ok, body = compact_answers(orjson.dumps([answer([1, 2], [-0.5, -1.0]), answer([3], [None]), {"odd": 1}]))
    expected = orjson.loads(orjson.dumps([answer([1, 2], [-0.5, -1.0]), answer([3], [None]), {"odd": 1}]))
    stripped, specs, buffers = split_arrays(body)
    header = orjson.loads(b"".join(bytes(part) for part in encode_frame({"body": stripped}))[PREFIX.size:])
    joined = join_arrays(header["body"], specs, b"".join(bytes(memoryview(b)) for b in buffers))
    assert joined[0]["output_ids"].tolist() == [1, 2]
    assert joined[0]["meta_info"]["output_token_logprobs"].tolist() == [-0.5, -1.0]
    assert joined[1]["meta_info"]["output_token_logprobs"] == expected[1]["meta_info"]["output_token_logprobs"]
    assert joined[1]["output_ids"].tolist() == [3] and joined[2] == {"odd": 1}


def test_pool_rejects_zero_workers() -> None:
    with pytest.raises(ValueError, match="answer_parse_workers"):
        AnswerPool(0)


def generate_all(pool: AnswerPool | None) -> list[Sample]:
    """Samples of a group of 4 (one batched request) and a resumed one, through a real client."""
    async def body() -> list[Sample]:
        engine = await FakeSglangEngine(natural_length=lambda ids: 6).start()
        client = EngineClient(StaticEngineDirectory([engine.url]), router_url=None, answer_pool=pool)
        try:
            async with client:
                session = GenerationSession(client, weight_version=0)
                group = [Sample(index=i, group_index=0, prompt="p", prompt_token_ids=[10 + i, 11]) for i in range(4)]
                done = await asyncio.gather(*(generate_turn(s, {"max_new_tokens": 8}, session=session) for s in group))
                partial = Sample(index=9, group_index=1, prompt="p", prompt_token_ids=[3],
                                 response_token_ids=[7], response_logprobs=[-1.0], weight_versions=[0])
                engine.set_weight_version(1)
                done.append(await generate_turn(partial, {"max_new_tokens": 4}, session=session))
                assert set(client.answered_at) == {engine.url}  # proof of life for the fleet's health checks
                return list(done)
        finally:
            await engine.stop()

    return asyncio.run(body())


def test_samples_from_workers_equal_samples_parsed_on_the_loop() -> None:
    pool = AnswerPool(1)
    in_workers = generate_all(pool)
    on_loop = generate_all(None)
    assert pool.parsed_in_workers >= 2  # the batch and the resume went through the worker
    def fields(samples: list[Sample]) -> list[dict[str, object]]:
        return [{k: v for k, v in s.to_dict().items() if k != "rid"} for s in samples]  # rids are random

    assert fields(in_workers) == fields(on_loop)
    for sample in in_workers:  # plain lists on the sample, as everything downstream expects
        assert type(sample.response_token_ids) is list and type(sample.response_logprobs) is list
    assert in_workers[-1].weight_versions == [0, 1, 1, 1]


class OddEngine:
    """A fake engine (aiohttp) whose /generate answers what the test path names: not JSON, a 400, a 503, or
    nothing for a while."""

    async def start(self) -> "OddEngine":
        from aiohttp import web

        self.release = asyncio.Event()  # set by stop(): a "slow" request ends then (the server's cleanup waits for it)
        self.slow_seen = 0  # "slow" requests received: a test waits for one to be held, not for a fixed time

        async def generate(request: web.Request) -> web.Response:
            kind = (await request.json())["rid"]
            if kind == "slow":
                self.slow_seen += 1
                try:
                    await asyncio.wait_for(self.release.wait(), 30)
                except asyncio.TimeoutError:
                    pass
            if kind == "not-json":
                return web.Response(body=b"{not json", content_type="application/json")
            if kind == "bad":
                return web.json_response({"error": "temperature must be >= 0"}, status=400)
            return web.Response(text="overloaded", status=503)

        app = web.Application()
        app.router.add_post("/generate", generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        self.release.set()
        await self.runner.cleanup()


def outcome(client: EngineClient, base: str, rid: str) -> str:
    async def post() -> str:
        try:
            await client._post_generate(base, {"rid": rid})
        except (TransportError, EngineHTTPError) as error:
            return f"{type(error).__name__}: {error}"
        return "answered"
    return post()  # type: ignore[return-value]


def test_workers_raise_what_the_loop_raises() -> None:
    async def body() -> list[list[str]]:
        engine = await OddEngine().start()
        results = []
        try:
            for pool in (None, AnswerPool(1)):
                async with EngineClient(StaticEngineDirectory([engine.url]), answer_pool=pool) as client:
                    results.append([await outcome(client, engine.url, rid) for rid in ("not-json", "bad", "busy")]
                                   + [await outcome(client, "http://127.0.0.1:9", "x")])  # nothing listens
        finally:
            await engine.stop()
        return results

    on_loop, in_workers = asyncio.run(body())
    assert in_workers == on_loop
    assert "not JSON" in on_loop[0] and on_loop[1].startswith("EngineHTTPError") and "temperature" in on_loop[1]
    assert "HTTP 503" in on_loop[2] and on_loop[3].startswith("TransportError")


def test_a_killed_worker_fails_its_requests_as_transport_errors_and_is_replaced() -> None:
    async def body() -> None:
        engine = await FakeSglangEngine(natural_length=lambda ids: 3).start()
        slow = await OddEngine().start()
        pool = AnswerPool(1)
        try:
            async with EngineClient(StaticEngineDirectory([engine.url]), answer_pool=pool) as client:
                waiting = asyncio.ensure_future(client._post_generate(slow.url, {"rid": "slow"}))
                await wait_until(lambda: slow.slow_seen == 1, what="the slow request held by the worker")
                [pid] = pool.pids()
                os.kill(pid, signal.SIGKILL)
                with pytest.raises(TransportError, match="answer worker"):
                    await asyncio.wait_for(waiting, 20)
                answer = await client._post_generate(engine.url, {"rid": "r1", "input_ids": [1, 2],
                                                                  "sampling_params": {"max_new_tokens": 3}})
                assert answer["output_ids"].tolist() and pool.restarts == 1 and pool.pids() != [pid]
        finally:
            await slow.stop()
            await engine.stop()

    asyncio.run(body())


def test_a_cancelled_request_leaves_the_worker_serving() -> None:
    async def body() -> None:
        engine = await FakeSglangEngine(natural_length=lambda ids: 3).start()
        slow = await OddEngine().start()
        try:
            async with EngineClient(StaticEngineDirectory([engine.url]), answer_pool=AnswerPool(1)) as client:
                waiting = asyncio.ensure_future(client._post_generate(slow.url, {"rid": "slow"}))
                await wait_until(lambda: slow.slow_seen == 1, what="the slow request held by the worker")
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                answer = await client._post_generate(engine.url, {"rid": "r1", "input_ids": [1, 2],
                                                                  "sampling_params": {"max_new_tokens": 3}})
                assert len(answer["output_ids"]) == 3 and client.answer_pool.restarts == 0
        finally:
            await slow.stop()
            await engine.stop()

    asyncio.run(body())


def test_aborts_go_out_through_the_worker_that_holds_the_engines_connections() -> None:
    async def body() -> None:
        engine = await FakeSglangEngine(natural_length=lambda ids: 3).start()
        try:
            async with EngineClient(StaticEngineDirectory([engine.url]), answer_pool=AnswerPool(1)) as client:
                assert await client.abort_all() == 1  # the engine said 200
                await client.abort("no-such-rid")
                assert not client.connections._connections  # the controller opened no connection of its own
        finally:
            await engine.stop()

    asyncio.run(body())
