"""The controller's admin calls on each engine (what sglang-router does not route).

Owns: pause/continue, the weight-update session (init group, begin, update per bucket, end,
destroy; `weight_update` pipelines begin, every bucket and end on one connection), release/resume of
memory (colocated mode), health and model info — one async method per SGLang endpoint, with the API
key, a timeout, and errors that name the engine and the endpoint. Every call is bounded
(`controller.engine_admin_timeout`: no answer for that long fails it), a call unanswered for
STUCK_NOTICE_S is logged naming the engine and the endpoint, and a call in flight vouches for the engine's
health only while it shows progress (IN_FLIGHT_TRUST_S): a stuck engine is health-probed and failed. The HTTP is
hpc_rl.protocol.http_client's (keep-alive, pipelined, JSON by orjson).
Does not own: /generate and /abort_request (hpc_rl.rollout.engine_client), or when to call what
(hpc_rl.controller.transports and the loop).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from hpc_rl.protocol.health_round import health_round
from hpc_rl.protocol.http_client import EngineConnections, EngineHTTPTransportError, Pipeline, ReadGate


log = logging.getLogger(__name__)

STUCK_NOTICE_S = 5.0
"""An admin call without an answer for this long is logged (once per call), naming engine and endpoint."""
IN_FLIGHT_TRUST_S = 10.0
"""A call in flight vouches for its engine (no health probe) while the engine answered within this long."""
DEFAULT_ADMIN_TIMEOUT_S = 300.0
"""`controller.engine_admin_timeout`'s default."""


class EngineAdminError(RuntimeError):
    """An admin call failed; the message names the engine URL and endpoint (`url`: the engine's)."""

    def __init__(self, message: str, *, url: str = "") -> None:
        super().__init__(message)
        self.url = url


@dataclass(frozen=True)
class BucketUpdate:
    """One `/update_weights_from_distributed` call of a weight update, encoded once for every engine."""

    body: bytes

    @classmethod
    def of(cls, *, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
           weight_version: str | None, load_format: str | None, flush_cache: bool = True) -> BucketUpdate:
        """`flush_cache` False: the engine keeps its KV cache (SGLang asserts a flush succeeds after the update,
        which fails while requests are paused in place)."""
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": flush_cache, "load_format": load_format}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return cls(orjson.dumps(body))


def weight_update_calls(buckets: list[BucketUpdate]) -> list[tuple[str, str, bytes]]:
    """A weight update's requests: begin, every bucket, end."""
    return [("POST", "/begin_weight_update", b"{}"),
            *(("POST", "/update_weights_from_distributed", bucket.body) for bucket in buckets),
            ("POST", "/end_weight_update", b"{}")]


def weight_update_requests(buckets: list[BucketUpdate]) -> Pipeline:
    """A weight update's requests (begin, every bucket, end), encoded once for every engine."""
    return Pipeline(weight_update_calls(buckets))


def weight_update_call(requests: Pipeline, index: int) -> str:
    """How errors name request `index` of a weight update: its endpoint, and which bucket."""
    endpoint, buckets = requests.keys[index][1], len(requests) - 2
    return f"{endpoint} (bucket {index} of {buckets})" if 0 < index <= buckets else endpoint


def pipeline_span(requests: Pipeline) -> str:
    """How a transport failure of a pipelined exchange names it (its first and last endpoints)."""
    head, tail = requests.keys[0][1], requests.keys[-1][1]
    return head if len(requests) == 1 else f"{head} ... {tail}"


