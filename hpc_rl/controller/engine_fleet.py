"""The engines as a fleet: registration, health checks, router membership, failure and restart.

Owns: one `EngineAdmin` per engine (over one `EngineConnections` pool), adding/removing engines on
sglang-router (registrations made together go as one batch), the health-check task (concurrent
probes, a bounded number at a time; an engine that dies or stops answering is marked FAILED and
leaves the router at once, so its in-flight samples fail over to the others and are re-queued by the
rollout client), and asking the launcher to restart it. With an answer pool the probes are made in its
worker processes (`answer_pool.probe_health`; rollout/worker_probes.py) and the verdicts come back as one frame per worker;
an engine no worker answered for is probed here. An engine is first probed `health_first_wait_s` after it registered (slime's --rollout-health-check-first-wait), at start and after each restart. A restarted engine stays STARTING (not behind the router) until the loop
has pushed the current weights to it, then `mark_serving` puts it back. The router's own exit is noticed by
the same task (reaped: no zombie) and reported (log, status event "router exited"); engines are then reached
directly (`on_router_lost`), and no more membership calls go to it.
"""

from __future__ import annotations

import asyncio
from math import inf
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from hpc_rl.protocol.http_client import EngineConnections
from hpc_rl.controller.engine_admin import DEFAULT_ADMIN_TIMEOUT_S, EngineAdmin, healthy_all
from hpc_rl.controller.registry import EngineInfo, EngineState, Registry
from hpc_rl.controller.stopping import stop_task
from hpc_rl.rollout.answer_pool import AnswerPool

log = logging.getLogger(__name__)

RestartFn = Callable[[int], Awaitable[str]]
"""Restart engine i (same placement) and return its URL once it answers /health."""
DevicesOf = Callable[[int], list[str]]
"""The GPUs engine i's TP ranks run on, as its step read them back (its placement report)."""


class RouterMembership(Protocol):
    """What the fleet needs from sglang-router (hpc_rl.engines.router.RouterProcess fits, run in a thread)."""

    def add_workers(self, urls: list[str]) -> None:
        """Add them all and return once the router lists every one."""

    def remove_worker(self, url: str) -> None: ...

    # Optional: `exit_code() -> int | None` (RouterProcess has it): the fleet's health task reports its exit.


