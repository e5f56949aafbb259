"""`FakeSglangEngine`: an in-process aiohttp server with SGLang's /generate and control semantics.

A fake for the rollout unit tests (not an engine): tokens are `(len(input_ids) + i) % 50 + 100`,
one every `token_latency_s`; a request stops ("stop") after `natural_length(input_ids)` tokens or at
`max_new_tokens` ("length"). Batched `input_ids` (a list of lists, one rid each) run each item as its
own request and answer a list, as SGLang does. /abort_request (rid or abort_all) and /pause_generation {"mode":"abort"}
end running requests with 200, their partial output and finish_reason abort; while paused, new
requests wait for /continue_generation. `fail_next` makes the next N /generate calls answer 500, and
`stop()` kills the server (connection refused). The tests at the bottom check the fake itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from tests.unit.waiting import wait_until

EOS = 2


class FakeSglangEngine:
    def __init__(self, *, token_latency_s: float = 0.001,
                 natural_length: Callable[[list[int]], int] = lambda ids: 4) -> None:
        self.token_latency_s = token_latency_s
        self.natural_length = natural_length
        self.weight_version = "default"
        self.fail_next = 0
        self.fail_with: tuple[int, dict[str, Any]] = (500, {"error": "injected failure"})
        """(status, JSON body) of the next `fail_next` answers."""
        self.running: dict[str, asyncio.Event] = {}
        self.tokens_made: dict[str, int] = {}
        """Tokens generated so far for each rid (kept after it ends): tests wait on it, not on a fixed sleep."""
        self.rids_seen: list[str] = []
        self.requests_seen = 0
        """/generate requests received (a batch counts once)."""
        self.batch_sizes: list[int] = []
        """Items of each batched request received."""
        self.abort_calls = 0
        self.max_running = 0
        self._resume = asyncio.Event()
        self._resume.set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> FakeSglangEngine:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        host, bound_port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{bound_port}"
        return self

    async def stop(self) -> None:
        for event in self.running.values():
            event.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def set_weight_version(self, version: int | str) -> None:
        self.weight_version = str(version)

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests_seen += 1
        batched = isinstance(body["input_ids"][0], list)
        rids = body["rid"] if batched else [body["rid"]]
        self.rids_seen.extend(rids)
        if self.fail_next > 0:
            self.fail_next -= 1
            status, error_body = self.fail_with
            return web.json_response(error_body, status=status)
        await self._resume.wait()
        prompts = body["input_ids"] if batched else [body["input_ids"]]
        params = body["sampling_params"]
        params = params if isinstance(params, list) else [params] * len(prompts)
        if batched:
            self.batch_sizes.append(len(prompts))
        answers = await asyncio.gather(*(self._run_one(rid, ids, int(p.get("max_new_tokens", 128)))
                                         for rid, ids, p in zip(rids, prompts, params, strict=True)))
        return web.json_response(answers if batched else answers[0])

    async def _run_one(self, rid: str, input_ids: list[int], max_new: int) -> dict[str, Any]:
        natural = self.natural_length(input_ids)
        aborted = asyncio.Event()
        self.running[rid] = aborted
        self.max_running = max(self.max_running, len(self.running))
        out: list[int] = []
        spans: list[dict[str, Any]] = []
        finish: dict[str, Any]
        try:
            while True:
                if aborted.is_set():
                    finish = {"type": "abort", "message": "Aborted"}
                    break
                if len(out) >= natural:
                    finish = {"type": "stop", "matched": EOS}
                    break
                if len(out) >= max_new:
                    finish = {"type": "length", "length": len(out)}
                    break
                if self.token_latency_s > 0:
                    try:
                        await asyncio.wait_for(aborted.wait(), timeout=self.token_latency_s)
                        continue
                    except TimeoutError:
                        pass
                token = (len(input_ids) + len(out)) % 50 + 100
                if spans and spans[-1]["version"] == self.weight_version:
                    spans[-1]["end"] += 1
                else:
                    spans.append({"version": self.weight_version, "start": len(out), "end": len(out) + 1})
                out.append(token)
                self.tokens_made[rid] = len(out)
        finally:
            self.running.pop(rid, None)
        return {
            "text": "".join(f" t{t}" for t in out),
            "output_ids": out,
            "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids),
                          "completion_tokens": len(out), "weight_version": self.weight_version,
                          "weight_versions": spans,
                          "output_token_logprobs": [[-0.5, t, None] for t in out]},
        }

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.abort_calls += 1
        if body.get("abort_all"):
            for event in self.running.values():
                event.set()
        elif body.get("rid") in self.running:
            self.running[body["rid"]].set()
        return web.json_response({"success": True})

    async def _pause(self, request: web.Request) -> web.Response:
        self._resume.clear()
        for event in self.running.values():
            event.set()
        return web.json_response({"success": True})

    async def _continue(self, request: web.Request) -> web.Response:
        self._resume.set()
        return web.json_response({"success": True})


def test_fake_engine_generate_and_abort() -> None:
    async def main() -> None:
        engine = await FakeSglangEngine(token_latency_s=0.01, natural_length=lambda ids: 1000).start()
        try:
            async with aiohttp.ClientSession() as http:
                async def gen() -> dict:
                    payload = {"rid": "a", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 500}}
                    async with http.post(f"{engine.url}/generate", json=payload) as response:
                        assert response.status == 200
                        return await response.json()

                task = asyncio.create_task(gen())
                await wait_until(lambda: engine.tokens_made.get("a", 0) > 0, what="a first token")
                async with http.post(f"{engine.url}/abort_request", json={"rid": "", "abort_all": True}) as r:
                    assert r.status == 200
                body = await task
                assert body["meta_info"]["finish_reason"]["type"] == "abort"
                assert 0 < len(body["output_ids"]) < 500
        finally:
            await engine.stop()

    asyncio.run(main())
