"""Engines that join and leave a running run: the controller's half of engine jobs (docs/engine-jobs.md).

Owns: the answer to an engine agent's `EngineJoin` (a new engine index after every engine the run has known, the
engine registered STARTING so it serves only once it holds the current weights, or SERVING at once while no push
has happened: it loaded the checkpoint the run starts from) and `EngineLeave` (drain: LEFT, off the router, then
`/abort_request` of everything it holds; the rollout resumes those samples on the other engines, as for any abort
it did not ask for (hpc_rl.rollout.generate): nothing is lost; the answer goes back once the client has no request
left on it), and the measured times: registration to first request, abort to requeue.

    agent ── EngineJoin(url, tp, job id) ──> join(): index = next free; STARTING ──> the loop's next sync point
                                                     (sync mode: at once, in `Rollouts.watch`; async: the next
                                                     sync) pushes the current version to it -> SERVING
    agent ── EngineLeave(index) ──────────> leave(): wait for a weight sync it is in -> LEFT, router remove,
                                                     transport forgets it -> abort its requests -> wait until they
                                                     came back (requeued) -> EngineLeft(requeued, drain_s)

Not here: the weight push (weight_updates), the router and health (engine_fleet), resuming samples (rollout).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from hpc_rl.controller.engine_fleet import EngineFleet
from hpc_rl.controller.registry import EngineState, Registry

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 60.0
"""How long a leave waits for the leaving engine's requests to come back (aborted again every second)."""
SYNC_WAIT_S = 300.0
"""How long a leave waits for a weight-update call in flight on the engine (a sync it is part of) to end."""


class EngineMembership:
    """Joins and leaves of engine-job engines, with their timings (see the module docstring)."""

    def __init__(self, registry: Registry, fleet: EngineFleet, *, weight_version: Callable[[], int],
                 initial_weights: Callable[[], bool], in_flight_on: Callable[[str], int] | None = None,
                 first_send_watch: dict[str, Callable[[], None]] | None = None) -> None:
        self.registry, self.fleet = registry, fleet
        self.weight_version = weight_version
        """The trainer's version (what a joiner gets before it serves)."""
        self.initial_weights = initial_weights
        """True while the engines still serve the weights they loaded (no push yet): a joiner serves at once."""
        self.in_flight_on = in_flight_on
        """Requests in flight on an engine URL (the rollout client's count); None until the stack is built."""
        self.first_send_watch = first_send_watch
        """The rollout client's `first_send_watch` (None until the stack is built: joiners wait in `_early`)."""
        self.records: dict[int, dict[str, Any]] = {}
        self._early: dict[int, tuple[str, float]] = {}
        """Joined before the rollout client existed: index -> (URL, registration time), for `watch_early_joiners`."""
        """Engine index -> its job id, name, and timings (joined_at, first_request_s, drain_s, requeued)."""

    async def join(self, *, url: str, tp_size: int, job_id: str, name: str) -> int:
        """Add the engine (an agent re-sending its join for a URL still live here gets the same index back)."""
        for engine in self.registry.live_engines():
            if engine.url == url:
                return engine.engine_index
        registered = time.perf_counter()
        index = max([*self.registry.engines, self.registry.num_engines - 1]) + 1
        serving = self.initial_weights()
        await self.fleet.register(index, url, tp_size=tp_size, serving=serving, job_id=job_id)
        self.records[index] = {"job_id": job_id, "name": name, "url": url, "joined_at": time.time(),
                               "first_request_s": None, "drain_s": None, "requeued": None}
        self.fleet.events.append({"event": "joined", "engine": index, "detail": f"{name or url} (job {job_id})"})
        log.info("engine %d joined from engine job %s at %s (%s)", index, job_id, url,
                 "serving" if serving else f"waiting for weights v{self.weight_version()}")
        self._watch_first_request(index, url, registered)
        return index

    def _watch_first_request(self, index: int, url: str, registered: float) -> None:
        """Registration -> the first request the rollout client sends the joiner (`EngineClient.first_send_watch`;
        one that joined before the client existed, as engine jobs re-joining a restarted controller do, is watched
        from `watch_early_joiners`)."""
        if self.first_send_watch is None:
            self._early[index] = (url, registered)
            return

        def first_request() -> None:
            self.records[index]["first_request_s"] = round(time.perf_counter() - registered, 3)

        self.first_send_watch[url] = first_request

    def watch_early_joiners(self) -> None:
        """The rollout client exists now (`first_send_watch` set): watch the engines that joined before it."""
        early, self._early = self._early, {}
        for index, (url, registered) in early.items():
            self._watch_first_request(index, url, registered)

    async def leave(self, engine_index: int, reason: str) -> tuple[int, float]:
        """Drain the engine; returns (requests requeued, seconds from the abort until the last came back)."""
        engine = self.registry.engines.get(engine_index)
        if engine is None:
            raise ValueError(f"engine {engine_index} is not in this run (did the controller restart? join again)")
        if engine.state in (EngineState.LEFT, EngineState.FAILED):
            return 0, 0.0
        admin = self.fleet.admins[engine_index]
        deadline = time.monotonic() + SYNC_WAIT_S
        while admin.calls_in_flight and time.monotonic() < deadline:  # a weight sync it is part of ends first
            await asyncio.sleep(0.05)
        await self.fleet.leave(engine_index, reason)
        self._early.pop(engine_index, None)
        if self.first_send_watch is not None:
            self.first_send_watch.pop(engine.url, None)
        start = time.perf_counter()
        requeued = self.in_flight_on(engine.url) if self.in_flight_on is not None else 0
        await self._abort_until_empty(engine.url, engine_index)
        drain_s = time.perf_counter() - start
        record = self.records.setdefault(engine_index, {"job_id": engine.job_id, "url": engine.url})
        record.update(drain_s=round(drain_s, 3), requeued=requeued, left_at=time.time(), reason=reason)
        log.info("engine %d left (%s): %d request(s) aborted and requeued in %.3f s", engine_index, reason,
                 requeued, drain_s)
        return requeued, drain_s

    async def _abort_until_empty(self, url: str, engine_index: int) -> None:
        admin = self.fleet.admins[engine_index]
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            try:
                await admin.abort_requests()
            except Exception as error:  # a dead engine: its requests fail over as transport errors
                log.warning("engine %d: abort while leaving: %s", engine_index, error)
            for _ in range(20):
                if self.in_flight_on is None or not self.in_flight_on(url):
                    return
                await asyncio.sleep(0.05)
            if time.monotonic() > deadline:
                log.warning("engine %d: %d request(s) still out %.0f s after its leave", engine_index,
                            self.in_flight_on(url), DRAIN_TIMEOUT_S)
                return

    def summary(self) -> dict[str, dict[str, Any]]:
        """Engine jobs by job id: their engines (index, name, state, timings), for status.json."""
        jobs: dict[str, dict[str, Any]] = {}
        for index, record in sorted(self.records.items()):
            engine = self.registry.engines.get(index)
            job = jobs.setdefault(str(record.get("job_id", "")), {"engines": {}})
            in_flight = self.in_flight_on(record["url"]) if self.in_flight_on is not None and "url" in record else 0
            job["engines"][str(index)] = {**record, "state": engine.state.value if engine else "unknown",
                                          "in_flight": in_flight}
        for job in jobs.values():
            states = {e["state"] for e in job["engines"].values()}
            job["state"] = "serving" if "serving" in states else ("starting" if "starting" in states else
                                                                  "/".join(sorted(states)))
        return jobs

    async def close(self) -> None:
        """(Nothing runs in the background; kept for the controller's shutdown order.)"""
