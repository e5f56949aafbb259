"""hpc_rl.protocol.http_client (keep-alive, pipelined HTTP/1.1 to engines) against real aiohttp servers,
and the pipelined weight update of EngineAdmin against simulated engines (hpc_rl.sim)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
import pytest
from aiohttp import web

from hpc_rl.controller.engine_admin import BucketUpdate, EngineAdmin, EngineAdminError, PipelinedBuckets
from hpc_rl.protocol.http_client import (EngineConnections, EngineHTTPTransportError, Pipeline,
                                         request_blocking)
from hpc_rl.sim.model import EngineModel
from hpc_rl.sim.server import SimFleetServer
from tests.unit.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


async def serve(app: web.Application, **runner_options: object) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, **runner_options)  # type: ignore[arg-type]
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def echo_app(seen: list[tuple[int, str]], held: asyncio.Event | None = None) -> web.Application:
    """Answers in the order requests arrive; records (connection id, path). /slow answers after 1 s, /held once
    `held` is set."""

    async def echo(request: web.Request) -> web.StreamResponse:
        seen.append((id(request.transport), request.path))
        if request.path == "/held" and held is not None:
            await held.wait()
        if request.path == "/chunked":
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for part in (b'{"a":', b' 1}'):
                await response.write(part)
            await response.write_eof()
            return response
        if request.path == "/slow":
            await asyncio.sleep(1.0)
        body = await request.read()
        return web.json_response({"path": request.path, "body": body.decode(), "auth": request.headers.get("Authorization")},
                                 status=400 if request.path == "/bad" else 200)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", echo)
    return app


@asynccontextmanager
async def sim_fleet(count: int) -> AsyncIterator[tuple[list[str], EngineConnections]]:
    """`count` simulated engines (key "k", 1 real ms per simulated second) and a connection pool to them."""
    async with sim_fleet_server(count) as (_, urls, pool):
        yield urls, pool


@asynccontextmanager
async def sim_fleet_server(count: int) -> AsyncIterator[tuple[SimFleetServer, list[str], EngineConnections]]:
    """`sim_fleet`, with its server (a test reads the engines' state there: `server.endpoints`)."""
    model = EngineModel.from_yaml(REPO / "configs" / "sim" / "qwen3_4b_h100_tp2.yaml", time_scale_ms=1)
    server = SimFleetServer(model, count=count, api_key="k")
    urls = await server.start()
    pool = EngineConnections(api_key="k")
    try:
        yield server, urls, pool
    finally:
        await pool.close()
        await server.stop()


def test_pipelined_requests_share_one_connection_and_come_back_in_order() -> None:
    async def scenario() -> None:
        seen: list[tuple[int, str]] = []
        runner, url = await serve(echo_app(seen))
        pool = EngineConnections(api_key="k")
        try:
            answers = await pool.to(url).exchange(
                [("POST", "/one", b'{"x": 1}'), ("POST", "/bad", b"{}"), ("GET", "/chunked", None),
                 ("POST", "/three", b"[]")], timeout_s=10)
            assert [status for status, _ in answers] == [200, 400, 200, 200]
            first = orjson.loads(answers[0][1])
            assert first == {"path": "/one", "body": '{"x": 1}', "auth": "Bearer k"}
            assert orjson.loads(answers[2][1]) == {"a": 1}
            assert orjson.loads(answers[3][1])["path"] == "/three"
            assert len({connection for connection, _ in seen}) == 1
            assert [path for _, path in seen] == ["/one", "/bad", "/chunked", "/three"]
        finally:
            await pool.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_an_idle_connection_closed_by_the_engine_is_reopened() -> None:
    """uvicorn (SGLang) closes idle keep-alive connections after 5 s: the next call must not fail."""

    async def scenario() -> None:
        seen: list[tuple[int, str]] = []
        runner, url = await serve(echo_app(seen), keepalive_timeout=0.1)
        pool = EngineConnections()
        try:
            assert (await pool.to(url).request("POST", "/a", b"{}", timeout_s=10))[0] == 200
            await asyncio.sleep(0.5)  # the server closed the idle connection meanwhile
            assert (await pool.to(url).request("POST", "/b", b"{}", timeout_s=10))[0] == 200
            assert len({connection for connection, _ in seen}) == 2
        finally:
            await pool.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_call_overlapping_a_slow_one_gets_its_own_connection_and_timeouts_name_the_engine() -> None:
    async def scenario() -> None:
        seen: list[tuple[int, str]] = []
        held = asyncio.Event()
        runner, url = await serve(echo_app(seen, held))
        pool = EngineConnections()
        connection = pool.to(url)
        try:
            slow = asyncio.create_task(connection.request("POST", "/held", b"{}", timeout_s=60))
            await wait_until(lambda: any(path == "/held" for _, path in seen), what="/held at the engine")
            assert (await connection.request("GET", "/health", None, timeout_s=30))[0] == 200  # not behind /held:
            assert not slow.done()  # pipelined behind it, /health would have waited for it (held until set)
            held.set()
            assert (await slow)[0] == 200
            with pytest.raises(EngineHTTPTransportError, match=f"{url}: no answer within 0.2 s"):
                await connection.request("POST", "/slow", b"{}", timeout_s=0.2)
            assert (await connection.request("POST", "/after", b"{}", timeout_s=10))[0] == 200
        finally:
            await pool.close()
            await runner.cleanup()
        with pytest.raises(EngineHTTPTransportError, match="cannot connect"):
            await EngineConnections().to(url).request("GET", "/health", None, timeout_s=5)

    asyncio.run(scenario())


def test_request_blocking_for_sync_callers_speaks_the_same_http() -> None:
    """The router's worker registry and child-process health polls (sync code) use `request_blocking`:
    JSON bodies, the engine key, chunked answers, error statuses, query strings, timeouts, refusals."""

    async def scenario() -> None:
        runner, url = await serve(echo_app([]))
        try:
            status, body = await asyncio.to_thread(request_blocking, "POST", f"{url}/w?x=1", b'{"y": 2}', api_key="k")
            assert status == 200 and orjson.loads(body) == {"path": "/w", "body": '{"y": 2}', "auth": "Bearer k"}
            assert await asyncio.to_thread(request_blocking, "GET", f"{url}/chunked") == (200, b'{"a": 1}')
            assert (await asyncio.to_thread(request_blocking, "DELETE", f"{url}/bad"))[0] == 400
            with pytest.raises(EngineHTTPTransportError, match="timed out"):
                await asyncio.to_thread(request_blocking, "GET", f"{url}/slow", timeout_s=0.2)
        finally:
            await runner.cleanup()
        with pytest.raises(EngineHTTPTransportError, match="refused"):
            request_blocking("GET", f"{url}/health")
        with pytest.raises(ValueError, match="plain HTTP"):
            request_blocking("GET", "https://example.com/health")

    asyncio.run(scenario())


def test_sync_callers_go_straight_to_the_engines_whatever_the_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Login and batch nodes often set http_proxy for the internet; urllib honoured it, so the router's
    worker calls, the engines' health polls and the colocated weight updates went to the proxy (no_proxy rarely lists the job's nodes
    or 127.0.0.1) and failed. Engines and the router are on the job's own nodes: no proxy, ever."""
    from hpc_rl.process.child_process import http_ok
    from hpc_rl.engines.router import _request
    from hpc_rl.weights.colocated_sender import post_update

    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)

    async def scenario() -> None:
        runner, url = await serve(echo_app([]))
        try:
            assert await asyncio.to_thread(http_ok, f"{url}/health")
            status, body = await asyncio.to_thread(_request, "POST", f"{url}/workers", {"url": "http://e"}, api_key="k")
            assert status == 200 and body == {"path": "/workers", "body": '{"url": "http://e"}', "auth": "Bearer k"}
            await asyncio.to_thread(post_update, url, {"flush_cache": False}, api_key="k", timeout_s=5.0)
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_weight_update_pipelines_the_session_and_names_the_failing_call() -> None:
    async def scenario() -> None:
        async with sim_fleet(2) as (urls, pool):
            admins = [EngineAdmin(url, pool) for url in urls]
            buckets = [BucketUpdate.of(names=[f"w{i}"], dtypes=["bfloat16"], shapes=[[4, 4]], group_name="g",
                                       weight_version="7" if i == 2 else None, load_format=None) for i in range(3)]
            await asyncio.gather(*(admin.weight_update(buckets) for admin in admins))
            for admin in admins:
                assert (await admin.model_info())["weight_version"] == "7"
            await admins[1].begin_weight_update()  # a session left open: the pipelined begin is refused
            with pytest.raises(EngineAdminError, match=f"{urls[1]}/begin_weight_update answered HTTP 400"):
                await admins[1].weight_update(buckets)
            await admins[1].weight_update(buckets)  # its end call was still made: the session is closed

    asyncio.run(scenario())


