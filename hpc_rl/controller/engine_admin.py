"""The controller's admin calls on each engine (what sglang-router does not route).

Owns: pause/continue, the weight-update session (init group, begin, update per bucket, end,
destroy; `weight_update` pipelines begin, every bucket and end on one connection), release/resume of
memory (colocated mode), health and model info — one async method per SGLang endpoint, with the API
key, a timeout, and errors that name the engine and the endpoint. The HTTP is
hpc_rl.protocol.http_client's (keep-alive, pipelined, JSON by orjson).
Does not own: /generate and /abort_request (hpc_rl.rollout.engine_client), or when to call what
(hpc_rl.controller.weight_sync and the loop).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson

from hpc_rl.protocol.http_client import EngineConnections, EngineHTTPTransportError, ReadGate


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
           weight_version: str | None, load_format: str | None) -> BucketUpdate:
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": True, "load_format": load_format}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return cls(orjson.dumps(body))


class EngineAdmin:
    """Admin endpoints of one engine (its connections come from the controller's `EngineConnections`)."""

    def __init__(self, url: str, connections: EngineConnections, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.connection = connections.to(self.url)
        self.timeout_s = timeout_s
        self.calls_in_flight = 0

    async def _call(self, method: str, endpoint: str, body: dict[str, Any] | None = None,
                    timeout_s: float | None = None) -> Any:
        encoded = orjson.dumps(body) if body is not None else None
        self.calls_in_flight += 1
        try:
            status, answer = await self.connection.request(method, endpoint, encoded, timeout_s or self.timeout_s)
        except EngineHTTPTransportError as error:
            raise EngineAdminError(f"{self.url}{endpoint} failed: {error}", url=self.url) from error
        finally:
            self.calls_in_flight -= 1
        return _checked(self.url, endpoint, status, answer)

    def known_alive(self, seconds: float) -> bool:
        """Whether the engine answered an admin call in the last `seconds` or has one in flight (a weight
        update: its own timeout watches the engine): then no health probe. A probe of an engine busy with a
        call opens a second connection: a round during a 10 s sync at 1,024 engines made 1,024 of them."""
        return self.calls_in_flight > 0 or asyncio.get_running_loop().time() - self.connection.answered_at < seconds

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            await self._call("GET", "/health", timeout_s=timeout_s)
            return True
        except EngineAdminError:
            return False

    async def model_info(self) -> dict[str, Any]:
        return await self._call("GET", "/model_info", timeout_s=10.0)

    async def pause(self, mode: str = "retract") -> None:
        await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._call("POST", "/flush_cache", {})

    async def init_weight_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                world_size: int, group_name: str, backend: str) -> None:
        await self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend,
        })

    async def destroy_weight_group(self, group_name: str) -> None:
        await self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

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
        weight_sync.update_every_engine). Raises EngineAdminError naming the first endpoint that failed
        (the end call is still made, so a failed update does not leave the engine's session open)."""
        requests: list[tuple[str, str, bytes | None]] = [("POST", "/begin_weight_update", b"{}")]
        requests += [("POST", "/update_weights_from_distributed", bucket.body) for bucket in buckets]
        requests.append(("POST", "/end_weight_update", b"{}"))
        answers = await self._exchange(requests, gate)
        for index, ((_, endpoint, _), (status, answer)) in enumerate(zip(requests, answers)):
            if status != 200:  # 200 bodies are not read: only the status matters here
                what = f"{endpoint} (bucket {index} of {len(buckets)})" if 0 < index <= len(buckets) else endpoint
                _checked(self.url, what, status, answer)

    async def _exchange(self, requests: list[tuple[str, str, bytes | None]],
                        gate: ReadGate | None = None) -> list[tuple[int, bytes]]:
        self.calls_in_flight += 1
        try:
            return await self.connection.exchange(requests, self.timeout_s, gate=gate)
        except EngineHTTPTransportError as error:
            first = requests[0][1] if len(requests) == 1 else f"{requests[0][1]} ... {requests[-1][1]}"
            raise EngineAdminError(f"{self.url}{first} failed: {error}", url=self.url) from error
        finally:
            self.calls_in_flight -= 1

    async def end_weight_update(self) -> None:
        await self._call("POST", "/end_weight_update", {})

    async def release_memory(self, tags: list[str] | None) -> None:
        await self._call("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None) -> None:
        await self._call("POST", "/resume_memory_occupation", {"tags": tags})

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        await self._call("POST", "/update_weights_from_disk", {"model_path": model_path,
                                                                "weight_version": weight_version})


def _checked(url: str, endpoint: str, status: int, answer: bytes) -> Any:
    """The JSON (or text) of a 200 answer; EngineAdminError naming the engine and endpoint otherwise."""
    if status != 200:
        raise EngineAdminError(f"{url}{endpoint} answered HTTP {status}: {answer[:500].decode(errors='replace')}",
                               url=url)
    try:
        return orjson.loads(answer) if answer else None
    except orjson.JSONDecodeError:
        return answer.decode(errors="replace")
