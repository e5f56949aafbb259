"""Admin fan-outs made by the answer workers: one frame hands a worker the same pipelined requests for every engine
it is home to (a weight update's begin, buckets and end), the worker makes the exchanges on its own connections,
reads the answers and sends back a few batched frames of outcomes (`rollout.answer_parse_workers`).

Owns both halves of the "pipeline" op of the answer pool's frames (answer_workers.py has the frame format):
- controller to worker, once per worker and fan-out: `{"op": "pipeline", "id", "urls", "requests": [[method, path,
  body bytes], ...], "timeout_s"}` with the request bodies, in order, as payload (sent once, not once per engine);
  or, for one request whose body differs per engine (/init_weights_update_group's rank offset), `"own": [body
  bytes per url]` with those bodies as payload;
  `{"op": "cancel", "id"}` drops the engines' exchanges still running (their connections close, as the
  controller's own client does when cancelled);
- worker to controller, batched (at most one frame per FLUSH_S while outcomes come, and one per PROGRESS_S
  while the engines are silent): `{"id", "ok": [positions], "failed": [{"at": position, "request": index,
  "status": HTTP status, "body": the answer's first 500 bytes as text} or {"at": position, "error": the transport
  error}], "progress": seconds since the latest answer of its engines still updating, "end": true on the last}`.
  Positions index `urls`. JSON only, over the pool's socketpair.
The worker reads the answers in waves as the controller's own fan-out does (transports.fanout: a shut ReadGate
for every engine but the first, opened every GATE_PERIOD_S, when the first is done, or for good once one fails).

Why: at 1,024 engines a weight update is 18 answers per engine (~18,400 per sync) that the coordinating process
parsed on its loop, plus a Future, a coroutine and a read per engine: ~0.1 CPU-s per sync (bench_scale's
syncCPU). Through the workers it reads a few frames per sync.

Controller side: `PipelineFanOut` (sends the frames, hands each engine's outcome and the workers' progress to
its caller, and fails the engines of a worker that ends as transport failures). Does not own: what the
requests mean or what a failure does to the sync (controller.transports.fanout, fanout_workers), the pool's
processes (answer_pool.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from hpc_rl.protocol.http_client import EngineConnections, EngineHTTPTransportError, Pipeline, ReadGate

SendFrame = Callable[[dict[str, Any]], None]
"""Writes one frame (a header, no payload) to the controller (answer_workers' framing: this module is imported
by answer_workers, so it does not import it)."""

GATE_PERIOD_S = 5.0
"""During a weight update (transports.fanout's, on the loop or in a worker), the engines other than the first have
their answers read at least this often (and when the first engine is done): an engine's failure is named at most
this late. (A failed engine stalls every engine's broadcast anyway; at 1.0 s the 10 s syncs of 1,024 simulated
engines read each engine ~10 times: 0.58-1.01 controller CPU s per sync against 0.42-0.64 at 5 s,
bench_admin_fanout.)"""
FLUSH_S = 0.02
"""Outcomes that come within this long go back in one frame (a wave of answers is read in one go)."""
PROGRESS_S = 0.5
"""While engines still update, the latest answer's age goes back at least this often when it changed (the
controller's stuck-engine watch wakes every 5 s and acts on 5 s of silence: it sees it at most this late)."""
BODY_HEAD = 500
"""Bytes of a failed answer's body sent back (what the controller's error message quotes)."""

Outcome = tuple[int, str, int, str] | None
"""An engine's outcome as the controller gets it: None when every answer was 200; ("status", request index,
HTTP status, body head) for the first answer that was not; ("transport", -1, 0, the error) when there was no
answer."""


# -- the worker's half ------------------------------------------------------------------------------------
class _Run:
    """One pipeline op in a worker: every engine's exchange, their outcomes batched back, progress reported."""

    def __init__(self, engines: EngineConnections, send: SendFrame, header: dict[str, Any], payload: bytes) -> None:
        self.engines, self.send, self.id = engines, send, header["id"]
        self.urls: list[str] = header["urls"]
        requests, offset = [], 0
        view = memoryview(payload)
        for method, path, size in header["requests"]:
            requests.append((method, path, bytes(view[offset:offset + size])))
            offset += size
        self.pipeline = Pipeline(requests)
        self.own: list[Pipeline] | None = None
        """With "own" (one request, a body per engine): each engine's."""
        if "own" in header:
            (method, path, _), = header["requests"]
            self.own = []
            for size in header["own"]:
                self.own.append(Pipeline([(method, path, bytes(view[offset:offset + size]))]))
                offset += size
        self.timeout_s: float = header["timeout_s"]
        self.ok: list[int] = []
        self.failed: list[dict[str, Any]] = []
        self.waiting = set(range(len(self.urls)))
        self.flush_handle: asyncio.TimerHandle | None = None
        self.broken = False
        """An engine failed: the gate stays open (the others' answers are read as they come, as the sync breaks)."""
        self.gate = ReadGate()
        self.sent_latest = float("-inf")
        """The latest answer time (this worker's loop clock) the controller was told of."""
        self.loop = asyncio.get_running_loop()
        self.started = self.loop.time()

    async def run(self) -> None:
        gate = self.gate
        if len(self.urls) > 1:
            gate.shut()
        tasks = [asyncio.ensure_future(self._one(position, gate if position else None))
                 for position in range(len(self.urls))]
        every = asyncio.gather(*tasks)
        reporter = asyncio.ensure_future(self._report_progress())
        try:
            while not every.done():
                await asyncio.wait((every, tasks[0]), timeout=GATE_PERIOD_S, return_when=asyncio.FIRST_COMPLETED)
                gate.open()  # read what came; shut again until the first engine is done (or one failed)
                if tasks[0].done() or self.broken:
                    break
                gate.shut()
            await every
        finally:
            gate.open()
            reporter.cancel()
            for task in tasks:
                task.cancel()  # (a cancel op: each exchange drops its connection)
        self._flush(end=True)

    async def _one(self, position: int, gate: ReadGate | None) -> None:
        try:
            pipeline = self.own[position] if self.own is not None else self.pipeline
            answers = await self.engines.to(self.urls[position]).exchange(pipeline, self.timeout_s, gate=gate)
        except EngineHTTPTransportError as error:
            self._outcome(position, {"at": position, "error": str(error)})
            return
        except Exception as error:  # (a URL the client cannot use): the engine's outcome, not a silent worker
            self._outcome(position, {"at": position, "error": f"{self.urls[position]}: {error!r}"})
            return
        for index, (status, body) in enumerate(answers):
            if status != 200:
                self._outcome(position, {"at": position, "request": index, "status": status,
                                         "body": body[:BODY_HEAD].decode(errors="replace")})
                return
        self._outcome(position, None)

    def _outcome(self, position: int, failure: dict[str, Any] | None) -> None:
        self.waiting.discard(position)
        if failure is None:
            self.ok.append(position)
        else:
            self.failed.append(failure)
            self.broken = True
            self.gate.open()
        if self.flush_handle is None:
            self.flush_handle = self.loop.call_later(FLUSH_S, self._flush)

    def _progress(self, header: dict[str, Any]) -> bool:
        """Put the age of the latest answer of an engine still updating (the start when none answered) into
        `header` when it is news to the controller."""
        if not self.waiting:
            return False
        latest = max([self.started, *(self.engines.to(self.urls[p]).progress_at() for p in self.waiting)])
        if latest <= self.sent_latest:
            return False
        self.sent_latest = latest
        header["progress"] = round(self.loop.time() - latest, 4)
        return True

    def _flush(self, *, end: bool = False) -> None:
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        if not (self.ok or self.failed or end):
            return
        header: dict[str, Any] = {"id": self.id, "ok": self.ok, "failed": self.failed}
        if end:
            header["end"] = True
        else:
            self._progress(header)
        self.ok, self.failed = [], []
        self.send(header)

    async def _report_progress(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_S)
            header: dict[str, Any] = {"id": self.id, "ok": [], "failed": []}
            if self._progress(header):
                self.send(header)


async def run_pipeline(engines: EngineConnections, send: SendFrame, header: dict[str, Any], payload: bytes) -> None:
    """Serve one "pipeline" op (answer_workers._serve's dispatch). However it ends short of a cancel, every
    engine gets an outcome and the last frame says "end": the controller never waits on a worker's bug."""
    run = _Run(engines, send, header, payload)
    try:
        await run.run()
    except Exception as error:
        run.failed += [{"at": position, "error": f"the answer worker's fan-out failed: {error!r}"}
                       for position in sorted(run.waiting)]
        run.waiting.clear()
        run._flush(end=True)


# -- the controller's half --------------------------------------------------------------------------------
class Workers(Protocol):
    """What the fan-out needs of the answer pool (answer_pool.AnswerPool)."""

    def home(self, url: str) -> int: ...

    def send_streams(self, sends: list[tuple[int, dict[str, Any], list[bytes], Any]]
                     ) -> Awaitable[list[Callable[[], None]]]: ...


class PipelineFanOut:
    """The same pipelined requests to every engine in `urls`, made by the answer workers (each engine's by the
    worker it is home to). `on_outcome(position, outcome)` is called once per engine (`Outcome`), also with a
    transport failure for each engine of a worker that ended first; `on_progress(positions, at)` says the
    latest answer of those engines still updating came at event-loop time `at`."""

    def __init__(self, pool: Workers, urls: list[str], requests: list[tuple[str, str, bytes]], timeout_s: float, *,
                 on_outcome: Callable[[int, Outcome], None], on_progress: Callable[[list[int], float], None],
                 own_bodies: list[bytes] | None = None) -> None:
        if own_bodies is not None and (len(requests) != 1 or len(own_bodies) != len(urls)):
            raise ValueError("own_bodies: one request, and one body per engine")
        self.pool, self.urls, self.timeout_s = pool, urls, timeout_s
        self.requests, self.own_bodies = requests, own_bodies
        """`own_bodies`: each engine's body of the one request (its body in `requests` is not sent)."""
        self.on_outcome, self.on_progress = on_outcome, on_progress
        self.pending: set[int] = set()
        self._cancels: list[Callable[[], None]] = []

    async def start(self) -> None:
        """One frame to each worker with engines among `urls` (none when one of them cannot be started)."""
        homes: dict[int, list[int]] = {}
        for position, url in enumerate(self.urls):
            homes.setdefault(self.pool.home(url), []).append(position)
        own = self.own_bodies
        specs = [[method, path, 0 if own is not None else len(body)] for method, path, body in self.requests]
        bodies = [body for _, _, body in self.requests] if own is None else []
        self.pending = set(range(len(self.urls)))
        sends = []
        for worker, positions in homes.items():
            head: dict[str, Any] = {"op": "pipeline", "urls": [self.urls[p] for p in positions], "requests": specs,
                                    "timeout_s": self.timeout_s}
            if own is not None:
                bodies = [own[p] for p in positions]
                head["own"] = [len(body) for body in bodies]
            sends.append((worker, head, bodies, _Receiver(self, positions)))
        self._cancels = await self.pool.send_streams(sends)  # (raises, with nothing sent, if a worker cannot start)

    def cancel(self) -> None:
        """Drop the exchanges still running in the workers (their engines get no outcome). With none running,
        nothing is sent (the workers' last frames are on their way)."""
        cancels, self._cancels = self._cancels, []
        if self.pending:
            self.pending.clear()
            for cancel in cancels:
                cancel()

    def _outcome(self, position: int, outcome: Outcome) -> None:
        if position in self.pending:
            self.pending.discard(position)
            self.on_outcome(position, outcome)


class _Receiver:
    """One worker's frames of a `PipelineFanOut` (positions: the fan-out's, of that worker's `urls`)."""

    def __init__(self, fan_out: PipelineFanOut, positions: list[int]) -> None:
        self.fan_out, self.positions = fan_out, positions

    def frame(self, header: dict[str, Any], payload: memoryview) -> None:
        positions, fan_out = self.positions, self.fan_out
        for at in header["ok"]:
            fan_out._outcome(positions[at], None)
        for failure in header["failed"]:
            if "error" in failure:
                fan_out._outcome(positions[failure["at"]], ("transport", -1, 0, failure["error"]))
            else:
                fan_out._outcome(positions[failure["at"]],
                                 ("status", failure["request"], failure["status"], failure["body"]))
        if "progress" in header:
            fan_out.on_progress(positions, asyncio.get_running_loop().time() - header["progress"])

    def ended(self, error: Exception) -> None:
        """The worker ended before its last frame: each of its engines still pending fails as a transport failure."""
        for position in self.positions:
            self.fan_out._outcome(position, ("transport", -1, 0, str(error)))