def test_simulated_engines_answer_sglangs_batched_generate_item_by_item() -> None:
    """The rollout client sends a group as one batched /generate (rid list); the sim answers as SGLang does."""
    async def scenario() -> None:
        async with sim_fleet(1) as (urls, pool):
            engine = pool.to(urls[0])
            body = {"rid": ["s1-a", "s2-b", "s3-c"], "input_ids": [[1, 2], [3], [4, 5, 6]],
                    "sampling_params": {"max_new_tokens": 8}, "return_logprob": [True, False, True]}
            status, raw = await engine.request("POST", "/generate", orjson.dumps(body), 60.0)
            answers = orjson.loads(raw)
            assert status == 200 and [a["meta_info"]["id"] for a in answers] == ["s1-a", "s2-b", "s3-c"]
            assert [a["meta_info"]["prompt_tokens"] for a in answers] == [2, 1, 3]
            assert all(0 < len(a["output_ids"]) <= 8 for a in answers)
            assert ["output_token_logprobs" in a["meta_info"] for a in answers] == [True, False, True]
            duplicate = {**body, "rid": ["x", "x", "y"]}
            status, raw = await engine.request("POST", "/generate", orjson.dumps(duplicate), 60.0)
            assert status == 400 and b"Duplicate request IDs" in raw

    asyncio.run(scenario())


