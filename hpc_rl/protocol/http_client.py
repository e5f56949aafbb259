"""Keep-alive, pipelined HTTP/1.1 to engines and the router: admin calls, /generate, /abort_request.

Owns: keep-alive TCP connections per engine (one, unless calls overlap: a call never waits behind
another caller's; opened on first use, reopened after an error or a close by the engine), requests
written back to back (pipelined: an HTTP/1.1 server answers them in order, as uvicorn under SGLang
and aiohttp under the CPU and simulated engines do), responses parsed (status; body by
Content-Length, chunked, or up to the close) and matched to requests in order, a timeout per
response, and `EngineConnections`: the pool, one entry per engine URL, with a bound on connections
being opened at once (a fan-out to 1,024 engines must not open 1,024 sockets in one instant against
their listen backlogs), and `request_blocking`: one call on its own connection for sync code (the
router's worker registry, health polls of child processes), with the same request and response code.

Why not aiohttp: its client cost ~440 us of controller CPU per call here (measured against the
simulated engines at N=256); a weight sync of Qwen3-4B is 20 calls per engine, 20,480 at 1,024
engines. This one costs ~100 us per single call and ~45-70 us per pipelined one (session 4; since then
each read lands in one reused per-thread buffer, ~16 us less per answer, and a weight update's answers
can be read in batches through a `ReadGate`). benchmarks/bench_admin_fanout.py, bench_scale.py and
docs/scaling.md have the current numbers.
Does not own: the bytes of a request and the parsing of a response (http_wire.py); what the calls mean
(controller.engine_admin, rollout.engine_client) or when they are
made (controller.transports, the loop, the rollout client). Plain HTTP only: engines and the
router listen on the job's own nodes, as before (no TLS was used with aiohttp either), and are
reached directly whatever http_proxy says (urllib sent the sync calls to the proxy). A user's reward
server (rewards.remote) is outside the job and may be https: it keeps aiohttp (see there).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

from hpc_rl.protocol.http_wire import (  # noqa: F401  (re-exported: callers import them from here)
    EngineHTTPTransportError,
    _ResponseParser,
    encode_request,
)

DEFAULT_MAX_CONNECTING = 64
"""Connections being opened at once, over all engines."""


IDLE_CLOSE_RACE_S = 1.0
"""A kept-alive connection closed this soon after a write, before any answer, was closed by the engine
while idle (it never read the request): the request is sent again on a new connection. Later, it is an
engine that went away while working, and the caller hears of it."""


_receive = threading.local()


def _receive_buffer() -> memoryview:
    """This thread's receive buffer, shared by its connections: the event loop reads into it and hands it
    over in one step (get_buffer, recv_into, buffer_updated). A plain Protocol costs a fresh 256 KiB bytes
    object per read, which glibc maps and unmaps each time: ~16 us per answer, 0.3 s per weight sync at
    1,024 engines (benchmarks/bench_admin_fanout.py)."""
    buffer = getattr(_receive, "buffer", None)
    if buffer is None:
        buffer = _receive.buffer = memoryview(bytearray(256 * 1024))
    return buffer


class ReadGate:
    """While shut, a gated exchange's connection reads no more after an answer: later answers wait in the
    socket and are read together once it opens. For a fan-out whose answers come on every engine at about
    the same time (a weight update's buckets): its owner keeps it shut while one engine's answers come
    and opens it at least every few tenths of a second, so an engine's error still shows."""

    def __init__(self) -> None:
        self.opened: asyncio.Future[None] | None = None
        """Done when the gate opens; None while it is open."""

    def shut(self) -> None:
        if self.opened is None:
            self.opened = asyncio.get_running_loop().create_future()

    def open(self) -> None:
        opened, self.opened = self.opened, None
        if opened is not None:
            opened.set_result(None)


class _Link(asyncio.BufferedProtocol):
    """One TCP connection (a new one after each failure): its parser and the requests awaiting answers."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.transport: asyncio.Transport | None = None
        self.parser = _ResponseParser()
        self.waiting: deque[asyncio.Future[tuple[int, bytes]]] = deque()
        self.requests_sent = 0
        self.last_answer_at = 0.0
        self.answer_seen_at = float("-inf")
        """When an answer last arrived on this connection (only answers: for telling a stuck engine)."""
        self.closed_early = False
        """The peer closed while requests waited and none of them had been answered."""
        self.on_lost: Callable[[_Link], None] | None = None
        self.gate: ReadGate | None = None
        self.held: asyncio.Future[None] | None = None
        """The gate's opening this connection waits for to read again (None: reading)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:  # small requests go out at once (as aiohttp sets it)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        return _receive_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(_receive_buffer()[:nbytes]))

    def data_received(self, data: bytes) -> None:
        try:
            responses = self.parser.feed(data)
        except (EngineHTTPTransportError, ValueError) as error:
            self.fail(EngineHTTPTransportError(f"{self.url}: {error}"))
            return
        if responses:
            self.last_answer_at = self.answer_seen_at = asyncio.get_running_loop().time()
        for response in responses:
            if self.waiting:
                future = self.waiting.popleft()
                if not future.done():
                    future.set_result(response)
        opened = self.gate.opened if self.gate is not None else None
        if opened is not None and self.waiting and self.transport is not None:
            self.held = opened
            self.transport.pause_reading()
            opened.add_done_callback(self._read_again)

    def _read_again(self, _: asyncio.Future[None]) -> None:
        self.held = None
        if self.usable():
            assert self.transport is not None
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed_early = bool(self.waiting) and self.parser.status is None and not self.parser.buffer
        last = self.parser.close()
        if last is not None and self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_result(last)
        self.fail(EngineHTTPTransportError(f"{self.url}: connection closed" + (f" ({exc})" if exc else "")))
        if self.on_lost is not None:
            self.on_lost(self)

    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def fail(self, error: Exception) -> None:
        """Every request waiting on this connection fails; the connection is dropped."""
        waiting, self.waiting = self.waiting, deque()
        for future in waiting:
            if not future.done():
                future.set_exception(error)
        if self.transport is not None:
            self.transport.abort()


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"engine URL {url!r}: expected http://host:port (engines speak plain HTTP)")
    return parts.hostname, parts.port or 80


