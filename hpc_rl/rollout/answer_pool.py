"""/generate exchanges made and answers parsed in worker processes, handed back as compact token arrays
(`rollout.answer_parse_workers`).

Owns `AnswerPool`, the processes that post the controller's /generate requests to the engines and parse the
answers (their program and the parse, `compact_answers`, are answer_workers.py's).

Why: at full response length (a median 2,500 tokens, 144 kB of JSON per sample with log-probs) parsing the
answers was most of the coordinating process's CPU (bench_scale, N=64, token scale 1: orjson.loads ~1.8
and the log-probs ~0.5 of ~5 CPU s per 1,000 samples, profiled); then, with the parse in workers, reading
the bodies and handing them over was (docs/scaling.md). A worker makes the whole exchange on its own
keep-alive connections and sends back two flat arrays per sample (~20 kB of machine numbers: int32 ids and
float32 log-probs where exact, data/column_forms.py) and the rest of the answer as JSON. What a run does is
unchanged: the same request bytes, the same answers (same tokens, the same log-prob values, a JSON integer
log-prob coming back as the equal float), the same errors
(a transport failure, a 4xx or 5xx with the engine's body, a body that is not JSON); an answer whose token
ids or log-probs are not plain numbers keeps its lists, so generate.py's handling of malformed answers
applies as before. The controller still decides everything else (which engine, rids, aborts, retries);
its aborts go out through the same worker (`parse=False`), on that worker's warm connections to the engine (from
the controller's own, which no longer carry /generate, an abort of 1,024 engines opened 1,024 connections:
14 s of fan-out at load ~25 against 1.7 s), and the fleet's admin calls on the fleet's connections. The fleet's
health rounds are probed in the workers too (`probe_health`: one frame per worker and round, worker_probes.py).

Each engine's requests go to one worker (its connections stay warm). A worker that dies fails the
requests it held as transport failures (the samples retry them) and is started again for the next.
Workers are spawned processes of the same job; the frames between them travel over a local socketpair,
JSON and raw numbers only, no pickle.

Does not own: the HTTP exchange's rules (hpc_rl.protocol.http_client), which request goes where
(engine_client.py), what an answer means (generate.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import socket
import zlib
from array import array
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from hpc_rl.protocol.http_client import EngineHTTPTransportError
from hpc_rl.rollout.answer_workers import (
    PREFIX,
    AnswerNotJSON,
    array_targets,
    encode_frame,
    join_arrays,
    place_arrays,
)

log = logging.getLogger(__name__)

HEALTH_GRACE_S = 5.0
"""A worker's health round answers within two probe timeouts (the round, then a retry per call) and this."""


class FrameStream(Protocol):
    """Where the frames of a request answered by several frames go (`AnswerPool.send_streams`)."""

    def frame(self, header: dict[str, Any], payload: memoryview) -> None: ...

    def ended(self, error: Exception) -> None:
        """The worker ended before the frame that says "end"."""