class RemoteProgress:
    """When an engine last showed life on calls a worker process makes for it (`EngineAdmin.begin_elsewhere`)."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at
        """Event-loop time of the latest answer the worker read (from the engines it updates)."""


class PipelinedBuckets(list[BucketUpdate]):
    """A weight update's buckets with their requests encoded once (`requests`): the fan-out hands one to every
    engine's `weight_update` (1,024 engines, 18 requests each: bench_scale's syncCPU 0.137 -> 0.095 s)."""

    def __init__(self, buckets: list[BucketUpdate]) -> None:
        super().__init__(buckets)
        self.requests = weight_update_requests(self)


FAN_OUT_CALLS: dict[str, Callable[..., tuple[str, dict[str, Any]]]] = {
    "pause": lambda mode="retract": ("/pause_generation", {"mode": mode}),
    "resume_generation": lambda: ("/continue_generation", {}),
    "flush_cache": lambda: ("/flush_cache", {}),
    "release_memory": lambda tags: ("/release_memory_occupation", {"tags": tags}),
    "resume_memory": lambda tags: ("/resume_memory_occupation", {"tags": tags}),
    "init_weight_group": lambda **group: ("/init_weights_update_group", {  # (the calls return when all joined)
        key: group[key] for key in ("master_address", "master_port", "rank_offset", "world_size", "group_name",
                                    "backend")}),
    "destroy_weight_group": lambda group_name: ("/destroy_weights_update_group", {"group_name": group_name}),
}
"""The calls that are one POST (path, JSON body) whose answer only needs to be a 200, by EngineAdmin method and its
arguments: what the answer workers can make for every engine at once (transports.fanout_workers)."""


class EngineAdmin:
    """Admin endpoints of one engine (its connections come from the controller's `EngineConnections`)."""

    def __init__(self, url: str, connections: EngineConnections, *,
                 timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.connection = connections.to(self.url)
        self.timeout_s = timeout_s
        self.calls_in_flight = 0
        self.in_flight: list[str] = []
        """Endpoints of the calls in flight, oldest first (what a stuck engine was asked)."""
        self._started: list[float] = []
        """When each call in flight began (the same order)."""
        self.remote: RemoteProgress | None = None
        """While an answer worker makes a call for this engine: its news of the engine's answers."""
        self.answered_elsewhere_at = float("-inf")
        """Event-loop time an answer worker last reported a call to this engine answered in full."""

    async def _call(self, method: str, endpoint: str, body: dict[str, Any] | None = None,
                    timeout_s: float | None = None, *, notice: bool = True) -> Any:
        encoded = orjson.dumps(body) if body is not None else None
        self._begin(endpoint, notice=notice)
        try:
            status, answer = await self.connection.request(method, endpoint, encoded, timeout_s or self.timeout_s)
        except EngineHTTPTransportError as error:
            raise EngineAdminError(f"{self.url}{endpoint} failed: {error}", url=self.url) from error
        finally:
            self._end(endpoint)
        return _checked(self.url, endpoint, status, answer)

    def _begin(self, endpoint: str, *, notice: bool) -> None:
        loop = asyncio.get_running_loop()
        self.calls_in_flight += 1
        self.in_flight.append(endpoint)
        self._started.append(loop.time())
        if notice:
            loop.call_later(STUCK_NOTICE_S, self._notice_if_silent, endpoint)

    def _end(self, endpoint: str) -> None:
        self.calls_in_flight -= 1
        index = self.in_flight.index(endpoint)
        del self.in_flight[index], self._started[index]

    def _notice_if_silent(self, endpoint: str) -> None:
        if endpoint in self.in_flight and self.silent_for() >= STUCK_NOTICE_S:
            log.warning("engine %s: %s has had no answer for %.0f s (it is failed as dead if it does not answer "
                        "/health either; controller.engine_admin_timeout %g s bounds the call)", self.url, endpoint,
                        self.silent_for(), self.timeout_s)

    def silent_for(self) -> float:
        """Seconds since the engine last showed life on a call in flight (0 when none is in flight)."""
        if not self.calls_in_flight:
            return 0.0
        remote = self.remote.at if self.remote is not None else float("-inf")
        return asyncio.get_running_loop().time() - max(self._started[0], self.connection.progress_at(), remote)

    def begin_elsewhere(self, endpoint: str, progress: RemoteProgress, *, notice: bool = False) -> None:
        """A call an answer worker makes for this engine (the workers' weight-update fan-out) is in flight: it
        counts as this admin's (a health round does not probe the engine while it shows progress), its
        progress being what the worker reports."""
        self._begin(endpoint, notice=notice)
        self.remote = progress

    def end_elsewhere(self, endpoint: str, *, answered: bool) -> None:
        """That call ended (`answered`: the engine answered every request, whatever the status)."""
        self._end(endpoint)
        self.remote = None
        if answered:
            self.answered_elsewhere_at = asyncio.get_running_loop().time()

    def known_alive(self, seconds: float, now: float | None = None) -> bool:
        """Whether the engine answered an admin call in the last `seconds`, or has one in flight that showed
        progress in the last max(`seconds`, IN_FLIGHT_TRUST_S): then no health probe. A probe of an engine
        busy with a call opens a second connection (a round during a 10 s sync at 1,024 engines made 1,024
        of them); a silent call vouches for nothing (a stopped engine stalled a sync unnoticed: issue 24).
        `now`: the event loop's time, when the caller has it (a health round asks 1,024 engines at once)."""
        if self.calls_in_flight:
            return self.silent_for() < max(seconds, IN_FLIGHT_TRUST_S)
        answered_at = max(self.connection.answered_at, self.answered_elsewhere_at)
        return (asyncio.get_running_loop().time() if now is None else now) - answered_at < seconds

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            await self._call("GET", "/health", timeout_s=timeout_s, notice=False)  # its timeout says it
            return True
        except EngineAdminError:
            return False

    async def model_info(self) -> dict[str, Any]:
        return await self._call("GET", "/model_info", timeout_s=10.0)

    async def pause(self, mode: str = "retract") -> None:
        await self._call("POST", *FAN_OUT_CALLS["pause"](mode))

    async def resume_generation(self) -> None:
        await self._call("POST", *FAN_OUT_CALLS["resume_generation"]())

    async def abort_requests(self) -> None:
        """`/abort_request` of every request the engine holds (they answer with finish reason "abort", and the
        rollout resumes each on another engine: engine_membership's drain)."""
        await self._call("POST", "/abort_request", {"rid": "", "abort_all": True}, timeout_s=30.0)

    async def flush_cache(self) -> None:
        await self._call("POST", *FAN_OUT_CALLS["flush_cache"]())

    async def init_weight_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                world_size: int, group_name: str, backend: str) -> None:
        await self._call("POST", *FAN_OUT_CALLS["init_weight_group"](
            master_address=master_address, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
            group_name=group_name, backend=backend))

    async def destroy_weight_group(self, group_name: str) -> None:
        await self._call("POST", *FAN_OUT_CALLS["destroy_weight_group"](group_name))

    async def begin_weight_update(self) -> None:
        await self._call("POST", "/begin_weight_update", {})

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, weight_version: str | None,
                                              load_format: str | None) -> None:
        bucket = BucketUpdate.of(names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                                 weight_version=weight_version, load_format=load_format)
        status, answer = (await self._exchange([("POST", "/update_weights_from_distributed", bucket.body)]))[0]
        _checked(self.url, "/update_weights_from_distributed", status, answer)

    async def weight_update(self, buckets: list[BucketUpdate], *, gate: ReadGate | None = None) -> None:
        """begin, every bucket, end: written back to back on one connection (the engine runs them in
        order, as HTTP/1.1 requires), so the controller spends one write and a parse per call instead of
        a round trip per call; with a `gate`, answers after the first are read when it opens (see
        transports.fanout.update_every_engine). Raises EngineAdminError naming the first endpoint that failed
        (the end call is still made, so a failed update does not leave the engine's session open)."""
        requests = buckets.requests if isinstance(buckets, PipelinedBuckets) \
            else weight_update_requests(buckets)
        # not noticed per engine: a stuck engine stalls every engine's broadcast, so update_every_engine
        # watches the fan-out as a whole and names the one that does not answer /health
        answers = await self._exchange(requests, gate, notice=False)
        for index, (status, answer) in enumerate(answers):
            if status != 200:  # 200 bodies are not read: only the status matters here
                _checked(self.url, weight_update_call(requests, index), status, answer)

    async def _exchange(self, requests: list[tuple[str, str, bytes | None]] | Pipeline,
                        gate: ReadGate | None = None, *, notice: bool = True) -> list[tuple[int, bytes]]:
        if isinstance(requests, Pipeline):
            first = pipeline_span(requests)
        else:
            first = requests[0][1] if len(requests) == 1 else f"{requests[0][1]} ... {requests[-1][1]}"
        self._begin(first, notice=notice)
        try:
            return await self.connection.exchange(requests, self.timeout_s, gate=gate)
        except EngineHTTPTransportError as error:
            raise EngineAdminError(f"{self.url}{first} failed: {error}", url=self.url) from error
        finally:
            self._end(first)

    async def end_weight_update(self) -> None:
        await self._call("POST", "/end_weight_update", {})

    async def release_memory(self, tags: list[str] | None) -> None:
        await self._call("POST", *FAN_OUT_CALLS["release_memory"](tags))

    async def resume_memory(self, tags: list[str] | None) -> None:
        await self._call("POST", *FAN_OUT_CALLS["resume_memory"](tags))

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        await self._call("POST", "/update_weights_from_disk", {"model_path": model_path,
                                                                "weight_version": weight_version})

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """SGLang's /load_lora_adapter: a PEFT directory served as `lora_name` (engines started with --enable-lora)."""
        await self._call("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    async def update_weight_version(self, weight_version: str) -> None:
        """The version the engine reports on its answers (requests in flight are not aborted)."""
        await self._call("POST", "/update_weight_version", {"new_version": weight_version,
                                                            "abort_all_requests": False})


async def healthy_all(admins: list[EngineAdmin], timeout_s: float, *, concurrency: int = 64) -> list[bool]:
    """`admin.healthy(timeout_s)` of every engine, at once: where an engine has an idle kept-alive connection the
    probe goes out in one `RequestRound` (no coroutine or Future per engine: ~4x less of the loop's CPU per probe);
    the others (no connection yet, or every one busy, or a fake in a unit test) take the per-call path,
    `concurrency` at a time. A probe whose connection closed before the answer (the engine dropped an idle
    connection as it was written) is made again on the per-call path, which reconnects; one that timed out is
    not (a stopped engine is failed one timeout after the probe, as before)."""
    return await health_round([admin.connection if isinstance(admin, EngineAdmin) else None for admin in admins],
                              lambda index: admins[index].healthy(timeout_s), timeout_s, concurrency=concurrency)


def _checked(url: str, endpoint: str, status: int, answer: bytes) -> Any:
    """The JSON (or text) of a 200 answer; EngineAdminError naming the engine and endpoint otherwise."""
    if status != 200:
        raise status_error(url, endpoint, status, answer[:500].decode(errors="replace"))
    try:
        return orjson.loads(answer) if answer else None
    except orjson.JSONDecodeError:
        return answer.decode(errors="replace")


def status_error(url: str, endpoint: str, status: int, body_head: str) -> EngineAdminError:
    """The error of an answer that was not 200 (`body_head`: its first 500 bytes, as text)."""
    return EngineAdminError(f"{url}{endpoint} answered HTTP {status}: {body_head}", url=url)