def request_blocking(method: str, url: str, body: bytes | None = None, *, api_key: str | None = None,
                     timeout_s: float = 10.0) -> tuple[int, bytes]:
    """One request on a new connection, for code that is not async: (status, body).
    EngineHTTPTransportError when the connection fails, closes before the answer, or `timeout_s`
    passes on connecting or between two reads."""
    host, port = _address(url)
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
    parser = _ResponseParser()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(encode_request(method, path, f"{host}:{port}", auth, body))
            while True:
                data = sock.recv(1 << 16)
                answers = parser.feed(data) if data else [parser.close()]
                if answers and answers[0] is not None:
                    return answers[0]
                if not data:
                    raise EngineHTTPTransportError(f"{url}: connection closed before the answer")
    except (OSError, ValueError) as error:
        if isinstance(error, EngineHTTPTransportError):
            raise
        raise EngineHTTPTransportError(f"{method} {url}: {error}") from error


class EngineConnection:
    """Admin requests to one engine over keep-alive connections (usually one); `exchange` pipelines."""

    def __init__(self, url: str, *, api_key: str | None, connecting: asyncio.Semaphore) -> None:
        self.url = url.rstrip("/")
        self.host, self.port = _address(url)
        self.host_header = f"{self.host}:{self.port}"
        self.auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        self._connecting = connecting
        self._links: set[_Link] = set()
        self._idle: list[_Link] = []
        self.answered_at = float("-inf")
        """Event-loop time of the last exchange this engine answered in full (any status)."""
        self._encoded: dict[tuple[str, str], bytes] = {}
        self._pipeline_heads: dict[tuple[tuple[str, str], ...], list[bytes]] = {}
        """A `Pipeline`'s request heads to this engine, by its (method, path) sequence."""

    def _idle_link(self) -> _Link | None:
        """An open connection with nothing in flight, if there is one. Idle connections wait in a stack (the
        router's pool holds one per request in flight: thousands)."""
        while self._idle:
            link = self._idle.pop()
            if link.usable() and not link.waiting:
                return link
        return None

    async def _connected(self) -> _Link:
        """An open connection with nothing in flight (a call never queues behind another caller's: a
        health probe must not wait behind a long weight update), opened if there is none."""
        link = self._idle_link()
        if link is not None:
            return link
        async with self._connecting:
            loop = asyncio.get_running_loop()
            try:
                _, link = await loop.create_connection(lambda: _Link(self.url), self.host, self.port)
            except OSError as error:
                raise EngineHTTPTransportError(f"{self.url}: cannot connect: {error}") from error
        self._links.add(link)
        link.on_lost = self._links.discard
        return link

    def encoded(self, method: str, path: str) -> bytes:
        """The bytes of a request without a body to this engine (kept: a health round sends the same ones)."""
        key = (method, path)
        data = self._encoded.get(key)
        if data is None:
            data = self._encoded[key] = encode_request(method, path, self.host_header, self.auth, None)
        return data

    def _encode(self, method: str, path: str, body: bytes | None) -> bytes:
        """`encode_request` to this engine, its head up to the body's length kept per (method, path): a weight
        update writes 18 requests to each of 1,024 engines."""
        if body is None:
            return self.encoded(method, path)
        return self.body_head(method, path) + _length_and_body(body)

    async def exchange(self, requests: list[tuple[str, str, bytes | None]] | Pipeline, timeout_s: float, *,
                       gate: ReadGate | None = None) -> list[tuple[int, bytes]]:
        """Send (method, path, body) requests back to back (pipelined; a `Pipeline`: encoded for many engines
        at once) and return their (status, body) in order; EngineHTTPTransportError at the first that gets no answer (connection refused or closed, no answer
        within `timeout_s`: the connection is dropped then, as a late answer would be matched to the
        wrong request; time held by a shut `gate` does not count). A kept-alive connection the engine closed while idle (closed within
        IDLE_CLOSE_RACE_S of the write, before any answer) is reopened and the requests sent once more:
        the engine never read them."""
        for attempt in (1, 2):
            link = await self._connected()
            reused = link.requests_sent > 0
            loop = asyncio.get_running_loop()
            answers = _Answers(loop.create_future(), len(requests))
            link.waiting.extend([answers] * len(requests))  # type: ignore[list-item]  (a Future's stand-in)
            link.requests_sent += len(requests)
            link.gate = gate
            assert link.transport is not None
            sent_at = loop.time()
            if isinstance(requests, Pipeline):
                link.transport.write(requests.encoded_for(self))
            else:
                link.transport.write(b"".join(self._encode(method, path, body)
                                              for method, path, body in requests))
            try:
                await self._wait_all(link, answers.future, timeout_s)
                link.gate = None
                self.answered_at = loop.time()
                if link.usable():
                    self._idle.append(link)
                return answers.results
            except asyncio.CancelledError:
                # Drop the connection: the engine sees the client go away and aborts what it runs (as
                # SGLang does), and no later answer can be matched to another caller's request.
                link.fail(EngineHTTPTransportError(f"{self.url}: the caller was cancelled"))
                if answers.future.done() and not answers.future.cancelled():
                    answers.future.exception()
                raise
            except EngineHTTPTransportError:
                answered = len(answers.results)
                if answers.future.done() and not answers.future.cancelled():  # read, so asyncio does not log it
                    answers.future.exception()
                else:
                    answers.future.add_done_callback(_read_outcome)
                if (attempt == 1 and reused and not answered and link.closed_early
                        and loop.time() - sent_at < IDLE_CLOSE_RACE_S):
                    continue
                raise
        raise AssertionError("unreachable")

    async def _wait_all(self, link: _Link, answered: asyncio.Future[list[tuple[int, bytes]]], timeout_s: float) -> None:
        """Until every answer is in (`answered` done), one wake-up per exchange (not per response);
        EngineHTTPTransportError when the connection fails or `timeout_s` passes without any answer (the link is
        dropped then)."""
        loop = asyncio.get_running_loop()
        link.last_answer_at = loop.time()
        while not answered.done():
            if link.held is not None:  # answers wait unread until the gate opens: no timeout meanwhile
                await asyncio.wait((answered, link.held))
                link.last_answer_at = loop.time()
                continue
            await asyncio.wait((answered,), timeout=max(0.0, link.last_answer_at + timeout_s - loop.time()))
            if not answered.done() and link.held is None and loop.time() - link.last_answer_at >= timeout_s:
                error = EngineHTTPTransportError(f"{self.url}: no answer within {timeout_s:g} s")
                link.fail(error)
                raise error
        error = answered.exception()
        if error is not None:
            raise error

    def body_head(self, method: str, path: str) -> bytes:
        """This engine's head of a request with a body, up to the digits of its Content-Length (kept)."""
        key = (method, path, "")
        head = self._encoded.get(key)
        if head is None:
            encoded = encode_request(method, path, self.host_header, self.auth, b"")
            head = self._encoded[key] = encoded[:-len(b"0\r\n\r\n")]
        return head

    async def request(self, method: str, path: str, body: bytes | None, timeout_s: float) -> tuple[int, bytes]:
        return (await self.exchange([(method, path, body)], timeout_s))[0]

    def progress_at(self) -> float:
        """Event-loop time this engine last showed life: an exchange completed, or an answer arrived on one
        of its connections."""
        return max([self.answered_at, *(link.answer_seen_at for link in self._links)])

    def close(self) -> None:
        for link in list(self._links):
            if link.transport is not None:
                link.transport.close()
        self._links.clear()
        self._idle.clear()