class _FrameReader(asyncio.BufferedProtocol):
    """The controller's end of a worker's socketpair. Each frame's prefix and JSON header are received into
    buffers of their size; an answer's payload (its token ids and log-probs, `arrays` in the header) straight
    into the arrays the samples keep (answer_workers.array_targets: no frame buffer, no second copy), any
    other payload into a buffer of its size. asyncio's StreamReader appended to one buffer and cut frames out
    of it: two more copies of every answer, ~15% of the loop's profile.

    asyncio hands out one buffer per read, and a read per event-loop turn: a frame of a header and 16 arrays
    would take 18 turns. So once asyncio has read a frame's prefix, the rest of the frame that is already in
    the socket is read from this protocol's callback: the header with one read, the payload's arrays with one
    scatter read (`recvmsg_into`); what is not there yet, asyncio's next read gets into the buffer being filled.
    End of file and errors are left to asyncio's own read of the socket (`connection_lost`)."""

    SCATTER = 512
    """Arrays per scatter read at most (under the kernel's IOV_MAX of 1,024)."""

    def __init__(self, worker: "_Worker") -> None:
        self.worker = worker
        self.transport: asyncio.Transport | None = None
        self.sock: socket.socket | None = None
        """The socket the transport reads (set by the pool), for the reads made here; None: asyncio's reads only."""
        self._prefix = bytearray(PREFIX.size)
        self._target = memoryview(self._prefix)
        self._filled = 0
        self._stage = 0  # 0: the prefix, 1: the header, 2: the payload
        self._size = 0
        self._header: dict[str, Any] = {}
        self._payload: bytearray | list[array] = bytearray()
        self._views: list[memoryview] = []  # the payload's arrays still to fill (bytes views), the target first

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        while self._filled >= self._target.nbytes and self._advance() and self._pull():
            pass

    def _advance(self) -> bool:
        """The target is full: on to the next one (delivering a finished frame). False when the frame was delivered
        (the next prefix is left to asyncio's read: frames come a while apart)."""
        if self._stage == 0:
            head_size, self._size = PREFIX.unpack(self._prefix)
            self._stage, self._target, self._filled = 1, memoryview(bytearray(head_size)), 0
            return True
        if self._stage == 1:
            self._header = orjson.loads(self._target)
            self._stage = 2
            if self._size == 0:
                return self._deliver(b"")
            arrays = array_targets(self._header["arrays"], self._size) if "arrays" in self._header else None
            if arrays is None:
                self._payload = bytearray(self._size)
                self._target, self._filled = memoryview(self._payload), 0
                return True
            self._payload = arrays
            self._views = [view for view in (memoryview(values).cast("B") for values in arrays) if view.nbytes]
        elif not self._views:  # a payload of bytes, all here
            return self._deliver(self._payload)
        else:
            self._views.pop(0)
        if not self._views:
            return self._deliver(self._payload)
        self._target, self._filled = self._views[0], 0
        return True

    def _pull(self) -> bool:
        """Read what the socket holds now into the target (and, in a payload of arrays, the arrays after it); True
        when the target was filled."""
        sock = self.sock
        if sock is None:
            return False
        views = self._views
        try:
            if views:
                batch = views[:self.SCATTER]
                batch[0] = batch[0][self._filled:]
                nbytes = sock.recvmsg_into(batch)[0]
            else:
                nbytes = sock.recv_into(self._target[self._filled:])
        except OSError:  # BlockingIOError: nothing there yet; anything else: asyncio's own read meets it too
            return False
        if nbytes == 0:
            return False  # end of file: the same
        filled = self._filled + nbytes
        if views:  # whole arrays filled go (the last one filled stays the target: `_advance` takes it)
            while len(views) > 1 and filled >= (size := views[0].nbytes):
                filled -= size
                views.pop(0)
            self._target = views[0]
        self._filled = filled
        return filled >= self._target.nbytes

    def _deliver(self, payload: bytes | bytearray | list[array]) -> bool:
        header = self._header
        self._target, self._filled, self._stage = memoryview(self._prefix), 0, 0
        self._header, self._payload, self._views = {}, bytearray(), []
        self.worker.answered(header, payload)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._views, self._payload = [], bytearray()
        self.worker.ended(exc)


