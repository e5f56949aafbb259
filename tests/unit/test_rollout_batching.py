"""Request batching: the pure planning (request_batching.py) and samples sharing batched /generate requests
against FakeSglangEngine (one request per moment, per-sample answers, retries, aborts, fallback)."""

from __future__ import annotations

import asyncio

import orjson

import pytest

from hpc_rl.data.samples import Sample, SampleStatus
from hpc_rl.rollout.engine_client import EngineClient, StaticEngineDirectory
from hpc_rl.rollout.generate import GenerationSession, RetryPolicy, generate_turn
from hpc_rl.rollout.request_batching import (
    BatchAnswerError,
    batchable,
    merge_payloads,
    plan_batches,
    split_answer,
)
from tests.unit.test_rollout_fake_engine import FakeSglangEngine
from tests.unit.test_rollout_generate import accounted
from tests.unit.waiting import wait_until

FAST_RETRY = RetryPolicy(max_transport_retries=3, base_delay_s=0.01, max_delay_s=0.05)


def sample(index: int, group: int, prompt_len: int = 2) -> Sample:
    return Sample(index=index, group_index=group, prompt="p", prompt_token_ids=list(range(10, 10 + prompt_len)))


# -- pure planning ---------------------------------------------------------------------------------------
def test_plan_batches_one_per_engine_whole_groups_within_the_cap() -> None:
    items = list(range(32))
    groups = [i // 8 for i in items]  # 4 groups of 8
    assert plan_batches(items, groups, engines=1, max_batch=256) == [items]
    assert plan_batches(items, groups, engines=2, max_batch=256) == [items[:16], items[16:]]
    assert plan_batches(items, groups, engines=3, max_batch=256) == [items[:8], items[8:16], items[16:24],
                                                                     items[24:]]  # groups stay whole
    assert [len(b) for b in plan_batches(items, groups, engines=1, max_batch=12)] == [8, 8, 8, 8]
    assert [len(b) for b in plan_batches(items[:8], groups[:8], engines=1, max_batch=3)] == [3, 3, 2]
    # groups interleaved in arrival order are gathered, in the order of their first item
    assert plan_batches([0, 1, 2, 3], [5, 6, 5, 6], engines=2, max_batch=8) == [[0, 2], [1, 3]]
    assert plan_batches([], [], engines=1, max_batch=8) == []


def test_merge_and_split() -> None:
    a = {"rid": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    b = {"rid": "b", "input_ids": [3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}
    merged = merge_payloads([a, b])
    assert merged == {"rid": ["a", "b"], "input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 4},
                      "return_logprob": True}
    resumed = {**b, "sampling_params": {"max_new_tokens": 2}}
    assert merge_payloads([a, resumed])["sampling_params"] == [{"max_new_tokens": 4}, {"max_new_tokens": 2}]
    assert batchable(a) and not batchable({**a, "stream": True}) and not batchable({**a, "input_ids": [[1]]})
    assert not batchable({"rid": "t", "text": "hi"})
    answers = [{"meta_info": {"id": "b"}, "output_ids": [2]}, {"meta_info": {"id": "a"}, "output_ids": [1]}]
    assert [x["output_ids"] for x in split_answer(answers, ["a", "b"])] == [[1], [2]]  # by id
    assert split_answer([{"output_ids": [1]}, {"output_ids": [2]}], ["a", "b"])[1] == {"output_ids": [2]}
    with pytest.raises(BatchAnswerError, match="batch of 2 requests was answered with dict"):
        split_answer({"output_ids": [1]}, ["a", "b"])


# -- samples over a fake engine ----------------------------------------------------------------------------
async def run_with_engine(body, *, engines: int = 1, **engine_kwargs) -> None:
    fakes = [await FakeSglangEngine(**engine_kwargs).start() for _ in range(engines)]
    client = EngineClient(StaticEngineDirectory([f.url for f in fakes]), router_url=fakes[0].url,
                          per_engine_concurrency=64)
    try:
        async with client:
            await body(fakes, client)
    finally:
        for fake in fakes:
            await fake.stop()


def test_samples_sent_together_share_one_request_and_keep_their_own_answers() -> None:
    """16 samples of 2 groups with different natural lengths: one HTTP request (across groups), each
    sample its own tokens, finish reason and weight versions."""

    async def body(fakes: list[FakeSglangEngine], client: EngineClient) -> None:
        samples = [sample(i, i // 8, prompt_len=2 + i % 5) for i in range(16)]
        session = GenerationSession(client, weight_version=0, batch_across_groups=True)
        fakes[0].set_weight_version(7)
        await asyncio.gather(*(generate_turn(s, {"max_new_tokens": 4}, session=session) for s in samples))
        assert fakes[0].requests_seen == 1 and fakes[0].batch_sizes == [16]
        for s in samples:
            natural = len(s.prompt_token_ids)  # the fake stops after len(input_ids) tokens
            assert s.response_length == min(natural, 4)
            assert s.status is (SampleStatus.COMPLETED if natural <= 4 else SampleStatus.TRUNCATED)
            assert s.response_token_ids == [(len(s.prompt_token_ids) + k) % 50 + 100 for k in range(s.response_length)]
            assert s.weight_versions == [7] * s.response_length
        assert len(set(fakes[0].rids_seen)) == 16 and accounted(session)
        # Per group: one request per group.
        per_group = GenerationSession(client)
        more = [sample(100 + i, 10 + i // 8) for i in range(24)]
        await asyncio.gather(*(generate_turn(s, {"max_new_tokens": 4}, session=per_group) for s in more))
        assert fakes[0].batch_sizes[1:] == [8, 8, 8] and accounted(per_group)

    asyncio.run(run_with_engine(body, natural_length=len))


def test_a_failed_batch_is_retried_per_sample_nothing_lost_or_doubled() -> None:
    async def body(fakes: list[FakeSglangEngine], client: EngineClient) -> None:
        fakes[0].fail_next = 1  # the first batch answers 500
        samples = [sample(i, 0) for i in range(8)]
        session = GenerationSession(client, retry=FAST_RETRY)
        await asyncio.gather(*(generate_turn(s, {"max_new_tokens": 10}, session=session) for s in samples))
        assert all(s.status is SampleStatus.COMPLETED and s.response_length == 3 for s in samples)
        assert session.metrics.requests_transport_failed == 8 and session.metrics.requests_retried == 8
        assert session.metrics.requests_finished == 8 and accounted(session)
        assert len(fakes[0].rids_seen) == 16 and len(set(fakes[0].rids_seen)) == 16  # fresh rid per attempt

    asyncio.run(run_with_engine(body, natural_length=lambda ids: 3))


def test_stop_aborts_a_running_batch_each_sample_keeps_its_partial_tokens() -> None:
    async def body(fakes: list[FakeSglangEngine], client: EngineClient) -> None:
        samples = [sample(i, 0) for i in range(8)]
        session = GenerationSession(client)
        tasks = [asyncio.create_task(generate_turn(s, {"max_new_tokens": 10_000}, session=session))
                 for s in samples]
        await wait_until(lambda: all(fakes[0].tokens_made.get(s.rid, 0) > 0 for s in samples),
                         what="a first token of every sample")
        assert await session.stop(timeout_s=5)
        await asyncio.gather(*tasks)
        assert all(s.status is SampleStatus.ABORTED and 0 < s.response_length < 10_000 for s in samples)
        assert session.metrics.requests_aborted == 8 and accounted(session)
        assert fakes[0].requests_seen == 1

    asyncio.run(run_with_engine(body, token_latency_s=0.005, natural_length=lambda ids: 10_000))


def test_abort_of_one_rid_in_a_batch_resumes_only_that_sample() -> None:
    """An abort the session did not ask for (one rid): that sample resumes, the others are untouched."""

    async def body(fakes: list[FakeSglangEngine], client: EngineClient) -> None:
        samples = [sample(i, 0) for i in range(4)]
        session = GenerationSession(client, retry=FAST_RETRY)
        tasks = [asyncio.create_task(generate_turn(s, {"max_new_tokens": 30}, session=session)) for s in samples]
        await wait_until(lambda: all(fakes[0].tokens_made.get(s.rid, 0) > 0 for s in samples),
                         what="a first token of every sample")
        victim = samples[2].rid
        status, _ = await client.connections.to(fakes[0].url).request(
            "POST", "/abort_request", orjson.dumps({"rid": victim}), 10.0)
        assert status == 200
        await asyncio.gather(*tasks)
        assert all(s.status is SampleStatus.TRUNCATED and s.response_length == 30 for s in samples)
        assert session.metrics.requests_resumed == 1 and session.metrics.requests_aborted == 1
        assert samples[2].rid != victim and accounted(session)

    asyncio.run(run_with_engine(body, token_latency_s=0.005, natural_length=lambda ids: 10_000))


def test_an_engine_that_answers_a_batch_with_one_answer_turns_batching_off() -> None:
    async def body(fakes: list[FakeSglangEngine], client: EngineClient) -> None:
        fakes[0].fail_next = 1
        fakes[0].fail_with = (200, {"text": "", "output_ids": [], "meta_info": {}})  # not one answer per item
        samples = [sample(i, 0) for i in range(4)]
        session = GenerationSession(client, retry=FAST_RETRY)
        await asyncio.gather(*(generate_turn(s, {"max_new_tokens": 10}, session=session) for s in samples))
        assert all(s.status is SampleStatus.COMPLETED and s.response_length == 3 for s in samples)
        assert client.batch_requests is False and fakes[0].requests_seen == 5 and accounted(session)

    asyncio.run(run_with_engine(body, natural_length=lambda ids: 3))


def test_batches_go_to_the_least_loaded_engine_and_aborts_to_that_engine() -> None:
    async def body(fakes: list[FakeSglangEngine], client: EngineClient) -> None:
        samples = [sample(i, i // 8) for i in range(16)]
        session = GenerationSession(client, batch_across_groups=True)
        tasks = [asyncio.create_task(generate_turn(s, {"max_new_tokens": 10_000}, session=session))
                 for s in samples]
        while sum(len(f.running) for f in fakes) < 16:
            await asyncio.sleep(0.01)
        assert [f.batch_sizes for f in fakes] == [[8], [8]]  # one batch per engine, groups whole
        engine_of = {s.rid: client.in_flight[s.rid] for s in samples}
        assert {engine_of[s.rid] for s in samples[:8]} != {engine_of[s.rid] for s in samples[8:]}
        assert await session.stop(timeout_s=5)
        await asyncio.gather(*tasks)
        assert accounted(session)

    asyncio.run(run_with_engine(body, engines=2, token_latency_s=0.005, natural_length=lambda ids: 10_000))