def _length_and_body(body: bytes) -> bytes:
    """What follows a request's `body_head` (which ends in "Content-Length: "): the length, the blank line, the body."""
    return b"%d\r\n\r\n%s" % (len(body), body)


class Pipeline:
    """Requests written back to back to each of many engines (a weight update's begin, its buckets and end, to
    1,024 engines): each request's Content-Length line and body are encoded once, here, and an engine's bytes
    are its heads (its Host) and these tails joined in one step (`encoded_for`), not one encoding per request
    per engine. Every request has a body (b"" for none)."""

    __slots__ = ("keys", "tails")

    def __init__(self, requests: list[tuple[str, str, bytes]]) -> None:
        self.keys = tuple((method, path) for method, path, _ in requests)
        self.tails = [_length_and_body(body) for _, _, body in requests]

    def __len__(self) -> int:
        return len(self.tails)

    def encoded_for(self, connection: EngineConnection) -> bytes:
        """The requests' bytes to `connection`'s engine."""
        heads = connection._pipeline_heads.get(self.keys)
        if heads is None:
            if len(connection._pipeline_heads) >= 8:  # (a run sends one or two shapes of pipeline)
                connection._pipeline_heads.clear()
            heads = connection._pipeline_heads[self.keys] = [connection.body_head(method, path)
                                                             for method, path in self.keys]
        parts: list[bytes] = [b""] * (2 * len(self.tails))
        parts[0::2] = heads
        parts[1::2] = self.tails
        return b"".join(parts)


