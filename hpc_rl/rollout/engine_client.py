"""HTTP client of the generation engines (SGLang or hpc_rl's CPU engine), through sglang-router or direct.

Owns: the keep-alive connections (hpc_rl.protocol.http_client, with the job's engine key as
`Authorization: Bearer`, which the router and the engines both demand), the per-engine concurrency limit (`sglang.server_concurrency`), sending one
`/generate` and classifying its outcome (answer, HTTP error, or a *transport* failure: connection
refused/reset, timeout, 5xx), the rid -> engine map of requests in flight, and the control calls that
the router does not route (`/abort_request`), which go to every engine URL of an `EngineDirectory`
(the engine list can change at run time: engines die, restart, get added).

Does not own: what a request contains or how a sample is resumed (generate.py), retry policy decisions
(generate.py), the context length and the clip to it (context_length.py, re-exported here), weight updates and pause/continue (the weights/engines side).

Batching (`batch_requests`, on by default): `generate(payload, group=...)` calls made at the same moment
(the samples of the groups a rollout submits together) are queued for one event-loop turn and sent as
batched `/generate` requests (request_batching.py: about one per engine, whole groups, at most
`per_engine_concurrency` samples each), each straight to the least-loaded engine (no router hop: the
client balances batches itself and knows each rid's engine). Each caller still gets its own answer or
error: a failed batch fails each of its samples, which retry on their own (nothing lost, nothing sent
twice). `group=None` or a payload that is not plain token ids is sent alone, as before. An engine that
answers a batch with a single answer turns batching off for the client (warned once).

Routing: with `router_url` every single (unbatched) /generate goes to the router (cache-aware routing
keeps a GRPO group on one engine) and the engine that serves its rid is unknown, so an abort of one rid
is sent to every engine (SGLang answers 200 for unknown rids). Without a router the client picks the least-loaded engine itself
and knows the engine of each rid.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from hpc_rl.protocol.http_client import EngineConnections, EngineHTTPTransportError
from hpc_rl.rollout.answer_pool import AnswerPool
from hpc_rl.rollout.answer_workers import AnswerNotJSON, compact_answers
from hpc_rl.rollout.context_length import (  # noqa: F401  (re-exported: callers import them from here)
    clip_to_context,
    context_full_answer,
    engine_context_length,
    longest_served_prompt,
)
from hpc_rl.rollout.engine_loads import EngineLoads
from hpc_rl.rollout.request_batching import BatchAnswerError, batchable, merge_payloads, plan_batches, split_answer
from hpc_rl.rewards.worker_scored import WorkerRewards
from hpc_rl.rollout.worker_rewards import score_header

if TYPE_CHECKING:
    from typing import Self  # 3.11+; annotations only

log = logging.getLogger(__name__)


class EngineDirectory(Protocol):
    """Where the engines are right now (the controller's registry implements this)."""

    def engine_urls(self) -> Sequence[str]:
        """Base URLs (``http://host:port``) of the engines that are up (a tuple may be the same object until they
        change: callers do not change what they are given)."""
        ...


class StaticEngineDirectory:
    """An `EngineDirectory` backed by a mutable list (tests, benchmarks, a fixed set of engines)."""

    def __init__(self, urls: list[str] | None = None) -> None:
        self.urls: list[str] = list(urls or [])

    def engine_urls(self) -> list[str]:
        return list(self.urls)


class TransportError(RuntimeError):
    """The request did not get an answer from a live engine (the sample must be resubmitted)."""


def _text(raw: bytes) -> str:
    return raw.decode(errors="replace")


class EngineHTTPError(RuntimeError):
    """The engine answered 4xx: the request itself is wrong (retrying will not help)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"engine answered HTTP {status}: {body[:500]}")
        self.status = status


@dataclass(kw_only=True)
class GenerateAnswer:
    """A 200 answer of /generate and which engine served it (None: the router chose)."""

    body: dict[str, Any]
    engine_url: str | None


class _Waiting:
    """What one `generate_many` call waits for: an answer or an error per payload, in order, behind one Future (a
    group's samples share it: no Future per sample)."""

    __slots__ = ("future", "outcomes", "left")

    def __init__(self, future: asyncio.Future[list[GenerateAnswer | Exception]], count: int) -> None:
        self.future = future
        self.outcomes: list[GenerateAnswer | Exception] = [_UNSET] * count  # type: ignore[list-item]
        self.left = count

    def settle(self, position: int, outcome: GenerateAnswer | Exception) -> None:
        if self.future.done() or self.outcomes[position] is not _UNSET:
            return
        self.outcomes[position] = outcome
        self.left -= 1
        if self.left == 0:
            self.future.set_result(self.outcomes)


_UNSET: Any = object()


@dataclass(eq=False)
class _Queued:
    """A single request waiting for its batch to be sent."""

    payload: dict[str, Any]
    group: int | None
    waiting: _Waiting = field(repr=False)
    position: int
    """Where its outcome goes in `waiting`."""
    reward_request: dict[str, Any] | None = None


class EngineClient:
    """Sends /generate (limited to `per_engine_concurrency` x engines in flight) and fans out aborts."""

    def __init__(self, directory: EngineDirectory, *, router_url: str | None = None,
                 per_engine_concurrency: int = 512, request_timeout_s: float = 600.0,
                 control_timeout_s: float = 10.0, api_key: str | None = None,
                 context_length: int | None = None, batch_requests: bool = True,
                 answer_pool: AnswerPool | None = None) -> None:
        self.directory = directory
        self.answer_pool = answer_pool
        """Worker processes that post the /generate requests and parse the answers into compact token arrays
        (answer_pool.py; `rollout.answer_parse_workers`), started and closed with the client; None: posted and
        parsed on the loop. Aborts go through the worker that holds the engine's /generate connections."""
        self.worker_rewards: WorkerRewards | None = None
        """Where the answer workers' rule rewards of single-turn answers are kept, when they score them
        (worker_rewards.py; set by the rollout stack when there are answer workers and no custom reward, and given
        to its RewardSpec); None: they do not."""
        self.batch_requests = batch_requests
        """Queue `generate(..., group=...)` calls of one moment into batched requests (module docstring)."""
        self.http_requests = 0
        """/generate requests posted (a batch counts once)."""
        self.answered_at: dict[str, float] = {}
        """Engine URL -> event-loop time of its last /generate answer (sent straight to it; routed ones name no
        engine): proof of life for the fleet's health checks."""
        self._queued: dict[tuple[int, int | None], tuple[asyncio.Event | None, list[_Queued]]] = {}
        self._flush_scheduled = False
        self._batch_tasks: set[asyncio.Task[None]] = set()
        self._waiting_batches = 0
        self.context_length = context_length
        """The engines' context length (`engine_context_length`): max_new_tokens is clipped to it."""
        self.router_url = router_url.rstrip("/") if router_url else None
        self.per_engine_concurrency = per_engine_concurrency
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.in_flight: dict[str, str | None] = {}
        """rid -> engine URL serving it (None when routed by the router)."""
        self.first_send_watch: dict[str, Callable[[], None]] = {}
        """Engine URL -> called (once) when the first request goes straight to it (engine jobs' joiners: the
        controller's registration -> first request time)."""
        self._loads = EngineLoads()
        """Requests in flight per engine (direct sends) and the least-loaded pick."""
        self._failed_at: dict[str, float] = {}
        self.failure_cooldown_s = 5.0
        self.waiter_poll_s = 2.0
        """Direct mode: an engine that just failed a request is picked only when no other is free."""
        self._slots = asyncio.Condition()
        self._connections: EngineConnections | None = None
        """Keep-alive connections for /generate and /abort_request (hpc_rl.protocol.http_client: ~100 us of
        controller CPU per call where aiohttp's client took ~440 us, measured at 256 engines)."""
        self._api_key = api_key
        self.lora_path: str | None = None
        """The LoRA adapter the engines serve the trainer's weights as (issue 33; set after each adapter sync):
        every /generate without its own `lora_path` asks for it. None: the engines' own weights."""

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> Self:
        if self._connections is None:
            # No client-side connection cap: the concurrency limit below is the one that matters. Idle
            # connections stay open across weight syncs and train steps (aiohttp's 15 s keep-alive
            # reopened ~2,000 router connections per rollout at 256 engines: 14% of the controller's CPU).
            self._connections = EngineConnections(api_key=self._api_key)
        if self.answer_pool is not None:
            await self.answer_pool.start()
        return self

    async def close(self) -> None:
        for task in list(self._batch_tasks):
            task.cancel()
        if self._batch_tasks:
            await asyncio.gather(*self._batch_tasks, return_exceptions=True)
        if self._connections is not None:
            await self._connections.close()
            self._connections = None
        if self.answer_pool is not None:
            self.answer_pool.close()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connections(self) -> EngineConnections:
        if self._connections is None:
            raise RuntimeError("EngineClient is not started: use 'async with EngineClient(...)' or await start()")
        return self._connections

    # -- concurrency ---------------------------------------------------------------------------------
    def capacity(self) -> int:
        """Requests allowed in flight now: the per-engine limit times the engines that are up."""
        return self.per_engine_concurrency * max(1, len(self.directory.engine_urls()))

    def _pick_engine(self, count: int = 1) -> str | None:
        """The least-loaded engine with room for `count` more requests (an idle one if `count` is over the
        limit), avoiding engines that failed in the last `failure_cooldown_s`; None if all are full (or
        none is up)."""
        now = asyncio.get_running_loop().time()
        failed_at, cooldown = self._failed_at, self.failure_cooldown_s
        room = max(1, self.per_engine_concurrency - count + 1)
        return self._loads.pick(self.directory.engine_urls(), room,
                                lambda url: now - failed_at.get(url, -1e9) < cooldown)

    async def _acquire(self, rids: list[str], stopped: asyncio.Event | None, *, direct: bool) -> str | None:
        """Wait for slots for `rids`; returns the engine (direct) or None (the router's request).
        Raises StopGeneration."""
        async with self._slots:
            while True:
                if stopped is not None and stopped.is_set():
                    raise StopGeneration()
                fits = not self.in_flight or len(self.in_flight) + len(rids) <= self.capacity()
                if not direct:
                    if fits:
                        self.in_flight.update(dict.fromkeys(rids))
                        return None
                else:
                    engine = self._pick_engine(len(rids)) if fits else None
                    if engine is not None:
                        self.in_flight.update(dict.fromkeys(rids, engine))
                        self._loads.change(engine, len(rids))
                        if self.first_send_watch and engine in self.first_send_watch:
                            self.first_send_watch.pop(engine)()
                        return engine
                # Woken one at a time per released slot (no thundering herd with thousands queued), all
                # at once by wake_waiters() or while a batch waits; the timeout is only a safety net.
                self._waiting_batches += len(rids) > 1
                try:
                    await asyncio.wait_for(self._slots.wait(), timeout=self.waiter_poll_s)
                except TimeoutError:
                    pass
                finally:
                    self._waiting_batches -= len(rids) > 1

    async def _release(self, rids: list[str]) -> None:
        async with self._slots:
            released: dict[str, int] = {}
            for rid in rids:
                engine = self.in_flight.pop(rid, None)
                if engine is not None:
                    released[engine] = released.get(engine, 0) + 1
            for engine, count in released.items():  # one load change per engine, not per sample
                self._loads.change(engine, -count)
            if len(rids) == 1 and not self._waiting_batches:
                self._slots.notify(1)
            else:
                self._slots.notify_all()

    def in_flight_on(self, url: str) -> int:
        """Requests this client sent straight to `url` that have not come back (0 for the router's)."""
        return self._loads.counts.get(url, 0)

    async def wake_waiters(self) -> None:
        """Re-check every queued request now: after a stop, or when engines were added to the directory."""
        async with self._slots:
            self._slots.notify_all()

    # -- requests ------------------------------------------------------------------------------------
    async def generate(self, payload: dict[str, Any], *, stopped: asyncio.Event | None = None,
                       group: int | None = None, across_groups: bool = False,
                       reward_request: dict[str, Any] | None = None) -> GenerateAnswer:
        """POST one /generate (payload must carry its `rid`). Raises TransportError / EngineHTTPError,
        or StopGeneration if `stopped` was set before a slot was free (nothing was sent then).

        With `group` (and `batch_requests`), the request waits one event-loop turn for others of the same
        `stopped` (session) and, unless `across_groups`, the same group, and goes out in a batch.
        `reward_request` (worker_rewards.reward_request): the answer worker scores this answer's rule reward."""
        outcome = (await self.generate_many([payload], stopped=stopped, group=group, across_groups=across_groups,
                                            reward_requests=[reward_request]))[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async def generate_many(self, payloads: list[dict[str, Any]], *, stopped: asyncio.Event | None = None,
                            group: int | None = None, across_groups: bool = False,
                            reward_requests: list[dict[str, Any] | None] | None = None,
                            ) -> list[GenerateAnswer | Exception]:
        """`generate` of each payload (a group's samples: the same `group`), waiting once for all: per payload, its
        answer or the error `generate` would raise (TransportError, EngineHTTPError, StopGeneration), in order.
        `reward_requests` (one per payload, or None): what the answer worker scores (worker_rewards)."""
        scoring = reward_requests or [None] * len(payloads)
        outcomes: list[GenerateAnswer | Exception] = [_UNSET] * len(payloads)
        queued: list[tuple[int, dict[str, Any]]] = []
        alone: list[tuple[int, dict[str, Any]]] = []
        batching = group is not None and self.batch_requests
        context, lora_path = self.context_length, self.lora_path
        longest = longest_served_prompt(context) if context else 0
        for position, payload in enumerate(payloads):
            if lora_path is not None and "lora_path" not in payload:
                payload = {**payload, "lora_path": lora_path}
            ids, params = payload.get("input_ids"), payload.get("sampling_params")
            if context and type(ids) is list and type(params) is dict and len(ids) <= longest \
                    and type(max_new := params.get("max_new_tokens", 128)) is int and max_new <= context - len(ids):
                full = None  # the common case, checked inline: fits the context as it is (clip_to_context's rule)
            else:
                payload = clip_to_context(payload, context)
                full = context_full_answer(payload, context)
            if full is not None:
                outcomes[position] = GenerateAnswer(body=full, engine_url=None)
            elif batching and batchable(payload):
                queued.append((position, payload))
            else:
                alone.append((position, payload))
        singles = asyncio.gather(*(self._send_alone(payload, stopped, scoring[position]) for position, payload in alone)) \
            if alone else None
        if queued:
            loop = asyncio.get_running_loop()
            waiting = _Waiting(loop.create_future(), len(queued))
            key = (id(stopped), None if across_groups else group)
            items = self._queued.setdefault(key, (stopped, []))[1]
            items.extend(_Queued(payload=payload, group=group, waiting=waiting, position=index,
                                 reward_request=scoring[position])
                         for index, (position, payload) in enumerate(queued))
            if not self._flush_scheduled:
                self._flush_scheduled = True
                loop.call_soon(self._flush)
            try:
                answers = await waiting.future
            except BaseException:
                if singles is not None:
                    singles.cancel()
                raise
            for (position, _), outcome in zip(queued, answers):
                outcomes[position] = outcome
        if singles is not None:
            for (position, _), outcome in zip(alone, await singles):
                outcomes[position] = outcome
        return outcomes

    async def _send_alone(self, payload: dict[str, Any], stopped: asyncio.Event | None,
                          reward_request: dict[str, Any] | None = None) -> GenerateAnswer | Exception:
        try:
            return (await self._send([payload], stopped, direct=self.router_url is None,
                                     reward_requests=[reward_request]))[0]
        except Exception as error:  # noqa: BLE001 - the caller's, as generate raises it
            return error

    def _flush(self) -> None:
        """Send what was queued this turn: per session (and group), cut by `plan_batches`."""
        self._flush_scheduled = False
        queued, self._queued = self._queued, {}
        engines = len(self.directory.engine_urls())
        for stopped, items in queued.values():
            items = [item for item in items if not item.waiting.future.done()]  # the caller was cancelled
            for batch in plan_batches(items, [item.group for item in items], engines=engines,
                                      max_batch=self.per_engine_concurrency):
                task = asyncio.create_task(self._send_queued(batch, stopped))
                self._batch_tasks.add(task)
                task.add_done_callback(self._batch_tasks.discard)

    async def _send_queued(self, batch: list[_Queued], stopped: asyncio.Event | None) -> None:
        """Send one planned batch; each caller gets its answer, or the batch's error."""
        try:
            answers = await self._send([item.payload for item in batch], stopped,
                                       direct=len(batch) > 1 or self.router_url is None,
                                       reward_requests=[item.reward_request for item in batch])
        except asyncio.CancelledError:
            for item in batch:
                item.waiting.future.cancel()
            raise
        except Exception as error:  # noqa: BLE001 - each sample decides (retry, fail, stop)
            for item in batch:
                item.waiting.settle(item.position, error)
            return
        for item, answer in zip(batch, answers):
            item.waiting.settle(item.position, answer)

    async def _send(self, payloads: list[dict[str, Any]], stopped: asyncio.Event | None, *,
                    direct: bool, reward_requests: list[dict[str, Any] | None] | None = None) -> list[GenerateAnswer]:
        """POST `payloads` as one request (a batched body if more than one) to an engine (`direct`) or
        the router, within the concurrency limit; one answer per payload."""
        rids = [payload["rid"] for payload in payloads]
        engine = await self._acquire(rids, stopped, direct=direct)
        base = engine if direct else self.router_url
        try:
            if base is None:
                raise TransportError("no router URL and no engine is up")
            body = await self._post_generate(base, payloads[0] if len(payloads) == 1 else merge_payloads(payloads),
                                             score_header(rids, reward_requests) if reward_requests else None)
            if engine is not None:
                self.answered_at[engine] = asyncio.get_running_loop().time()
            if len(payloads) == 1:
                return [GenerateAnswer(body=body, engine_url=engine)]
            try:
                items = split_answer(body, rids)
            except BatchAnswerError as error:
                if self.batch_requests:
                    log.warning("%s: %s; sending one request per sample from now on", base, error)
                self.batch_requests = False
                raise TransportError(f"{base}: {error}") from None
            return [GenerateAnswer(body=item, engine_url=engine) for item in items]
        except TransportError:
            if engine is not None:
                self._failed_at[engine] = asyncio.get_running_loop().time()
            raise
        finally:
            await self._release(rids)

    async def _post_generate(self, base: str, body: dict[str, Any], score: dict[str, Any] | None = None) -> Any:
        """The JSON of a 200 answer of `base`/generate; TransportError (no answer, 5xx, not JSON) or
        EngineHTTPError (4xx). `score`: rule rewards the answer worker computes (ignored without workers)."""
        self.http_requests += 1
        try:
            if self.answer_pool is not None:  # the exchange and the parse in a worker process
                status, answer = await self.answer_pool.post(base, "/generate", orjson.dumps(body),
                                                             self.request_timeout_s, score=score)
                if status == 200:
                    return answer
                raw = answer
            else:
                status, raw = await self.connections.to(base).request("POST", "/generate", orjson.dumps(body),
                                                                      self.request_timeout_s)
        except EngineHTTPTransportError as error:
            raise TransportError(f"{base}/generate failed: {error}") from None
        except AnswerNotJSON as error:
            raise TransportError(f"{base} answered a body that is not JSON: {error}") from None
        if status >= 500:
            raise TransportError(f"{base} answered HTTP {status}: {_text(raw)[:300]}")
        if status != 200:
            raise EngineHTTPError(status, _text(raw))
        ok, value = compact_answers(raw)  # on the loop: the same compact arrays as the workers'
        if not ok:
            raise TransportError(f"{base} answered a body that is not JSON: {value}")
        return value

    async def _post_control(self, url: str, path: str, body: dict[str, Any]) -> bool:
        try:
            if self.answer_pool is not None:  # the worker that holds this engine's /generate connections
                status, _ = await self.answer_pool.post(url, path, orjson.dumps(body), self.control_timeout_s,
                                                        parse=False)
            else:
                status, _ = await self.connections.to(url).request("POST", path, orjson.dumps(body),
                                                                   self.control_timeout_s)
            return status == 200
        except EngineHTTPTransportError:
            return False  # a dead engine has nothing to abort

    async def abort(self, rid: str) -> None:
        """Abort one request: on its engine if known, else on every engine (unknown rids are no-ops)."""
        engine = self.in_flight.get(rid)
        urls = [engine] if engine else self.directory.engine_urls()
        await asyncio.gather(*(self._post_control(u, "/abort_request", {"rid": rid}) for u in urls))

    async def abort_all(self) -> int:
        """`/abort_request {"abort_all": true}` on every engine; returns how many engines said 200."""
        urls = self.directory.engine_urls()
        results = await asyncio.gather(
            *(self._post_control(u, "/abort_request", {"rid": "", "abort_all": True}) for u in urls))
        return sum(results)


class StopGeneration(Exception):
    """Raised inside generation when its session was stopped before a request could be sent."""
