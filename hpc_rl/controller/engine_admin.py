"""The controller's admin calls on each engine (what sglang-router does not route).

Owns: pause/continue, the weight-update session (init group, begin, update per bucket, end,
destroy), release/resume of memory (colocated mode), health and model info — one async method per
SGLang endpoint, with the API key, a timeout, and errors that name the engine and the endpoint.
Does not own: /generate and /abort_request (hpc_rl.rollout.engine_client), or when to call what
(hpc_rl.controller.weight_sync and the loop).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp


class EngineAdminError(RuntimeError):
    """An admin call failed; the message names the engine URL and endpoint."""


class EngineAdmin:
    """Admin endpoints of one engine."""

    def __init__(self, url: str, session: aiohttp.ClientSession, *, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.session = session
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    async def _call(self, method: str, endpoint: str, body: dict[str, Any] | None = None,
                    timeout_s: float | None = None) -> Any:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with self.session.request(method, f"{self.url}{endpoint}", json=body, headers=self.headers,
                                            timeout=timeout) as response:
                text = await response.text()
                if response.status != 200:
                    raise EngineAdminError(f"{self.url}{endpoint} answered HTTP {response.status}: {text[:500]}")
                try:
                    return await response.json(content_type=None)
                except ValueError:
                    return text
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
            raise EngineAdminError(f"{self.url}{endpoint} failed: {type(error).__name__}: {error}") from error

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
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": True, "load_format": load_format}
        if weight_version is not None:
            body["weight_version"] = weight_version
        await self._call("POST", "/update_weights_from_distributed", body)

    async def end_weight_update(self) -> None:
        await self._call("POST", "/end_weight_update", {})

    async def release_memory(self, tags: list[str] | None) -> None:
        await self._call("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory(self, tags: list[str] | None) -> None:
        await self._call("POST", "/resume_memory_occupation", {"tags": tags})

    async def update_weights_from_disk(self, model_path: str, weight_version: str) -> None:
        await self._call("POST", "/update_weights_from_disk", {"model_path": model_path,
                                                                "weight_version": weight_version})