class _Answers:
    """The answers of one exchange, in order, behind one Future (not one per request: a weight update pipelines 18
    on each of 1,024 engines). It stands in its connection's queue once per request; the connection calls
    `set_result` per answer and `set_exception` when it fails."""

    __slots__ = ("future", "results", "expected")

    def __init__(self, future: asyncio.Future[list[tuple[int, bytes]]], expected: int) -> None:
        self.future = future
        self.results: list[tuple[int, bytes]] = []
        self.expected = expected

    def done(self) -> bool:
        return self.future.done()

    def cancelled(self) -> bool:
        return self.future.cancelled()

    def set_result(self, response: tuple[int, bytes]) -> None:
        if not self.future.done():
            self.results.append(response)
            if len(self.results) == self.expected:
                self.future.set_result(self.results)

    def set_exception(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)


class _RoundRequest:
    """One request of a `RequestRound` in its connection's queue, where an exchange puts a Future: the
    connection calls `set_result` or `set_exception` once, and the round counts it."""

    __slots__ = ("round", "connection", "link", "outcome")

    def __init__(self, round_: RequestRound, connection: EngineConnection, link: _Link) -> None:
        self.round, self.connection, self.link = round_, connection, link
        self.outcome: tuple[int, bytes] | Exception | None = None

    def done(self) -> bool:
        return self.outcome is not None

    def cancelled(self) -> bool:
        return False

    def set_result(self, response: tuple[int, bytes]) -> None:
        self.outcome = response
        connection, link = self.connection, self.link
        connection.answered_at = asyncio.get_running_loop().time()
        if link.usable() and not link.waiting:
            connection._idle.append(link)
        self.round._answered()

    def set_exception(self, error: BaseException) -> None:
        self.outcome = error if isinstance(error, Exception) else EngineHTTPTransportError(str(error))
        self.round._answered()


