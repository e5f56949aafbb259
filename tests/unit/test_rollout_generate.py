"""Generation against FakeSglangEngine: resume, weight versions, retries, aborts, concurrency, custom fns."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from hpc_rl.data.samples import Sample, SampleStatus
from hpc_rl.plugins import PluginError
from hpc_rl.rollout.engine_client import EngineClient, StaticEngineDirectory
from hpc_rl.rollout.generate import (
    GenerationSession,
    NoWorkersAvailable,
    RequestRejected,
    RetryPolicy,
    append_tool_tokens,
    generate_group,
    generate_turn,
    load_generate_function,
    parse_weight_versions,
    run_generate,
)
from tests.unit.test_rollout_fake_engine import FakeSglangEngine
from tests.unit.waiting import wait_until

FAST_RETRY = RetryPolicy(max_transport_retries=3, base_delay_s=0.01, max_delay_s=0.05)


def make_sample(index: int = 0, prompt: list[int] | None = None) -> Sample:
    return Sample(index=index, group_index=0, prompt="p", prompt_token_ids=prompt or [10, 11])


async def with_engines(n: int, body: Callable[..., Awaitable[None]], *, router: bool = True,
                       concurrency: int = 64, **engine_kwargs: Any) -> None:
    engines = [await FakeSglangEngine(**engine_kwargs).start() for _ in range(n)]
    directory = StaticEngineDirectory([e.url for e in engines])
    client = EngineClient(directory, router_url=engines[0].url if router else None,
                          per_engine_concurrency=concurrency)
    try:
        async with client:
            await body(engines, client)
    finally:
        for engine in engines:
            await engine.stop()


def accounted(session: GenerationSession) -> bool:
    m = session.metrics
    return not session.in_flight and m.requests_sent == (
        m.requests_finished + m.requests_aborted + m.requests_transport_failed + m.requests_http_failed)


def test_parse_weight_versions() -> None:
    meta = {"weight_version": "3", "weight_versions": [{"version": "2", "start": 0, "end": 2},
                                                       {"version": "3", "start": 2, "end": 4}]}
    assert parse_weight_versions(meta, 5, fallback=9) == [2, 2, 3, 3, 3]
    assert parse_weight_versions({"weight_version": "default"}, 2, fallback=7) == [7, 7]
    assert parse_weight_versions({}, 1, fallback=0) == [0]


def test_generate_completes_truncates_and_resumes() -> None:
    async def body(engines: list[FakeSglangEngine], client: EngineClient) -> None:
        session = GenerationSession(client, weight_version=0)
        done = await generate_turn(make_sample(0), {"max_new_tokens": 10}, session=session)
        assert done.status is SampleStatus.COMPLETED and done.response_length == 4
        assert done.response_logprobs == [-0.5] * 4 and done.weight_versions == [0] * 4
        cut = await generate_turn(make_sample(1), {"max_new_tokens": 3}, session=session)
        assert cut.status is SampleStatus.TRUNCATED and cut.response_length == 3
        # Resume: prompt + 2 old tokens go out, max_new_tokens reduced by 2; old tokens keep version 0.
        partial = make_sample(2)
        partial.response_token_ids, partial.response_logprobs, partial.weight_versions = [7, 8], [-1.0, -1.0], [0, 0]
        engines[0].set_weight_version(1)
        resumed = await generate_turn(partial, {"max_new_tokens": 5}, session=session)
        assert resumed.response_token_ids[:2] == [7, 8] and resumed.response_length == 5
        assert resumed.weight_versions == [0, 0, 1, 1, 1] and resumed.status is SampleStatus.TRUNCATED
        assert resumed.response_token_ids[2] == (4 % 50) + 100  # the engine saw 4 input tokens
        # Context cap: prompt 2 + response budget limited to 3 by max_context_len 5.
        capped_session = GenerationSession(client, max_context_len=5)
        capped = await generate_turn(make_sample(3), {"max_new_tokens": 10}, session=capped_session)
        assert capped.response_length == 3 and capped.status is SampleStatus.TRUNCATED
        assert accounted(session) and accounted(capped_session)

    asyncio.run(with_engines(1, body, natural_length=lambda ids: 4))


def test_transport_failures_are_retried_then_fail() -> None:
    async def body(engines: list[FakeSglangEngine], client: EngineClient) -> None:
        session = GenerationSession(client, retry=FAST_RETRY)
        engines[0].fail_next = 2
        ok = await generate_turn(make_sample(0), {"max_new_tokens": 10}, session=session)
        assert ok.status is SampleStatus.COMPLETED and ok.response_length == 4
        assert session.metrics.requests_retried == 2 and session.metrics.requests_transport_failed == 2
        engines[0].fail_next = 100
        bad = await generate_turn(make_sample(1), {"max_new_tokens": 10}, session=session)
        assert bad.status is SampleStatus.FAILED and "500" in bad.metadata["error"]
        assert session.metrics.requests_transport_failed == 2 + FAST_RETRY.max_transport_retries + 1
        assert accounted(session)

    asyncio.run(with_engines(1, body))


def test_dead_engine_is_avoided_and_tokens_are_kept() -> None:
    """Direct mode, two engines; one dies mid-request: the sample finishes on the other."""

    async def body(engines: list[FakeSglangEngine], client: EngineClient) -> None:
        session = GenerationSession(client, retry=FAST_RETRY)
        sample = make_sample(0)
        sample.response_token_ids, sample.response_logprobs, sample.weight_versions = [5], [-1.0], [0]
        task = asyncio.create_task(generate_turn(sample, {"max_new_tokens": 30}, session=session))
        await wait_until(lambda: any(e.running for e in engines), what="the request on an engine")
        victim = next(e for e in engines if e.running)
        await victim.stop()
        done = await task
        assert done.status is SampleStatus.COMPLETED and done.response_token_ids[0] == 5
        assert session.metrics.requests_retried >= 1 and accounted(session)

    asyncio.run(with_engines(2, body, router=False, token_latency_s=0.01, natural_length=lambda ids: 20))


def test_unrequested_abort_resumes_with_new_version() -> None:
    """A pause(abort) for a weight update: the sample resumes, old tokens keep their version."""

    async def body(engines: list[FakeSglangEngine], client: EngineClient) -> None:
        session = GenerationSession(client, retry=FAST_RETRY)
        engine = engines[0]
        engine.set_weight_version(0)
        task = asyncio.create_task(generate_turn(make_sample(0), {"max_new_tokens": 100}, session=session))
        await wait_until(lambda: sum(engine.tokens_made.values()) > 0, what="a first token at version 0")
        await client.connections.to(engine.url).request("POST", "/pause_generation", b'{"mode": "abort"}', 10)
        engine.set_weight_version(1)
        await asyncio.sleep(0.05)
        await client.connections.to(engine.url).request("POST", "/continue_generation", b"{}", 10)
        done = await task
        assert done.status is SampleStatus.COMPLETED and done.response_length == 30
        assert done.weight_versions[0] == 0 and done.weight_versions[-1] == 1
        assert done.weight_versions == sorted(done.weight_versions)
        assert session.metrics.requests_resumed >= 1 and session.metrics.requests_aborted >= 1 and accounted(session)

    def total_30(ids: list[int]) -> int:
        return 30 - (len(ids) - 2)

    asyncio.run(with_engines(1, body, token_latency_s=0.005, natural_length=total_30))


def test_a_group_shares_one_batched_call_and_each_sample_retries_and_resumes_alone() -> None:
    """generate_group (the built-in function's path): one batched request for the group's first call; a failed
    batch is retried per sample (each on its own, counted per sample), an abort no one asked for resumes the sample
    with the engine's new version, a sample without budget is TRUNCATED without a request; the session's accounts
    add up and nothing stays in flight."""

    async def body(engines: list[FakeSglangEngine], client: EngineClient) -> None:
        engine = engines[0]
        session = GenerationSession(client, retry=FAST_RETRY)
        group = [make_sample(i) for i in range(4)]
        await generate_group(group, {"max_new_tokens": 10}, session)
        assert [s.status for s in group] == [SampleStatus.COMPLETED] * 4
        assert engine.requests_seen == 1 and engine.batch_sizes == [4]  # one request for the group
        assert all(s.response_length == 4 for s in group) and accounted(session)

        engine.fail_next = 1  # the group's batch fails: each sample retries alone
        retried = [make_sample(10 + i) for i in range(3)]
        await generate_group(retried, {"max_new_tokens": 10}, session)
        assert [s.status for s in retried] == [SampleStatus.COMPLETED] * 3
        assert session.metrics.requests_retried == 3 and session.metrics.requests_transport_failed == 3
        assert engine.requests_seen == 3 and accounted(session)  # the failed batch, then the retries (together again)

        long = [make_sample(20 + i) for i in range(2)]
        full = make_sample(30)
        full.response_token_ids, full.response_logprobs, full.weight_versions = [5] * 10, [-1.0] * 10, [0] * 10
        engine.set_weight_version(0)
        engine.natural_length = lambda ids: 30  # longer than the budget: still running at the pause
        task = asyncio.create_task(generate_group([*long, full], {"max_new_tokens": 10}, session))
        await wait_until(lambda: all(engine.tokens_made.get(s.rid, 0) > 0 for s in long),
                         what="a first token of each long sample at version 0")
        await client.connections.to(engine.url).request("POST", "/pause_generation", b'{"mode": "abort"}', 10)
        engine.set_weight_version(1)
        await client.connections.to(engine.url).request("POST", "/continue_generation", b"{}", 10)
        await task
        assert full.status is SampleStatus.TRUNCATED and full.response_length == 10  # no budget: no request
        assert [s.status for s in long] == [SampleStatus.TRUNCATED] * 2
        assert all(s.weight_versions[0] == 0 and s.weight_versions[-1] == 1 for s in long)
        assert session.metrics.requests_resumed == 2 and accounted(session)

    asyncio.run(with_engines(1, body, router=False, token_latency_s=0.005, natural_length=lambda ids: 4))


def test_stop_aborts_in_flight_and_queued() -> None:
    async def body(engines: list[FakeSglangEngine], client: EngineClient) -> None:
        session = GenerationSession(client)
        samples = [make_sample(i) for i in range(6)]
        tasks = [asyncio.create_task(generate_turn(s, {"max_new_tokens": 1000}, session=session)) for s in samples]
        await wait_until(lambda: sum(n > 0 for n in engines[0].tokens_made.values()) == 2,
                         what="tokens from the two requests the limit lets run")
        assert engines[0].max_running <= 2  # concurrency limit: 2 per engine, 1 engine
        assert await session.stop(timeout_s=5)
        await asyncio.gather(*tasks)
        assert all(s.status is SampleStatus.ABORTED for s in samples)
        assert sum(s.response_length > 0 for s in samples) == 2  # only the two that ran have tokens
        assert accounted(session) and session.metrics.requests_sent == 2

    asyncio.run(with_engines(1, body, concurrency=2, token_latency_s=0.005, natural_length=lambda ids: 10_000))


async def tool_generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    await generate_turn(sample, {**sampling_params, "max_new_tokens": 2})
    append_tool_tokens(sample, [42, 43], " tool")
    await generate_turn(sample, sampling_params)
    return sample


async def broken_generate(args: Any, sample: Sample, sampling_params: dict) -> Sample:
    raise KeyError("boom")


def test_custom_generate_function_by_path() -> None:
    module = types.ModuleType("rollout_test_plugins")
    module.tool_generate = tool_generate  # type: ignore[attr-defined]
    module.broken_generate = broken_generate  # type: ignore[attr-defined]
    module.sync_generate = lambda args, sample, sampling_params: sample  # type: ignore[attr-defined]
    sys.modules["rollout_test_plugins"] = module
    fn = load_generate_function("rollout_test_plugins.tool_generate")
    broken = load_generate_function("rollout_test_plugins.broken_generate")
    with pytest.raises(PluginError):
        load_generate_function("rollout_test_plugins.sync_generate")

    async def body(engines: list[FakeSglangEngine], client: EngineClient) -> None:
        session = GenerationSession(client, weight_version=3)
        sample = await run_generate(fn, None, make_sample(0), {"max_new_tokens": 8}, session)
        assert sample.status is SampleStatus.TRUNCATED and sample.response_length == 8
        assert sample.response_token_ids[2:4] == [42, 43]
        assert sample.loss_mask == [1, 1, 0, 0, 1, 1, 1, 1]
        assert sample.response_logprobs[2:4] == [0.0, 0.0] and sample.weight_versions[2:4] == [3, 3]
        failed = await run_generate(broken, None, make_sample(1), {"max_new_tokens": 8}, session)
        assert failed.status is SampleStatus.FAILED and "boom" in failed.metadata["error"]

    asyncio.run(with_engines(1, body, natural_length=lambda ids: 100))


def test_an_invalid_request_ends_the_run_with_the_engines_message() -> None:
    async def body(engines: list[FakeSglangEngine], client: EngineClient) -> None:
        session = GenerationSession(client, retry=FAST_RETRY)
        engines[0].fail_next = 1
        engines[0].fail_with = (400, {"error": {"message": "sampling_params.temperature must be >= 0"}})
        with pytest.raises(RequestRejected, match=r"HTTP 400\): sampling_params.temperature must be >= 0 "
                                                  r"\(sampling_params \{'temperature': -3"):
            await run_generate(load_generate_function(None), None, make_sample(0),
                               {"temperature": -3, "max_new_tokens": 10}, session)
        assert len(engines[0].rids_seen) == 1  # not retried (the old code: the sample failed, the run went on)
        assert accounted(session)

    asyncio.run(with_engines(1, body))


@pytest.mark.parametrize("status", [408, 429])
def test_busy_answers_are_retried_not_run_ending(status: int) -> None:
    async def body(engines: list[FakeSglangEngine], client: EngineClient) -> None:
        session = GenerationSession(client, retry=FAST_RETRY)
        engines[0].fail_next = 2
        engines[0].fail_with = (status, {"error": "busy"})
        done = await generate_turn(make_sample(0), {"max_new_tokens": 10}, session=session)
        assert done.status is SampleStatus.COMPLETED and session.metrics.requests_retried == 2

    asyncio.run(with_engines(1, body))


def test_a_router_without_workers_ends_the_run_after_the_bound() -> None:
    no_workers = (503, {"error": {"type": "Service Unavailable", "code": "no_available_workers",
                                  "message": "No available workers (all circuits open or unhealthy)"}})
    patient = RetryPolicy(max_transport_retries=1000, base_delay_s=0.01, max_delay_s=0.01,
                          no_workers_timeout_s=0.3)

    async def body(engines: list[FakeSglangEngine], client: EngineClient) -> None:
        router = engines[0]  # plays the router: every answer is sglang-router's 503
        router.fail_next, router.fail_with = 10**6, no_workers
        session = GenerationSession(client, retry=patient)
        with pytest.raises(NoWorkersAvailable, match=r"answered 'no_available_workers' for \d+ s while engine"):
            await asyncio.wait_for(generate_turn(make_sample(0), {"max_new_tokens": 10}, session=session), 30)
        # While the controller counts no engine serving (restarting), the same answers are only retried.
        client.directory.urls.clear()
        restarting = GenerationSession(client, retry=RetryPolicy(max_transport_retries=30, base_delay_s=0.02,
                                                                 max_delay_s=0.02, no_workers_timeout_s=0.1))
        failed = await generate_turn(make_sample(1), {"max_new_tokens": 10}, session=restarting)
        assert failed.status is SampleStatus.FAILED and restarting.no_workers_since is None

    asyncio.run(with_engines(1, body))


def test_output_logprobs_reads_sglang_entries_and_zeroes_missing_ones() -> None:
    from hpc_rl.rollout.generate import output_logprobs

    assert output_logprobs([[-0.5, 11, None], [-1.25, 12, "x"]]) == [-0.5, -1.25]
    assert output_logprobs([[-0.5, 11, None], [None, 12, None], [-2, 13, None]]) == [-0.5, 0.0, -2.0]
    assert output_logprobs([[-0.5, 11], []]) == [-0.5, 0.0]  # a malformed entry
    assert output_logprobs([]) == []
