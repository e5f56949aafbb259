"""remote_rm against a real aiohttp server on 127.0.0.1: retries, backoff, payload, errors."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from hpc_rl.data.samples import Sample
from hpc_rl.rewards import REMOTE_RM_RETRY, RetryPolicy, RewardError, RewardSpec, reward_group

FAST = RetryPolicy(max_transport_retries=2, base_delay_s=0.01, max_delay_s=0.05, jitter_s=0.01)


class FlakyRewardServer:
    """Answers 503 `failures` times per sample, then `{"score": ..., "acc": ...}`; records requests."""

    def __init__(self, failures: int, body: Any = None) -> None:
        self.failures = failures
        self.body = body
        self.requests: list[dict[str, Any]] = []
        self._seen: dict[str, int] = {}

    async def handle(self, request: web.Request) -> web.Response:
        payload = await request.json()
        self.requests.append(payload)
        key = payload["response"]
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] <= self.failures:
            return web.Response(status=503, text="busy")
        if self.body is not None:
            return web.json_response(self.body)
        return web.json_response(len(payload["response"]) / 10)

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/reward", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}/reward"

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


def make_samples(*responses: str) -> list[Sample]:
    return [
        Sample(index=i, group_index=0, prompt=[{"role": "user", "content": "q"}], prompt_token_ids=[1],
               label="L", response_text=r)
        for i, r in enumerate(responses)
    ]  # fmt: skip


def test_fails_twice_then_succeeds() -> None:
    async def scenario() -> tuple[list[float], FlakyRewardServer]:
        server = FlakyRewardServer(failures=2)
        async with server as url:
            spec = RewardSpec(rm_type="remote_rm", rm_url=url, retry=FAST)
            return await reward_group(spec, make_samples("abc", "abcdefghij")), server

    rewards, server = asyncio.run(scenario())
    assert rewards == [0.3, 1.0]
    assert len(server.requests) == 6  # 2 failures + 1 success, per sample
    assert server.requests[0] == {
        "prompt": [{"role": "user", "content": "q"}],
        "response": "abc",
        "label": "L",
    }


def test_gives_up_after_max_retries_and_names_the_sample() -> None:
    async def scenario() -> None:
        server = FlakyRewardServer(failures=10)
        async with server as url:
            spec = RewardSpec(rm_type="remote_rm", rm_url=url, retry=FAST)
            try:
                await reward_group(spec, make_samples("abc"))
            except RewardError as error:
                message = str(error)
                assert "sample index 0" in message and "remote_rm" in message
                assert "failed after 3 attempt(s)" in message and "503" in message
                assert len(server.requests) == 3
            else:
                raise AssertionError("expected RewardError")

    asyncio.run(scenario())


def test_object_answer_with_reward_key() -> None:
    async def scenario() -> list[float]:
        async with FlakyRewardServer(failures=0, body={"score": -1.0, "pred": "7"}) as url:
            spec = RewardSpec(rm_type="remote_rm", rm_url=url, retry=FAST, reward_key="score")
            return await reward_group(spec, make_samples("x"))

    assert asyncio.run(scenario()) == [-1.0]


def test_unreachable_server() -> None:
    spec = RewardSpec(rm_type="remote_rm", rm_url="http://127.0.0.1:9/reward", retry=FAST)
    try:
        asyncio.run(reward_group(spec, make_samples("x")))
    except RewardError as error:
        assert "ClientConnectorError" in str(error) or "Connect" in str(error)
    else:
        raise AssertionError("expected RewardError")


def test_backoff_doubles_and_caps() -> None:
    policy = REMOTE_RM_RETRY
    assert policy.max_attempts == 10  # slime's
    delays = [policy.delay_s(failures) for failures in range(1, 8)]
    for attempt, delay in enumerate(delays):
        base = min(2**attempt, 30)
        assert base <= delay <= base + 1.0