def test_response_parser_takes_fixed_length_bodies_split_over_reads_and_back_to_back() -> None:
    from hpc_rl.protocol.http_client import _ResponseParser

    body = bytes(range(256)) * 4000  # ~1 MB: many reads, as a full-length batched /generate answer
    stream = (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
              + b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno")
    parser = _ResponseParser()
    answers = []
    for start in range(0, len(stream), 65_536):
        answers += parser.feed(stream[start:start + 65_536])
    assert [(status, type(data), len(data)) for status, data in answers] == [(200, bytes, len(body)), (404, bytes, 2)]
    assert answers[0][1] == body and answers[1][1] == b"no"
    assert not parser.buffer and parser.status is None


def test_response_parser_takes_pipelined_answers_in_one_read_and_cut_anywhere() -> None:
    """A pipelined exchange's answers back to back in one read (the whole-answers path: Content-Length, any header
    case), with a chunked and an interim answer among them (the incremental path), and the same bytes cut at every
    position over two reads: the same answers in order, nothing left."""
    from hpc_rl.protocol.http_client import _ResponseParser

    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\ncontent-type: application/json\r\n\r\n{}"
    bad = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 3\r\n\r\nbad"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n"
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    stream = ok * 17 + bad + chunked + interim + ok
    expected = [(200, b"{}")] * 17 + [(400, b"bad"), (200, b"ab"), (200, b"{}")]
    parser = _ResponseParser()
    assert parser.feed(stream) == expected and not parser.buffer and parser.status is None
    for cut in range(len(stream)):
        parser = _ResponseParser()
        assert parser.feed(stream[:cut]) + parser.feed(stream[cut:]) == expected, cut
        assert not parser.buffer and parser.status is None


def test_a_health_round_probes_warm_connections_at_once_and_falls_back_per_call() -> None:
    """`healthy_all`: engines with an idle kept-alive connection are probed in one RequestRound (on that
    connection), the others per call; a stuck engine is False after the timeout (its connection dropped), a dead
    one False, and an idle connection the engine closed is reopened (not counted as a failure)."""
    from hpc_rl.controller.engine_admin import healthy_all

    def health_app(seen: list[int], stuck: list[bool], released: asyncio.Event) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            seen.append(id(request.transport))
            if stuck[0]:
                await released.wait()  # stuck until the test ends: only the probe's timeout ends its wait
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/health", health)
        return app

    class CountingAdminForTest(EngineAdmin):
        """The real admin, counting its per-call probes."""

        per_call = 0

        async def healthy(self, timeout_s: float = 5.0) -> bool:
            self.per_call += 1
            return await super().healthy(timeout_s)

    async def scenario() -> None:
        released = asyncio.Event()
        seen = [[] for _ in range(4)]  # type: list[list[int]]
        stuck = [[False] for _ in range(4)]
        servers = [await serve(health_app(seen[i], stuck[i], released),
                               **({"keepalive_timeout": 0.1} if i == 3 else {})) for i in range(4)]
        pool = EngineConnections()
        admins = [CountingAdminForTest(url, pool) for _, url in servers]
        try:
            assert await healthy_all(admins, 5.0) == [True] * 4  # cold: every probe per call (connects)
            assert [len(s) for s in seen] == [1, 1, 1, 1]
            stuck[1][0] = True
            await servers[2][0].cleanup()  # engine 2 is gone
            await asyncio.sleep(0.3)  # engine 3 closed its idle connection meanwhile
            start = asyncio.get_running_loop().time()
            assert await healthy_all(admins, 1.0) == [True, False, False, True]
            assert asyncio.get_running_loop().time() - start < 15  # engine 1 never answers: its probe timed out
            assert len(set(seen[0])) == 1 and len(seen[0]) == 2  # engine 0: the same kept-alive connection
            assert len(set(seen[3])) == 2  # engine 3: reopened after the close, then answered
            assert [admin.per_call for admin in admins] == [1, 1, 2, 2]  # warm ones in the round, the closed again
            stuck[1][0] = False
            assert (await healthy_all(admins, 5.0))[:2] == [True, True]  # engine 1's dropped connection reopened
        finally:
            released.set()
            await pool.close()
            for index, (runner, _) in enumerate(servers):
                if index != 2:
                    await runner.cleanup()

    asyncio.run(scenario())


def test_a_pipeline_encoded_once_sends_each_engine_the_same_bytes_as_request_by_request() -> None:
    """A weight update's requests are encoded once for every engine (`Pipeline`): each engine gets its own
    Host in the heads and the very bytes the per-request encoding makes; the answers come back in order."""
    async def scenario() -> None:
        seen: list[tuple[int, str]] = []
        runners_urls = [await serve(echo_app(seen)) for _ in range(2)]
        pool = EngineConnections(api_key="secret")
        requests = [("POST", "/begin", b"{}"), ("POST", "/bucket", b'{"names": ["w0"]}'),
                    ("POST", "/bucket", b'{"names": ["w1"]}'), ("POST", "/end", b"")]
        pipeline = Pipeline(requests)
        try:
            for _, url in runners_urls:
                connection = pool.to(url)
                assert pipeline.encoded_for(connection) == b"".join(
                    connection._encode(method, path, body) for method, path, body in requests)
                assert f"Host: {connection.host_header}\r\n".encode() in pipeline.encoded_for(connection)
                answers = await connection.exchange(pipeline, timeout_s=5)
                assert len(pipeline) == 4 and [orjson.loads(body)["path"] for _, body in answers] == \
                    ["/begin", "/bucket", "/bucket", "/end"]
                assert [orjson.loads(body)["body"] for _, body in answers][1:3] == ['{"names": ["w0"]}',
                                                                                    '{"names": ["w1"]}']
                assert {orjson.loads(body)["auth"] for _, body in answers} == {"Bearer secret"}
            assert len({connection for connection, _ in seen}) == 2  # one connection per engine
        finally:
            await pool.close()
            for runner, _ in runners_urls:
                await runner.cleanup()

    asyncio.run(scenario())


def test_a_pipelined_weight_update_names_the_failing_bucket() -> None:
    """Through the fan-out's encoded-once buckets (PipelinedBuckets), a bucket an engine refuses is named with
    its index and the engine, as the per-request path named it."""
    async def scenario() -> None:
        seen: list[tuple[int, str]] = []
        runner, url = await serve(echo_app(seen))
        pool = EngineConnections()
        admin = EngineAdmin(url, pool)
        good = BucketUpdate(b'{"names": ["w0"]}')
        try:
            await admin.weight_update(PipelinedBuckets([good, good]))
            assert [path for _, path in seen] == ["/begin_weight_update", "/update_weights_from_distributed",
                                                  "/update_weights_from_distributed", "/end_weight_update"]
            # the echo server refuses /bad: a pipeline whose second bucket goes there is named "bucket 2 of 2"
            buckets = PipelinedBuckets([good, good])
            buckets.requests.keys = (*buckets.requests.keys[:2], ("POST", "/bad"), buckets.requests.keys[3])
            with pytest.raises(EngineAdminError, match=f"{url}/bad \\(bucket 2 of 2\\) answered HTTP 400"):
                await admin.weight_update(buckets)
        finally:
            await pool.close()
            await runner.cleanup()

    asyncio.run(scenario())