class EngineFleet:
    """Engines of the run, their health, and their place behind the router."""

    def __init__(self, registry: Registry, router: RouterMembership | None, *, api_key: str | None,
                 restart: RestartFn | None, max_restarts: int, health_interval_s: float,
                 health_timeout_s: float = 10.0, health_first_wait_s: float = 0.0,
                 health_concurrency: int = 64, admin_timeout_s: float = DEFAULT_ADMIN_TIMEOUT_S,
                 devices_of: DevicesOf | None = None) -> None:
        self.registry = registry
        self.admin_timeout_s = admin_timeout_s
        """Bound of every admin call (`controller.engine_admin_timeout`)."""
        self.devices_of = devices_of
        """Read at each registration (a restarted engine reports again); None: not known (unit tests)."""
        self.router = router
        self.api_key = api_key
        self.restart = restart
        self.max_restarts = max_restarts
        self.health_interval_s = health_interval_s
        self.generation_answered_at: Mapping[str, float] | None = None
        """Engine URL -> event-loop time of its last /generate answer (the rollout client's `answered_at`,
        set by the rollout stack): an engine that answered one within the interval is not probed."""
        self.answer_pool: AnswerPool | None = None
        """The rollout client's answer workers (set by the rollout stack). They make the health rounds' probes
        (`probe_health`; an engine no worker answered for is probed here, on the fleet's own connections) and the
        weight update's per-engine exchanges (transports.fanout_workers); None: the fleet's own connections do."""
        self.health_timeout_s = health_timeout_s
        self.health_first_wait_s = health_first_wait_s
        self._first_probe_at: dict[int, float] = {}
        """Engine index -> event-loop time of its first health check (registration + first wait)."""
        self.health_concurrency = health_concurrency
        """Health probes in flight at once (a round over 1,024 engines is 16 waves, not 1,024 in a row)."""
        self.connections: EngineConnections | None = None
        self.admins: dict[int, EngineAdmin] = {}
        self.engine_waiting = asyncio.Event()
        """Set when an engine is up but waits for current weights before serving."""
        self.fatal: BaseException | None = None
        self._monitor: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()
        self.events: list[dict[str, Any]] = []
        self.on_serving: Callable[[], Awaitable[None]] | None = None
        """Called after an engine joined the router (the rollout client wakes requests waiting for one)."""
        self.on_failed: Callable[[int], None] | None = None
        """Called when an engine is failed (the weight updates drop a weight-update group it was in)."""
        self.on_router_lost: Callable[[], None] | None = None
        """Called once the router has exited (generation then goes to the engines directly)."""
        self._router_adds: list[tuple[str, asyncio.Future[None]]] = []
        self._router_adder: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.connections = EngineConnections(api_key=self.api_key)
        self._monitor = asyncio.create_task(self._monitor_loop(), name="engine-health")

    async def stop_monitoring(self) -> None:
        """No more health checks or restarts (the driver is about to stop the engines on purpose). An
        error the health task or a restart ended with is logged (once) rather than dropped."""
        tasks = [t for t in [self._monitor, *self._restarts] if t is not None]
        self._monitor = None
        self._restarts.clear()
        for task in tasks:
            await stop_task(task, task.get_name(), timeout_s=30.0)

    async def close(self) -> None:
        await self.stop_monitoring()
        if self.connections is not None:
            await self.connections.close()

    async def register(self, engine_index: int, url: str, *, tp_size: int = 1, serving: bool,
                       job_id: str = "") -> None:
        """An engine answered /health at `url`; serving=True puts it behind the router now (`job_id`: the engine
        job it came from, see engine_membership)."""
        assert self.connections is not None, "start() first"
        previous = self.registry.engines.get(engine_index)
        info = EngineInfo(engine_index=engine_index, url=url, tp_size=tp_size, job_id=job_id,
                          restarts=previous.restarts if previous else 0,
                          devices=self.devices_of(engine_index) if self.devices_of is not None else [])
        self.registry.add_engine(info)
        if previous is not None:
            self.connections.forget(previous.url)  # a new process: the old one's connections are dead
        self.admins[engine_index] = EngineAdmin(url, self.connections, timeout_s=self.admin_timeout_s)
        self._first_probe_at[engine_index] = asyncio.get_running_loop().time() + self.health_first_wait_s
        if serving:
            await self._router_add(url)
            self.registry.set_engine_state(engine_index, EngineState.SERVING)
            await self._notify_serving()
        else:
            self.engine_waiting.set()

    async def mark_serving(self, engine_indices: list[int]) -> None:
        starting = [i for i in engine_indices if self.registry.engines[i].state == EngineState.STARTING]
        await asyncio.gather(*(self._router_add(self.registry.engines[i].url) for i in starting))
        for index in starting:
            self.registry.set_engine_state(index, EngineState.SERVING)
            self._event("serving", index, self.registry.engines[index].url)
        if starting:
            await self._notify_serving()
        if not any(e.state == EngineState.STARTING for e in self.registry.engines.values()):
            self.engine_waiting.clear()

    async def serve_before_router(self, engine_indices: list[int]) -> None:
        """Like `mark_serving`, but the engines serve the rollout client's direct (batched) requests at once and join
        the router in the background: sglang-router's registration waits until it lists each one (~9.5 s for 240 at
        once in bench_scale's 256-engine churn), which held the rollout for joiners that already had the weights.
        Single requests routed by the router reach them once it lists them."""
        starting = [i for i in engine_indices if self.registry.engines[i].state == EngineState.STARTING]
        for index in starting:
            self.registry.set_engine_state(index, EngineState.SERVING)
            self._event("serving", index, self.registry.engines[index].url)
        if starting:
            await self._notify_serving()
            task = asyncio.create_task(self._router_add_later(starting), name="router-add-joiners")
            self._restarts.add(task)  # (stopped with the health task: stop_monitoring)
            task.add_done_callback(self._restarts.discard)
        if not any(e.state == EngineState.STARTING for e in self.registry.engines.values()):
            self.engine_waiting.clear()

    async def _router_add_later(self, indices: list[int]) -> None:
        engines = [(index, self.registry.engines[index]) for index in indices]
        try:
            await asyncio.gather(*(self._router_add(engine.url) for _, engine in engines))
        except Exception as error:  # direct requests still reach them; the router's own requests do not
            log.warning("adding %d engine(s) to the router: %s", len(engines), error)
            return
        for index, engine in engines:  # one that left or failed meanwhile was not removed (it was not listed yet)
            if self.registry.engines.get(index) is engine and engine.state != EngineState.SERVING:
                try:
                    await self._router_call("remove_worker", engine.url)
                except Exception as error:
                    log.warning("removing %s from the router: %s", engine.url, error)

    async def _notify_serving(self) -> None:
        if self.on_serving is not None:
            await self.on_serving()

    async def _router_add(self, url: str) -> None:
        """Put `url` behind the router; returns once the router lists it. Registrations made at the
        same time (the driver registers every engine at once) go to the router as one batch: all
        POSTs, then one wait for the whole list (`add_workers`), not one wait for the list per engine."""
        if self.router is None:
            return
        added: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._router_adds.append((url, added))
        if self._router_adder is None or self._router_adder.done():
            self._router_adder = asyncio.create_task(self._add_batches(), name="router-add-workers")
        await added

    async def _add_batches(self) -> None:
        assert self.router is not None
        while self._router_adds:
            await asyncio.sleep(0.05)  # registrations arriving together join this batch
            batch, self._router_adds = self._router_adds, []
            try:
                await asyncio.to_thread(self.router.add_workers, [url for url, _ in batch])
            except Exception as error:
                for _, added in batch:
                    if not added.done():
                        added.set_exception(error)
            else:
                for _, added in batch:
                    if not added.done():
                        added.set_result(None)

    async def _router_call(self, method: str, url: str) -> None:
        """Router calls block (they wait for the router to apply them): run them off the event loop."""
        if self.router is not None:
            await asyncio.to_thread(getattr(self.router, method), url)

    def _event(self, kind: str, index: int, detail: str) -> None:
        self.events.append({"event": kind, "engine": index, "detail": detail})
        log.info("engine %d: %s %s", index, kind, detail)

    async def _monitor_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            self.check_router()
            await self.check_health()

    def check_router(self) -> None:
        """A router that exited is reaped and reported once; the fleet stops using it (see the module docstring)."""
        exit_code = getattr(self.router, "exit_code", None)
        code = exit_code() if exit_code is not None else None
        if code is None:
            return
        log_path = getattr(getattr(self.router, "process", None), "log_path", "the router's log")
        message = (f"sglang-router exited with code {code} (see {log_path}); engines are reached directly from "
                   "now on (cache-aware routing is lost)")
        log.error("%s", message)
        self.events.append({"event": "router exited", "engine": None, "detail": message})
        self.router = None
        if self.on_router_lost is not None:
            self.on_router_lost()

    async def check_health(self) -> None:
        """Probe every engine that is not FAILED, past its first wait, and neither answered an admin call in
        the last interval nor has one in flight, `health_concurrency` at a time, and fail those that do not answer: one round costs about one timeout, not one per engine (sequential probes at 10 s
        each let a loaded 1,024-engine round run for minutes)."""
        # An engine that answered an admin call within the interval is alive: during a weight sync that
        # is every engine, and a round of 1,024 probes costs the controller ~0.1 CPU s.
        # So is one that answered a /generate (the rollout client's `answered_at`): at 1,024 engines the
        # probes were the controller's largest cost in a rollout (16% of its profile, bench_scale N=1,024).
        now = asyncio.get_running_loop().time()
        generated = self.generation_answered_at or {}
        gone, first_probe_at, admins = (EngineState.FAILED, EngineState.LEFT), self._first_probe_at, self.admins
        interval = self.health_interval_s
        answered_before = now - interval  # a /generate answer after this vouches for the engine
        engines = [e for e in self.registry.engines.values() if e.state not in gone
                   and now >= first_probe_at.get(e.engine_index, 0.0)
                   and generated.get(e.url, -inf) <= answered_before
                   and not admins[e.engine_index].known_alive(interval, now)]
        incarnations = [e.incarnation for e in engines]
        verdicts = await self._probe(engines)
        for engine, incarnation, healthy in zip(engines, incarnations, verdicts):
            current = self.registry.engines.get(engine.engine_index)
            if not healthy and current is not None and current.incarnation == incarnation:  # not restarted meanwhile
                admin = self.admins[engine.engine_index]
                stuck = (f" while {admin.in_flight[0]} had no answer for {admin.silent_for():.0f} s"
                         if admin.in_flight else "")
                await self.fail_engine(engine.engine_index, f"health check failed{stuck}")

    async def _probe(self, engines: list[EngineInfo]) -> list[bool]:
        """Whether each engine answers /health: in the answer pool's workers where there is one (at 1,024 engines a
        round's ~1,000 probes and their answers cost the loop ~20 us each), here for the engines they did not probe."""
        admins = [self.admins[e.engine_index] for e in engines]
        if self.answer_pool is None or not engines:
            return await healthy_all(admins, self.health_timeout_s, concurrency=self.health_concurrency)
        found = await self.answer_pool.probe_health([e.url for e in engines], self.health_timeout_s,
                                                    self.health_concurrency)
        missing = [index for index, healthy in enumerate(found) if healthy is None]
        here = await healthy_all([admins[i] for i in missing], self.health_timeout_s,
                                 concurrency=self.health_concurrency) if missing else []
        verdicts = [bool(healthy) for healthy in found]
        for index, healthy in zip(missing, here):
            verdicts[index] = healthy
        return verdicts

    async def fail_engine(self, engine_index: int, reason: str, *, incarnation: int | None = None) -> None:
        """Take an engine out (router first, so no new request goes there) and restart it if allowed.
        `incarnation`: the process the failure was seen on (`EngineInfo.incarnation`); a report about a process
        that was restarted since (a weight sync it broke, answered up to ABORT_GRACE_S later) is ignored: failing
        the new process for it restarted a healthy engine again and again (issue 37)."""
        engine = self.registry.engines[engine_index]
        if incarnation is not None and engine.incarnation != incarnation:
            log.info("engine %d: %s (its previous process; restarted since, the new one is kept)", engine_index,
                     reason)
            return
        if engine.state in (EngineState.FAILED, EngineState.LEFT):  # (a leaving engine's process stops on purpose)
            return
        was_serving = engine.state == EngineState.SERVING
        # FAILED before the first await: a second report of the same failure (the driver saw the process
        # exit, the health check timed out) must not start a second restart.
        self.registry.set_engine_state(engine_index, EngineState.FAILED, reason)
        self._event("failed", engine_index, reason)
        if self.connections is not None:  # its calls in flight (a stuck update) end now, not at their bound
            self.connections.forget(engine.url)
        if self.on_failed is not None:
            self.on_failed(engine_index)
        if was_serving:
            await self._off_the_router(engine.url)
        if self.restart is None or engine.job_id or engine.restarts >= self.max_restarts:  # an engine job's
            if not self.registry.live_engines():  # engine is its job's: never restarted here (it may join again)
                self.fatal = RuntimeError(f"every engine failed; engine {engine_index}: {reason} "
                                          f"(restarts used: {engine.restarts}/{self.max_restarts})")
            return
        task = asyncio.create_task(self._restart(engine_index), name=f"restart-engine-{engine_index}")
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _off_the_router(self, url: str) -> None:
        """Remove a serving engine from the router (a refusal only warns: the router may already have dropped it)."""
        try:
            await self._router_call("remove_worker", url)
        except Exception as error:
            log.warning("removing %s from the router: %s", url, error)

    async def leave(self, engine_index: int, reason: str) -> None:
        """An engine of an engine job leaves: LEFT (no new request, never restarted, no health checks), off the
        router, and the weight transport forgets it (as for a failure: a group it was in is rebuilt at the next
        sync). Its requests in flight are the caller's to abort (engine_membership)."""
        engine = self.registry.engines[engine_index]
        if engine.state in (EngineState.FAILED, EngineState.LEFT):
            return
        was_serving = engine.state == EngineState.SERVING
        self.registry.set_engine_state(engine_index, EngineState.LEFT, reason)
        self._event("left", engine_index, reason)
        if self.on_failed is not None:
            self.on_failed(engine_index)
        if was_serving:
            await self._off_the_router(engine.url)
        if not any(e.state == EngineState.STARTING for e in self.registry.engines.values()):
            self.engine_waiting.clear()

    async def _restart(self, engine_index: int) -> None:
        assert self.restart is not None
        engine = self.registry.engines[engine_index]
        engine.restarts += 1
        self.registry.changed()
        self._event("restarting", engine_index, f"attempt {engine.restarts}")
        try:
            url = await self.restart(engine_index)
        except Exception as error:
            self._event("restart failed", engine_index, str(error))
            if not self.registry.live_engines():
                self.fatal = error
            return
        await self.register(engine_index, url, tp_size=engine.tp_size, serving=False)
        self._event("restarted", engine_index, url)