class RequestRound:
    """One small request to each of many engines at once (a health round over 1,024 engines), each on a kept-alive
    connection that is open and idle, with no coroutine, task or Future per engine: the answers are counted as
    they are read and the round waits once. The per-call path (`EngineConnection.exchange`) cost ~80-100 us of
    the loop per /health probe, most of it asyncio's machinery around one answer (bench_scale N=1,024: the
    probes were the largest per-engine item of the loop's profile). An engine with no idle connection (none
    opened yet, or every one busy) is not sent to (`send` says so): the caller uses the per-call path for it.
    Same rules as an exchange: an answer is (status, body); a connection that fails or closes gives its error;
    no answer within the timeout drops the connection (a late answer would be matched to the next request)."""

    def __init__(self) -> None:
        self.requests: dict[str, _RoundRequest] = {}
        self._pending = 0
        self._all: asyncio.Future[None] | None = None
        self.timed_out: set[str] = set()
        """URLs whose answer did not come within the round's timeout."""

    def send(self, connection: EngineConnection, method: str, path: str) -> bool:
        """Write the request on an idle connection of `connection` now; False (nothing sent) when it has none."""
        link = connection._idle_link()
        if link is None:
            return False
        assert link.transport is not None
        request = _RoundRequest(self, connection, link)
        link.waiting.append(request)  # type: ignore[arg-type]  (a Future's stand-in: done/set_result/set_exception)
        link.requests_sent += 1
        link.gate = None
        link.transport.write(connection.encoded(method, path))
        self.requests[connection.url] = request
        self._pending += 1
        return True

    def _answered(self) -> None:
        self._pending -= 1
        if self._pending <= 0 and self._all is not None and not self._all.done():
            self._all.set_result(None)

    async def wait(self, timeout_s: float) -> dict[str, tuple[int, bytes] | Exception]:
        """Every request's (status, body) or error, by URL, once all answered or `timeout_s` passed."""
        if self._pending > 0:
            self._all = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._all, timeout_s)
            except TimeoutError:
                for url, request in self.requests.items():
                    if not request.done():
                        self.timed_out.add(url)
                        request.link.fail(EngineHTTPTransportError(f"{url}: no answer within {timeout_s:g} s"))
        return {url: request.outcome for url, request in self.requests.items()
                if request.outcome is not None}


def _read_outcome(future: asyncio.Future[tuple[int, bytes]]) -> None:
    if not future.cancelled():
        future.exception()


class EngineConnections:
    """The controller's admin connections: one `EngineConnection` per engine URL."""

    def __init__(self, *, api_key: str | None = None, max_connecting: int = DEFAULT_MAX_CONNECTING) -> None:
        self.api_key = api_key
        self._connecting = asyncio.Semaphore(max_connecting)
        self._connections: dict[str, EngineConnection] = {}

    def to(self, url: str) -> EngineConnection:
        """The connection to `url` (created on first use)."""
        url = url.rstrip("/")
        connection = self._connections.get(url)
        if connection is None:
            connection = self._connections[url] = EngineConnection(url, api_key=self.api_key,
                                                                   connecting=self._connecting)
        return connection

    def forget(self, url: str) -> None:
        """Close and drop the connection to `url` (an engine that failed or restarted)."""
        connection = self._connections.pop(url.rstrip("/"), None)
        if connection is not None:
            connection.close()

    async def close(self) -> None:
        for connection in self._connections.values():
            connection.close()
        self._connections.clear()
