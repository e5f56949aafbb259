"""Answers parsed in worker processes (rollout/answer_pool.py): compact arrays, same samples as the loop's parse."""

from __future__ import annotations

import asyncio
from array import array

import orjson
import pytest

from hpc_rl.data.samples import Sample
from hpc_rl.rollout.answer_pool import AnswerNotJSON, AnswerPool, compact_answers
from hpc_rl.rollout.engine_client import EngineClient, StaticEngineDirectory, TransportError
from hpc_rl.rollout.generate import GenerationSession, generate_turn
from tests.unit.test_rollout_fake_engine import FakeSglangEngine


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


def test_pool_parses_in_a_worker_and_reports_bad_bodies() -> None:
    async def body() -> None:
        pool = AnswerPool(1, inline_below=0)
        try:
            await pool.start()
            parsed = await pool.parse(orjson.dumps(answer([9, 8], [-1.0, -2.0])))
            assert parsed["output_ids"].tolist() == [9, 8] and pool.parsed_in_workers == 1
            with pytest.raises(AnswerNotJSON):
                await pool.parse(b"not json")
        finally:
            pool.close()
        inline = AnswerPool(1)  # small bodies never reach a worker (none is started)
        assert (await inline.parse(orjson.dumps(answer([1], [-1.0]))))["output_ids"].tolist() == [1]
        assert inline.parsed_in_workers == 0 and inline._workers._executor is None

    asyncio.run(body())


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
                return list(done)
        finally:
            await engine.stop()

    return asyncio.run(body())


def test_samples_from_workers_equal_samples_parsed_on_the_loop() -> None:
    pool = AnswerPool(1, inline_below=0)
    in_workers = generate_all(pool)
    on_loop = generate_all(None)
    assert pool.parsed_in_workers >= 2  # the batch and the resume went through the worker
    def fields(samples: list[Sample]) -> list[dict[str, object]]:
        return [{k: v for k, v in s.to_dict().items() if k != "rid"} for s in samples]  # rids are random

    assert fields(in_workers) == fields(on_loop)
    for sample in in_workers:  # plain lists on the sample, as everything downstream expects
        assert type(sample.response_token_ids) is list and type(sample.response_logprobs) is list
    assert in_workers[-1].weight_versions == [0, 1, 1, 1]


def test_client_names_an_engine_body_that_is_not_json_as_a_transport_error() -> None:
    async def body() -> None:
        client = EngineClient(StaticEngineDirectory([]), answer_pool=AnswerPool(1))

        class Answers:
            async def request(self, *args: object) -> tuple[int, bytes]:
                return 200, b"{not json"

        client._connections = type("FakeConnections", (), {"to": lambda self, url: Answers()})()
        with pytest.raises(TransportError, match="not JSON"):
            await client._post_generate("http://engine:1", {"rid": "r"})

    asyncio.run(body())