class _Worker:
    """One spawned worker process and the controller's end of its socketpair."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.pending: dict[int, asyncio.Future[tuple[dict[str, Any], Any]]] = {}
        self.streams: dict[int, FrameStream] = {}
        """Requests answered by several frames (`AnswerPool.send_streams`), by id."""
        self.alive = True
        self.reader = _FrameReader(self)

    def send(self, frame: list[Any]) -> None:
        assert self.reader.transport is not None
        self.reader.transport.writelines(frame)

    def answered(self, header: dict[str, Any], payload: bytes | bytearray | list[array]) -> None:
        stream = self.streams.get(header["id"])
        if stream is not None:
            if header.get("end"):
                del self.streams[header["id"]]
            stream.frame(header, payload)
            return
        future = self.pending.pop(header["id"], None)
        if future is not None and not future.done():
            future.set_result((header, payload))

    def ended(self, error: Exception | None) -> None:
        """The socketpair closed (the worker died, or `close`): fail what it held."""
        self.alive = False
        code = self.process.exitcode if self.process.exitcode is not None else "running"
        message = (f"the answer worker (pid {self.process.pid}, exit {code}) ended before answering"
                   + (f" ({error})" if error else ""))
        for future in self.pending.values():
            if not future.done():
                future.set_exception(EngineHTTPTransportError(message))
        self.pending.clear()
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.ended(EngineHTTPTransportError(message))

    def close(self) -> None:
        if self.reader.transport is not None:
            self.reader.transport.close()


class AnswerPool:
    """`workers` processes posting /generate requests and parsing the answers; `await post(...)` per request."""

    def __init__(self, workers: int, *, api_key: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"rollout.answer_parse_workers: an answer pool needs at least one worker, got {workers}")
        self.workers = workers
        self.api_key = api_key
        """The engines' key (`Authorization: Bearer`), handed to each worker over its socketpair."""
        self.parsed_in_workers = 0
        """Answers the workers sent back."""
        self.restarts = 0
        """Workers started again after one ended."""
        self._slots: list[_Worker | None] = [None] * workers
        self._starting: list[asyncio.Future[_Worker] | None] = [None] * workers
        self._home: dict[str, int] = {}
        self._ids = itertools.count()

    async def start(self) -> None:
        """Start every worker (a spawned interpreter: well under a second each, in parallel)."""
        await asyncio.gather(*(self._worker(index) for index in range(self.workers)))

    def pids(self) -> list[int]:
        """The workers running now."""
        return [worker.process.pid for worker in self._slots if worker is not None and worker.alive]

    async def _worker(self, index: int) -> _Worker:
        worker = self._slots[index]
        if worker is not None and worker.alive:
            return worker
        starting = self._starting[index]
        if starting is None:
            starting = self._starting[index] = asyncio.ensure_future(self._spawn(index, restart=worker is not None))
            starting.add_done_callback(lambda _: self._starting.__setitem__(index, None))
        return await asyncio.shield(starting)

    async def _spawn(self, index: int, *, restart: bool) -> _Worker:
        from hpc_rl.rollout.answer_workers import worker_main

        ours, theirs = socket.socketpair()
        process = multiprocessing.get_context("spawn").Process(target=worker_main, args=(theirs, self.api_key),
                                                                name=f"hpc_rl-answers-{index}", daemon=True)
        await asyncio.to_thread(process.start)  # the spawn writes the child's start data: off the loop
        theirs.close()
        worker = _Worker(process)
        worker.reader.sock = ours
        await asyncio.get_running_loop().create_unix_connection(lambda: worker.reader, sock=ours)
        self._slots[index] = worker
        if restart:
            self.restarts += 1
            log.warning("answer worker %d ended; started again (pid %d)", index, process.pid)
        return worker

    async def post(self, url: str, path: str, body: bytes, timeout_s: float, *, parse: bool = True,
                   score: dict[str, Any] | None = None) -> tuple[int, Any]:
        """POST `body` to `url + path` from a worker: (200, the answer with compact token arrays) or (status,
        the engine's raw body) for any other status, or for any status when not `parse` (a control call: an
        abort goes out on the worker's warm connections to that engine). EngineHTTPTransportError as the
        controller's own client raises it (and when the worker ended); AnswerNotJSON for a 200 body that is
        not JSON. `score` (worker_rewards.score_header): the worker also scores the answers' rule rewards."""
        url = url.rstrip("/")
        index = self.home(url)
        worker = self._slots[index]
        if worker is None or not worker.alive:
            worker = await self._worker(index)
        request_id = next(self._ids)
        future: asyncio.Future[tuple[dict[str, Any], bytes]] = asyncio.get_running_loop().create_future()
        worker.pending[request_id] = future
        head = {"op": "post", "id": request_id, "url": url, "path": path, "timeout_s": timeout_s, "parse": parse}
        if score is not None:
            head["score"] = score
        worker.send(encode_frame(head, [body]))
        try:
            header, payload = await future
        except asyncio.CancelledError:
            worker.pending.pop(request_id, None)
            if worker.alive:  # the worker drops the connection, as the controller's client does when cancelled
                worker.send(encode_frame({"op": "cancel", "id": request_id}))
            raise
        if "error" in header:
            raise EngineHTTPTransportError(header["error"])
        if "not_json" in header:
            raise AnswerNotJSON(header["not_json"])
        if header.get("raw"):
            return header["status"], bytes(payload)
        self.parsed_in_workers += 1
        if isinstance(payload, list):  # received straight into its arrays (_FrameReader)
            return 200, place_arrays(header["body"], header["arrays"], payload)
        return 200, join_arrays(header["body"], header["arrays"], payload)

    async def probe_health(self, urls: list[str], timeout_s: float, concurrency: int = 64) -> list[bool | None]:
        """One health round over `urls` in the workers (worker_probes.py): ONE frame to each worker for the engines
        it is home to (their /generate connections are warm there), one frame back. Per engine: whether it is
        healthy, or None where no worker answered (none running now, the pool closed, the worker ended or did not
        answer within two timeouts and HEALTH_GRACE_S): the caller probes those itself, so a worker's end never
        makes an engine look dead. An engine without a home (no /generate yet) is probed by a worker chosen from its
        URL (the same each round) and gets no home here: the posts' homes are spread as without health rounds."""
        verdicts: list[bool | None] = [None] * len(urls)
        groups: dict[int, list[int]] = {}
        for position, url in enumerate(urls):
            url = url.rstrip("/")
            home = self._home.get(url)
            if home is None:
                home = zlib.crc32(url.encode()) % self.workers
            groups.setdefault(home, []).append(position)
        loop = asyncio.get_running_loop()

        async def ask(worker: _Worker, positions: list[int]) -> None:
            request_id = next(self._ids)
            future: asyncio.Future[tuple[dict[str, Any], bytes]] = loop.create_future()
            worker.pending[request_id] = future
            worker.send(encode_frame({"op": "health", "id": request_id, "urls": [urls[p] for p in positions],
                                      "timeout_s": timeout_s, "concurrency": concurrency}))
            try:
                header, _ = await asyncio.wait_for(future, 2 * timeout_s + HEALTH_GRACE_S)
            except (EngineHTTPTransportError, TimeoutError) as error:
                log.warning("health round of %d engine(s) in answer worker pid %d: %s; the controller probes them",
                            len(positions), worker.process.pid, error or "no answer")
                return
            finally:
                worker.pending.pop(request_id, None)
            unhealthy = set(header["unhealthy"])
            for rank, position in enumerate(positions):
                verdicts[position] = rank not in unhealthy

        asks = [ask(worker, positions) for home, positions in groups.items()
                if (worker := self._slots[home]) is not None and worker.alive]
        await asyncio.gather(*asks)
        return verdicts

    def home(self, url: str) -> int:
        """The worker that makes `url`'s exchanges (each engine has one: its connections stay warm)."""
        return self._home.setdefault(url.rstrip("/"), len(self._home) % self.workers)

    async def send_streams(self, sends: list[tuple[int, dict[str, Any], list[bytes], FrameStream]]
                           ) -> list[Callable[[], None]]:
        """For each (worker index, head, payload, stream): send `head` (an op answered by several frames:
        worker_fanout.py's "pipeline") and `payload` to that worker; each frame back goes to `stream.frame` until
        one says "end", or `stream.ended` hears why the worker ended first. Every worker is started (again) before
        anything is sent: when one cannot be, this raises and nothing went out. Returns what cancels each (the
        worker drops what it still runs)."""
        workers = await asyncio.gather(*(self._worker(index) for index, _, _, _ in sends))
        return [self._send_stream(worker, head, payload, stream)
                for worker, (_, head, payload, stream) in zip(workers, sends)]

    def _send_stream(self, worker: _Worker, head: dict[str, Any], payload: list[bytes],
                     stream: FrameStream) -> Callable[[], None]:
        request_id = next(self._ids)
        worker.streams[request_id] = stream
        if not worker.alive:  # ended as it started: it will send nothing
            worker.ended(None)
        else:
            worker.send(encode_frame({**head, "id": request_id}, payload))

        def cancel() -> None:
            if worker.streams.pop(request_id, None) is not None and worker.alive:
                worker.send(encode_frame({"op": "cancel", "id": request_id}))
        return cancel

    def close(self) -> None:
        """Stop the workers now (requests in flight are abandoned: their callers hear a transport error)."""
        workers = [worker for worker in self._slots if worker is not None]
        self._slots = [None] * self.workers
        for worker in workers:
            worker.close()
            worker.ended(EngineHTTPTransportError("the answer pool was closed"))
        for worker in workers:
            worker.process.terminate()
        for worker in workers:
            worker.process.join(timeout=5)
